"""gpt_oss's clamped swiglu over gate / up halves (minimax_m3's experts, shared experts and dense MLPs), in plain
torch: npu_swiglu has no clamp, and upstream's FusedMoEGMM swiglu_limit path computes step-3.7's other form (silu,
then the clamp; no alpha, no up + 1)."""

import torch
import torch_npu

from module.fuse_moe_gmm import FusedMoEGMM



def swiglu_alpha(config):
    """The clamped swiglu's alpha: the config's, else transformers' constant 1.702."""
    return getattr(config, "swiglu_alpha", 1.702)


def clamped_swiglu(gate_up, limit, alpha):
    """(up + 1) * gate * sigmoid(alpha * gate) of [gate | up] halves, gate clamped above at limit, up to +-limit."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ModelClampedExperts(FusedMoEGMM):
    """FusedMoEGMM's experts (w13 stacked as [gate | up] halves, w2; its loaders and its transpose at load) through
    npu_grouped_matmul, the clamped swiglu between the two matmuls."""

    def __init__(self, **kwargs):
        if kwargs.get("quant_config") is not None:
            raise ValueError("a quantized checkpoint of experts with the clamped swiglu: the native file computes "
                             "them in float only; use the checkpoint's float weights")
        super().__init__(**kwargs)
        self.limit = self.alpha = None       # the block sets them from the config

    def forward(self, x, expert_tokens, group_list_type=0, **kwargs):
        gate_up = torch_npu.npu_grouped_matmul([x], [self.w13_weight], group_list=expert_tokens, group_type=0,
                                               group_list_type=group_list_type, split_item=3)[0]
        return torch_npu.npu_grouped_matmul([clamped_swiglu(gate_up, self.limit, self.alpha)], [self.w2_weight],
                                            group_list=expert_tokens, group_type=0,
                                            group_list_type=group_list_type, split_item=3)[0]
