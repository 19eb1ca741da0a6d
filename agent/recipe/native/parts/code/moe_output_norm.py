"""The sparse-MoE block whose output is RMS-normed (axk1's post_mlp_layernorm): the routed and shared experts summed
over the moe-tp ranks, then the norm (npu_rms_norm), as transformers' block ends."""

import torch
import torch.distributed as dist

from executor.utils.forward_metadata import get_forward_metadata

from .moe import ModelSparseMoeBlock
from .parallel import gather_rows, sum_own_rows
from .norm_rms import ModelRMSNorm as Norm

OUTPUT_NORM = "post_mlp_layernorm"     # the norm's name in the block (the checkpoint's, after transformers' renames)


class ModelOutputNormedSparseMoeBlock(ModelSparseMoeBlock):
    """Routed experts (the gating, npu_moe_init_routing_v2, npu_grouped_matmul, npu_moe_finalize_routing) and
    shared experts, summed over moe_tp, then RMS-normed. forward: hidden_states [T, H] -> [T, H]. Parameter
    names follow the checkpoint's block; load_weights takes names relative to it."""

    def __init__(self, config, infer_config, comm_manager, prefix=""):
        super().__init__(config, infer_config, comm_manager, prefix)
        setattr(self, OUTPUT_NORM, Norm(config.hidden_size, eps=config.rms_norm_eps))

    def forward(self, hidden_states):
        if self.chunk_tokens and hidden_states.shape[0] > self.moe_chunk_max_len:
            # a prompt longer than moe_chunk_max_len: chunk by chunk (each chunk's tokens route independently)
            return torch.cat([self.forward(chunk) for chunk in hidden_states.split(self.moe_chunk_max_len)])
        is_prefill = get_forward_metadata().is_prefill
        if self.layout.gather:
            # moe_tp_group holds other requests' ranks: every rank's tokens through the experts, each its own back
            group = self.comm_manager.get_group("moe_tp_group")
            hidden_states, rows = gather_rows(hidden_states, group, self.moe_tp_size, is_prefill)
            out = sum_own_rows(self.experts_forward(hidden_states, is_prefill), group, self.moe_tp_size, rows)
        else:
            out = self.experts_forward(hidden_states, is_prefill)
            if self.moe_tp_size > 1:
                dist.all_reduce(out, group=self.comm_manager.get_group("moe_tp_group"))
        # the norm on the whole sum: after the moe-tp ranks' partials are added
        return getattr(self, OUTPUT_NORM)(out)
