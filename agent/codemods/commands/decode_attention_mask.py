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
        self._has_branch: list[bool] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        # a function that already looks at is_prefill decides the mask itself
        self._has_branch.append(bool(m.findall(node, m.Attribute(attr=m.Name("is_prefill")))))

    def leave_FunctionDef(self, original_node, updated_node):
        self._has_branch.pop()
        return updated_node

    def leave_Assign(self, original_node: cst.Assign, updated_node: cst.Assign) -> cst.Assign:
        value = updated_node.value
        if not self._has_branch or self._has_branch[-1] or len(updated_node.targets) != 1:
            return updated_node
        if not (isinstance(value, cst.Attribute) and value.attr.value == "attention_mask"
                and ends_with(value.value, "forward_metadata")):
            return updated_node
        metadata = value.value
        return updated_node.with_changes(value=cst.IfExp(
            test=cst.Attribute(value=metadata, attr=cst.Name("is_prefill")), body=value, orelse=cst.Name("None")))
