"""agent/codemods/commands/remove_gradient_checkpointing.py: training-only gradient checkpointing removed from a
vendored model."""

from __future__ import annotations

from libcst.codemod import CodemodTest

from agent.codemods.commands.remove_gradient_checkpointing import RemoveGradientCheckpointingCommand


class TestRemoveGradientCheckpointingCommand(CodemodTest):
    TRANSFORM = RemoveGradientCheckpointingCommand

    def test_noop_without_checkpointing(self) -> None:
        code = """
            from torch import nn

            class LlamaMLP(nn.Module):
                def forward(self, x):
                    if self.training:
                        x = x * 2
                    return x
        """
        self.assertCodemod(code, code)

    def test_flags_and_class_attribute_removed(self) -> None:
        before = """
            class LlamaPreTrainedModel(PreTrainedModel):
                base_model_prefix = "model"
                supports_gradient_checkpointing = True

            class OnlyFlag(PreTrainedModel):
                supports_gradient_checkpointing = True

            class LlamaModel(LlamaPreTrainedModel):
                def __init__(self, config):
                    super().__init__(config)
                    self.norm = Norm(config)
                    self.gradient_checkpointing = False

                    # Initialize weights and apply final processing
                    self.post_init()
        """
        after = """
            class LlamaPreTrainedModel(PreTrainedModel):
                base_model_prefix = "model"

            class OnlyFlag(PreTrainedModel):
                pass

            class LlamaModel(LlamaPreTrainedModel):
                def __init__(self, config):
                    super().__init__(config)
                    self.norm = Norm(config)

                    # Initialize weights and apply final processing
                    self.post_init()
        """
        self.assertCodemod(before, after)

    def test_if_with_else_keeps_else_body(self) -> None:
        before = """
            def run(self, layer, hidden):
                # checkpoint or not
                if self.gradient_checkpointing and self.training:
                    out = self._gradient_checkpointing_func(layer.__call__, hidden)
                else:
                    # plain call
                    out = layer(hidden)
                    out = out + 1
                return out
        """
        after = """
            def run(self, layer, hidden):
                # checkpoint or not
                # plain call
                out = layer(hidden)
                out = out + 1
                return out
        """
        self.assertCodemod(before, after)

    def test_if_without_else_dropped_and_elif_chain(self) -> None:
        before = """
            def run(self, use_cache, x):
                if self.gradient_checkpointing and self.training:
                    use_cache = False
                if x:
                    x = 1
                elif self.gradient_checkpointing:
                    x = 2
                else:
                    x = 3
                if self.training and self.gradient_checkpointing:
                    return None
                if self.training and self.text_model.gradient_checkpointing and x:
                    x = 4
                return x
        """
        after = """
            def run(self, use_cache, x):
                if x:
                    x = 1
                else:
                    x = 3
                return x
        """
        self.assertCodemod(before, after)

    def test_only_statement_becomes_pass_and_ifexp(self) -> None:
        before = """
            def run(self, cache):
                if self.gradient_checkpointing:
                    cache = None
                return layer(cache if not (self.gradient_checkpointing and self.training) else None)
        """
        after = """
            def run(self, cache):
                return layer(cache)
        """
        self.assertCodemod(before, after)

    def test_base_class_and_import_in_list(self) -> None:
        before = """
            import torch
            from torch import nn

            from transformers.modeling_layers import (
                GenericForQuestionAnswering,
                GradientCheckpointingLayer,
            )


            class LlamaDecoderLayer(GradientCheckpointingLayer):
                pass
        """
        after = """
            import torch
            from torch import nn

            from transformers.modeling_layers import (
                GenericForQuestionAnswering,
            )


            class LlamaDecoderLayer(nn.Module):
                pass
        """
        self.assertCodemod(before, after)

    def test_base_class_whole_import_removed_without_nn(self) -> None:
        before = """
            import torch

            from ...modeling_layers import GradientCheckpointingLayer
            from ...modeling_outputs import BaseModelOutputWithPast


            class GPTNeoXLayer(GradientCheckpointingLayer):
                pass
        """
        after = """
            import torch

            from ...modeling_outputs import BaseModelOutputWithPast


            class GPTNeoXLayer(torch.nn.Module):
                pass
        """
        self.assertCodemod(before, after)

    def test_unknown_condition_left_with_warning(self) -> None:
        code = """
            def run(self, x):
                if self.gradient_checkpointing or x:
                    x = 1
                return x
        """
        self.assertCodemod(
            code, code, expected_warnings=["1 reference(s) to gradient_checkpointing left in place"]
        )

    def test_import_kept_while_still_used(self) -> None:
        before = """
            import torch.nn as nn
            from transformers.modeling_layers import GradientCheckpointingLayer

            class Layer(GradientCheckpointingLayer):
                pass

            CHECK = isinstance(Layer(), GradientCheckpointingLayer)
        """
        after = """
            import torch.nn as nn
            from transformers.modeling_layers import GradientCheckpointingLayer

            class Layer(nn.Module):
                pass

            CHECK = isinstance(Layer(), GradientCheckpointingLayer)
        """
        self.assertCodemod(before, after)
