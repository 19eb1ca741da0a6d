"""agent/codemods/commands/add_forward_kwargs.py: a forward() without **kwargs accepts the extra keywords the
engine passes."""

from __future__ import annotations

from libcst.codemod import CodemodTest

from agent.codemods.commands.add_forward_kwargs import AddForwardKwargsCommand


# ---- codemods ------------------------------------------------------------------------------
class TestAddForwardKwargsCommand(CodemodTest):
    TRANSFORM = AddForwardKwargsCommand

    def test_noop_when_forward_has_kwargs(self) -> None:
        code = """
            class FooForCausalLM(nn.Module):
                def forward(self, input_ids, **kwargs):
                    return input_ids
        """
        self.assertCodemod(code, code, class_name="FooForCausalLM")

    def test_only_the_named_class(self) -> None:
        before = """
            class FooModel(nn.Module):
                def forward(self, input_ids):
                    return input_ids

            class FooForCausalLM(nn.Module):
                def forward(self, input_ids, logits_to_keep: int = 0):
                    return input_ids
        """
        after = """
            class FooModel(nn.Module):
                def forward(self, input_ids):
                    return input_ids

            class FooForCausalLM(nn.Module):
                def forward(self, input_ids, logits_to_keep: int = 0, **kwargs):
                    return input_ids
        """
        self.assertCodemod(before, after, class_name="FooForCausalLM")

    def test_one_parameter_per_line_and_keyword_only(self) -> None:
        before = """
            class FooForCausalLM(nn.Module):
                def forward(
                    self,
                    input_ids,
                    *,
                    cache=None,
                ):
                    def forward(x):
                        return x
                    return input_ids
        """
        after = """
            class FooForCausalLM(nn.Module):
                def forward(
                    self,
                    input_ids,
                    *,
                    cache=None,
                    **kwargs,
                ):
                    def forward(x):
                        return x
                    return input_ids
        """
        self.assertCodemod(before, after, class_name="FooForCausalLM")
