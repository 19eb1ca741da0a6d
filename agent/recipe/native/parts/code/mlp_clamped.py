"""The dense MLP down(clamped swiglu(gate_up)) of gpt_oss's form over gate / up halves (minimax_m3's dense layers),
gate and up merged into one column-parallel linear; the activation in plain torch (npu_swiglu has no clamp)."""

import torch.distributed as dist
from torch import nn

from module.linear import MergedColumnParallelLinear, RowParallelLinear

from .swiglu_clamped import clamped_swiglu, swiglu_alpha

MLP_WIDTH_KEY = "intermediate_size"     # the config key of the dense MLP's width (minimax_m3: dense_intermediate_size)


class ModelClampedMLP(nn.Module):
    def __init__(self, config, infer_config, comm_manager, prefix=""):
        super().__init__()
        self.attn_tp_size = infer_config.parallel_config.attn_tp_size
        self.comm_manager = comm_manager
        tp_rank = comm_manager.get_rank("attn_tp_group") if self.attn_tp_size > 1 else 0
        quant_config = getattr(config, "quant_config", None)
        width = getattr(config, MLP_WIDTH_KEY)
        self.gate_up_proj = MergedColumnParallelLinear(
            input_size=config.hidden_size, output_sizes=[width] * 2, bias=False, tp_size=self.attn_tp_size,
            tp_rank=tp_rank, quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(
            input_size=width, output_size=config.hidden_size, bias=False, tp_size=self.attn_tp_size, tp_rank=tp_rank,
            input_is_parallel=True, quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.limit, self.alpha = config.swiglu_limit, swiglu_alpha(config)

    def forward(self, hidden_states):
        out = self.down_proj(clamped_swiglu(self.gate_up_proj(hidden_states), self.limit, self.alpha))
        if self.attn_tp_size > 1:
            dist.all_reduce(out, group=self.comm_manager.get_group("attn_tp_group"))
        return out
