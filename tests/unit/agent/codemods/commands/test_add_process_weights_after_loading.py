"""agent/codemods/commands/add_process_weights_after_loading.py (upstream's common issue: MoE weights left as
loaded): the model gets its process_weights_after_loading hook."""

from __future__ import annotations

from libcst.codemod import CodemodTest

from agent.codemods.commands.add_process_weights_after_loading import AddProcessWeightsAfterLoadingCommand


class TestAddProcessWeightsAfterLoadingCommand(CodemodTest):
    TRANSFORM = AddProcessWeightsAfterLoadingCommand

    def test_noop_when_present(self) -> None:
        code = """
            class QwenForCausalLM:
                def process_weights_after_loading(self):
                    pass
        """
        self.assertCodemod(code, code, class_name="QwenForCausalLM")

    def test_hook_added_to_the_named_class_only(self) -> None:
        before = """
            class Other:
                pass

            class QwenForCausalLM:
                def forward(self, x):
                    return x
        """
        after = '''
            class Other:
                pass

            class QwenForCausalLM:
                def forward(self, x):
                    return x

                def process_weights_after_loading(self):
                    """Called by the framework after loading: each module's quant_method repacks its weights."""
                    for _, module in self.named_modules():
                        quant_method = getattr(module, "quant_method", None)
                        if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
                            quant_method.process_weights_after_loading(module)
        '''
        self.assertCodemod(before, after, class_name="QwenForCausalLM")
