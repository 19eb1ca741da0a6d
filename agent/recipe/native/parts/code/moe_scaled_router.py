"""The sparse-MoE block whose router scales its own input (gemma4's Gemma4TextRouter): the router on the block's input
RMS-normed without a weight, times a learned per-channel `scale` and hidden_size ** -0.5, its softmax top-k
renormalised and each chosen expert's weight times its learned `per_expert_scale`; the experts on the block's input
through the block's experts norm (code/moe.py's EXPERTS_NORM), as transformers' decoder layer feeds them."""

import torch
import torch_npu
from torch import nn

from .moe import EXPERTS_KEY, EXPERTS_NORM, ROUTER, ModelSparseMoeBlock
from .norm_rms import ModelRMSNorm as Norm


class ModelScaledRouterSparseMoeBlock(ModelSparseMoeBlock):
    """code/moe.py's block (npu_moe_init_routing_v2, the grouped matmuls, npu_moe_finalize_routing; expert parallel)
    with the scaled router. forward: the residual stream [T, H] -> [T, H]. The router's linear loads the checkpoint's
    router.proj (ROUTER_STORED), its scale and per_expert_scale their own tensors."""

    def __init__(self, config, infer_config, comm_manager, prefix=""):
        experts = getattr(config, EXPERTS_KEY, None)
        if not experts:
            # a checkpoint of the family without the branch (gemma4's enable_moe_block false): not this file's
            raise ValueError(f"config.{EXPERTS_KEY} is {experts!r}: this file's layers hold a sparse-MoE branch beside "
                             "the dense MLP; derive the recipe from this checkpoint instead")
        super().__init__(config, infer_config, comm_manager, prefix)
        router = getattr(self, ROUTER)
        router.scale = nn.Parameter(torch.empty(self.hidden_size), requires_grad=False)
        router.per_expert_scale = nn.Parameter(torch.empty(self.num_experts), requires_grad=False)
        # the router's norm has no weight: npu_rms_norm on ones (a buffer, not in the checkpoint)
        self.register_buffer("router_norm_ones", torch.ones(self.hidden_size), persistent=False)
        self.router_norm_eps = config.rms_norm_eps
        setattr(self, EXPERTS_NORM, Norm(config.hidden_size, eps=config.rms_norm_eps))

    def gating(self, hidden_states):
        """(top-k weights [T, K] in fp32, expert ids [T, K] int32) as transformers' Gemma4TextRouter computes them."""
        router = getattr(self, ROUTER)
        normed = torch_npu.npu_rms_norm(hidden_states, self.router_norm_ones.to(hidden_states.dtype),
                                        self.router_norm_eps)[0]
        logits = router(normed * router.scale * self.hidden_size ** -0.5)
        weights, expert_ids, _ = torch_npu.npu_moe_gating_top_k_softmax(logits, None, k=self.top_k)
        weights = weights.float()
        weights = weights / weights.sum(dim=-1, keepdim=True)
        # each chosen expert's learned scale, after the renormalisation
        weights = weights * router.per_expert_scale.float()[expert_ids.long()]
        return weights, expert_ids.to(torch.int32)
