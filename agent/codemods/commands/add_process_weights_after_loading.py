"""A model class gets the process_weights_after_loading hook upstream's framework calls after loading
(upstream's common issue 4: without it MoE / quantized weights are not repacked and
aclnnGroupedMatmul reports `Dim 1 mismatch`)."""

from __future__ import annotations

import libcst as cst
from libcst.codemod import CodemodContext

from agent.codemods._toolkit import Command

_PROCESS_WEIGHTS = '''
def process_weights_after_loading(self):
    """Called by the framework after loading: each module's quant_method repacks its weights."""
    for _, module in self.named_modules():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
            quant_method.process_weights_after_loading(module)
'''


class AddProcessWeightsAfterLoadingCommand(Command):
    DESCRIPTION = "Give one model class the process_weights_after_loading hook the framework calls after loading."

    def __init__(self, context: CodemodContext, class_name: str):
        super().__init__(context)
        self.class_name = class_name

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        if updated_node.name.value != self.class_name or not isinstance(updated_node.body, cst.IndentedBlock):
            return updated_node
        body = list(updated_node.body.body)
        if any(isinstance(s, cst.FunctionDef) and s.name.value == "process_weights_after_loading" for s in body):
            return updated_node
        method = cst.parse_statement(_PROCESS_WEIGHTS.lstrip("\n"))
        method = method.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        return updated_node.with_changes(body=updated_node.body.with_changes(body=[*body, method]))
