"""What the codemod tests feed the commands: the package and sibling modules of a vendored llama, and the guarded
torch_npu import the guard command writes."""

from __future__ import annotations


PACKAGE = "transformers.models.llama"
SIBLINGS = {"transformers.models.llama.configuration_llama": "models.configuration_my_model"}

GUARD = '''
try:
    import torch_npu  # noqa: F401  registers the "npu" device with torch
except Exception:  # NPU backend: not installed, or installed without the CANN runtime
    torch_npu = None
'''
