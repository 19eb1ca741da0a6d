"""Experts of gelu-tanh(gate) * up over [gate | up] halves (gemma4's Gemma4TextExperts), as upstream's models/gemma_4
runs them: npu_grouped_matmul, npu_geglu (tanh, the left half activated), npu_grouped_matmul."""

import torch_npu

from module.fuse_moe_gmm import FusedMoEGMM


class ModelGegluExperts(FusedMoEGMM):
    """FusedMoEGMM's experts (w13 stacked as [gate | up] halves, w2; its loaders and its transpose at load) with
    npu_geglu in place of npu_swiglu: gelu_pytorch_tanh(gate) * up (the op takes it in float32 and rounds the product
    once; transformers rounds the gelu and the product in the run dtype)."""

    def __init__(self, **kwargs):
        if kwargs.get("quant_config") is not None:
            raise ValueError("a quantized checkpoint of gelu-tanh experts: the native file computes them in float "
                             "only; use the checkpoint's float weights")
        super().__init__(**kwargs)

    def forward(self, x, expert_tokens, group_list_type=0, **kwargs):
        gate_up = torch_npu.npu_grouped_matmul([x], [self.w13_weight], group_list=expert_tokens, group_type=0,
                                               group_list_type=group_list_type, split_item=3)[0]
        # approximate 1: gelu's tanh form; activate_left: the gate is the first half (npu_geglu's default the second)
        out, _ = torch_npu.npu_geglu(gate_up, dim=-1, approximate=1, activate_left=True)
        return torch_npu.npu_grouped_matmul([out], [self.w2_weight], group_list=expert_tokens, group_type=0,
                                            group_list_type=group_list_type, split_item=3)[0]
