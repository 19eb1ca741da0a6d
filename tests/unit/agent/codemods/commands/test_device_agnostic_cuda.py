"""agent/codemods/commands/device_agnostic_cuda.py: hard-coded CUDA devices in model code made device-agnostic."""

from __future__ import annotations

from libcst.codemod import CodemodTest

from agent.codemods.commands.device_agnostic_cuda import DeviceAgnosticCudaCommand


class TestDeviceAgnosticCudaCommand(CodemodTest):
    TRANSFORM = DeviceAgnosticCudaCommand

    def test_noop_without_hardcoded_cuda(self) -> None:
        code = """
            import torch


            def f(x):
                if x.device.type == "cuda" and torch.cuda.is_available():
                    return x.to(x.device)
                return x
        """
        self.assertCodemod(code, code)

    def test_model_method_uses_self_device(self) -> None:
        before = """
            import torch


            class FooModel(FooPreTrainedModel):
                def forward(self, position_ids):
                    position_ids = position_ids.cuda()
                    mask = torch.ones(3, device="cuda:0")
                    return mask.to("cuda"), torch.device("cuda")
        """
        after = """
            import torch


            class FooModel(FooPreTrainedModel):
                def forward(self, position_ids):
                    position_ids = position_ids.to(self.device)
                    mask = torch.ones(3, device=self.device)
                    return mask.to(self.device), self.device
        """
        self.assertCodemod(before, after)

    def test_hidden_states_device_and_non_blocking(self) -> None:
        before = """
            class FooAttention(nn.Module):
                def forward(self, hidden_states, mask):
                    return mask.cuda(non_blocking=True)
        """
        after = """
            class FooAttention(nn.Module):
                def forward(self, hidden_states, mask):
                    return mask.to(hidden_states.device, non_blocking=True)
        """
        self.assertCodemod(before, after)

    def test_helpers_added_for_free_functions_and_synchronize(self) -> None:
        before = '''
            """Doc."""
            import torch

            SCALE = 2


            def rope(t):
                torch.cuda.synchronize()
                return t.cuda(torch.cuda.current_device())
        '''
        after = '''
            """Doc."""
            import torch
            import functools
            import os

            SCALE = 2


            @functools.lru_cache(maxsize=None)
            def _recipe_device():
                """The device this recipe runs on (replaces hard-coded CUDA; RECIPE_DEVICE overrides)."""
                from engine.environment import select_device

                return select_device(os.environ.get("RECIPE_DEVICE", "auto"))


            def _recipe_synchronize():
                """Wait for the recipe device's queued work (replaces torch.cuda.synchronize())."""
                from engine.environment import synchronize

                synchronize(_recipe_device())


            def rope(t):
                _recipe_synchronize()
                return t.to(_recipe_device())
        '''
        self.assertCodemod(before, after)
