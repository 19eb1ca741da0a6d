"""agent/codemods/commands/torch_npu_guard.py: the guarded torch_npu import, ensured by vendoring and added by
the repairs."""

from __future__ import annotations

import functools

from libcst.codemod import CodemodTest

from agent.codemods.commands.torch_npu_guard import TorchNpuImportGuardCommand
from codemod_inputs import GUARD


class TestTorchNpuImportGuardEnsured(CodemodTest):
    """The guard as vendoring runs it (ensure=True): a modeling file gets a guarded torch_npu import."""
    TRANSFORM = functools.partial(TorchNpuImportGuardCommand, ensure=True)

    def test_noop_already_guarded(self) -> None:
        code = "import torch\n" + GUARD + "\nx = 1\n"
        self.assertCodemod(code, code)

    def test_other_import_form_is_guarded_not_doubled(self) -> None:
        before = """
            import torch
            import torch_npu as npu
        """
        after = ("import torch\ntry:\n    import torch_npu as npu\nexcept Exception:  # NPU backend: not installed, "
                 "or installed without the CANN runtime\n    npu = None\n")
        self.assertCodemod(before, after)

    def test_after_import_torch(self) -> None:
        before = """
            from collections.abc import Callable

            import torch
            from torch import nn

            from transformers.activations import ACT2FN
        """
        after = (
            "from collections.abc import Callable\n\nimport torch" + GUARD
            + "from torch import nn\n\nfrom transformers.activations import ACT2FN\n"
        )
        self.assertCodemod(before, after)

    def test_after_import_block_without_torch(self) -> None:
        before = '''
            """Configuration."""
            from __future__ import annotations

            import math

            from transformers.configuration_utils import PreTrainedConfig


            class C(PreTrainedConfig):
                pass
        '''
        after = (
            '"""Configuration."""\nfrom __future__ import annotations\n\nimport math\n\n'
            "from transformers.configuration_utils import PreTrainedConfig" + GUARD
            + "\n\nclass C(PreTrainedConfig):\n    pass\n"
        )
        self.assertCodemod(before, after)

    def test_bare_import_becomes_guarded(self) -> None:
        before = """
            import torch

            import torch_npu
            x = 1
        """
        after = ("import torch\n\ntry:\n    import torch_npu\nexcept Exception:  # NPU backend: not installed, "
                 "or installed without the CANN runtime\n    torch_npu = None\nx = 1\n")
        self.assertCodemod(before, after)


class TestGuardTorchNpuImport(CodemodTest):
    TRANSFORM = TorchNpuImportGuardCommand
    CAUGHT = "except Exception:  # NPU backend: not installed, or installed without the CANN runtime\n"

    def test_noop(self):
        code = "import torch\ntry:\n    import torch_npu\nexcept ImportError:\n    torch_npu = None\n"
        self.assertCodemod(code, code)

    def test_incidental_imports_are_guarded(self):
        before = "import torch\nimport torch_npu\nfrom torch_npu.contrib import transfer_to_npu\n\nx = torch.ones(1)\n"
        after = (f"import torch\ntry:\n    import torch_npu\n{self.CAUGHT}"
                 f"    torch_npu = None\ntry:\n    from torch_npu.contrib import transfer_to_npu\n"
                 f"{self.CAUGHT}    transfer_to_npu = None\n\nx = torch.ones(1)\n")
        self.assertCodemod(before, after)

    def test_import_used_by_a_kernel_stays(self):
        code = "import torch_npu\n\ny = torch_npu.npu_rms_norm(x, w)\n"
        self.assertCodemod(code, code, expected_warnings=["torch_npu is used beyond its import: left as is"])

    def test_a_repair_adds_no_import(self):
        code = "import torch\n\nx = torch.ones(1)\n"
        self.assertCodemod(code, code)
