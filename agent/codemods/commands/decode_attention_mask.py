"""At decode, no prefill causal mask (upstream's common issue 2: aclnnFusedInferAttentionScoreV3
rejects `batchSize[2048] of atten_mask != batchSize[1] of query`)."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext

from agent.codemods._toolkit import Command, ends_with


class DecodeAttentionMaskCommand(Command):
    DESCRIPTION = ("At decode, no prefill causal mask: `m = forward_metadata.attention_mask` becomes "
                   "`m = forward_metadata.attention_mask if forward_metadata.is_prefill else None`.")

    def __init__(self, context: CodemodContext):
        super().__init__(context)
        self._decided: list[set[str]] = []      # per function: the names it sets to None itself
        self._in_prefill_branch = 0             # inside `if ...is_prefill...:`, the branch decides

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        # a function that sets the mask to None itself (`else: atten_mask = None`) decides it; one that
        # only reads is_prefill for other things (upstream qwen: the prompt padding) does not
        self._decided.append({target.target.value for assign in m.findall(node, m.Assign(value=m.Name("None")))
                              for target in assign.targets if isinstance(target.target, cst.Name)})

    def leave_FunctionDef(self, original_node, updated_node):
        self._decided.pop()
        return updated_node

    def visit_If(self, node: cst.If) -> None:
        if m.findall(node.test, m.Attribute(attr=m.Name("is_prefill"))) or \
                m.findall(node.test, m.Name("is_prefill")):
            self._in_prefill_branch += 1

    def leave_If(self, original_node: cst.If, updated_node: cst.If):
        if m.findall(original_node.test, m.Attribute(attr=m.Name("is_prefill"))) or \
                m.findall(original_node.test, m.Name("is_prefill")):
            self._in_prefill_branch -= 1
        return updated_node

    def leave_Assign(self, original_node: cst.Assign, updated_node: cst.Assign) -> cst.Assign:
        value = updated_node.value
        if not self._decided or self._in_prefill_branch or len(updated_node.targets) != 1:
            return updated_node
        target = updated_node.targets[0].target
        if isinstance(target, cst.Name) and target.value in self._decided[-1]:
            return updated_node
        if not (isinstance(value, cst.Attribute) and value.attr.value == "attention_mask"
                and ends_with(value.value, "forward_metadata")):
            return updated_node
        metadata = value.value
        return updated_node.with_changes(value=cst.IfExp(
            test=cst.Attribute(value=metadata, attr=cst.Name("is_prefill")), body=value, orelse=cst.Name("None")))
