"""agent/codemods/commands/transformers_init_weights.py: transformers' weight initialisation in a vendored model,
kept runnable outside transformers' loader."""

from __future__ import annotations

from libcst.codemod import CodemodTest

from agent.codemods.commands.transformers_init_weights import TransformersInitWeightsCommand
from agent.codemods.driver import transform


class TestTransformersInitWeightsCommand(CodemodTest):
    TRANSFORM = TransformersInitWeightsCommand

    def test_noop_without_transformers_initialization_or_init_weights(self) -> None:
        remote = """
            import torch

            class RemotePreTrainedModel(PreTrainedModel):
                def _init_weights(self, module):
                    module.weight.data.normal_()
        """
        self.assertCodemod(remote, remote)
        done = """
            from transformers import initialization as init

            class FalconH1MLP(nn.Module):
                def forward(self, x):
                    return x

            class FalconH1PreTrainedModel(PreTrainedModel):
                def _init_weights(self, module):
                    init.ones_(module.D)

                @classmethod
                def is_custom_code(cls):
                    return True
        """
        self.assertCodemod(done, done)

    def test_class_defining_init_weights_is_not_custom_code(self) -> None:
        before = """
            from transformers import initialization as init

            class FalconH1PreTrainedModel(PreTrainedModel):
                config_class = FalconH1Config

                @torch.no_grad()
                def _init_weights(self, module):
                    super()._init_weights(module)
                    if isinstance(module, FalconH1Model):
                        init.copy_(module.layers[0].mamba.mup_vector, compute_mup_vector(module.config))

                def helper(self):
                    pass
        """
        after = """
            from transformers import initialization as init

            class FalconH1PreTrainedModel(PreTrainedModel):
                config_class = FalconH1Config

                @torch.no_grad()
                def _init_weights(self, module):
                    super()._init_weights(module)
                    if isinstance(module, FalconH1Model):
                        init.copy_(module.layers[0].mamba.mup_vector, compute_mup_vector(module.config))

                @classmethod
                def is_custom_code(cls) -> bool:
                    # Vendored transformers code: the loader skips custom code's `_init_weights` on modules without
                    # tensors of their own, which leaves buffers such a module fills uninitialized (falcon_h1's mup_vector).
                    return False

                def helper(self):
                    pass
        """
        self.assertCodemod(before, after)


def test_inserted_is_custom_code_leaves_no_whitespace_only_line() -> None:
    """upstream's trailing-whitespace hook: the blank line before the inserted method has no indentation."""
    source = ("from transformers import initialization as init\n\n\nclass P(PreTrainedModel):\n"
              "    def _init_weights(self, module):\n        init.zeros_(module.weight)\n")
    code = transform(source, [TransformersInitWeightsCommand])
    assert "is_custom_code" in code
    assert not [line for line in code.splitlines() if line != line.rstrip()], code
