"""The gated MLP down(act(gate(x)) * up(x)), gate and up merged into one column-parallel linear."""

import torch
import torch.distributed as dist
import torch_npu
from torch import nn
from transformers.activations import ACT2FN

from module.linear import MergedColumnParallelLinear, RowParallelLinear

from .norm_sub import ModelSubRMSNorm

SWIGLU = True           # the activation is silu: npu_swiglu computes silu(gate) * up
ACT = "hidden_act"      # the config key naming the gate's activation
MLP_BIAS = False        # the projections' biases: a literal, or the config key that sets them
FFN_SUB_NORM = False    # an RMSNorm of act(gate) * up over the intermediate width before down_proj (bitnet)
FF_AUTO_ADJUST = False  # the width is lfm2's block-adjusted one (block_ff_width), not config.intermediate_size
MLP_MULTIPLIERS = None  # the config key of (gate, down) multipliers: act(gate * g) * up, down(.) * d (falcon_h1)
GATE_UP_WIDTH_KEY = ""  # the config key of gate_up's whole width, the width its half (moshi's ffn_dim); "": none


def block_ff_width(config):
    """lfm2's MLP width: 2/3 of intermediate_size where block_auto_adjust_ff_dim, times block_ffn_dim_multiplier
    rounded up to block_multiple_of (transformers' Lfm2MLP)."""
    width = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        width = int(2 * width / 3)
        if config.block_ffn_dim_multiplier is not None:
            width = int(config.block_ffn_dim_multiplier * width)
            width = config.block_multiple_of * ((width + config.block_multiple_of - 1) // config.block_multiple_of)
    return width


class ModelMLP(nn.Module):
    def __init__(self, config, infer_config, comm_manager, prefix=""):
        super().__init__()
        self.attn_tp_size = infer_config.parallel_config.attn_tp_size
        self.comm_manager = comm_manager
        tp_rank = comm_manager.get_rank("attn_tp_group") if self.attn_tp_size > 1 else 0
        quant_config = getattr(config, "quant_config", None)
        self.gate_up_proj = MergedColumnParallelLinear(
            input_size=config.hidden_size, output_sizes=[block_ff_width(config) if FF_AUTO_ADJUST
            else getattr(config, GATE_UP_WIDTH_KEY) // 2 if GATE_UP_WIDTH_KEY else config.intermediate_size] * 2, bias=MLP_BIAS,
            tp_size=self.attn_tp_size, tp_rank=tp_rank, quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(
            input_size=block_ff_width(config) if FF_AUTO_ADJUST
            else getattr(config, GATE_UP_WIDTH_KEY) // 2 if GATE_UP_WIDTH_KEY else config.intermediate_size, output_size=config.hidden_size, bias=MLP_BIAS,
            tp_size=self.attn_tp_size, tp_rank=tp_rank, input_is_parallel=True, quant_config=quant_config,
            prefix=f"{prefix}.down_proj")
        if SWIGLU:
            # W8A8 int8 (both projections int8, models/qwen's _forward_w8a8int8): gate_up's int32 output is
            # dequantized, swiglu'd and quantized per token for down_proj in one npu_dequant_swiglu_quant
            # (the int32 output takes no float bias)
            self.w8a8 = (quant_config is not None and quant_config.mm_quant_mode == "w8a8int8"
                         and self.gate_up_proj.weight.dtype == torch.int8 and self.down_proj.weight.dtype == torch.int8
                         and self.gate_up_proj.bias is None)
        else:
            self.act_fn = ACT2FN[getattr(config, ACT)]
        if FFN_SUB_NORM:
            self.ffn_sub_norm = ModelSubRMSNorm(config.intermediate_size, config.rms_norm_eps, comm_manager,
                                                self.attn_tp_size)
            self.w8a8 = False       # npu_dequant_swiglu_quant quantizes swiglu's output for down_proj: no norm between
        if MLP_MULTIPLIERS:
            self.gate_multiplier, self.down_multiplier = (float(v) for v in getattr(config, MLP_MULTIPLIERS))
            self.w8a8 = False       # the gate is scaled between gate_up_proj and the activation

    def forward(self, hidden_states):
        if SWIGLU and self.w8a8:
            out = self._forward_w8a8int8(hidden_states)
        else:
            gate_up = self.gate_up_proj(hidden_states)
            if MLP_MULTIPLIERS:
                gate, up = gate_up.chunk(2, dim=-1)
                gate_up = torch.cat([gate * self.gate_multiplier, up], dim=-1)
            if SWIGLU:
                out = self.down_proj(self.ffn_sub_norm(torch_npu.npu_swiglu(gate_up, dim=-1)) if FFN_SUB_NORM
                                     else torch_npu.npu_swiglu(gate_up, dim=-1))
            else:
                # act(gate) * up in plain torch: npu_swiglu computes silu only
                gate, up = gate_up.chunk(2, dim=-1)
                out = self.down_proj(self.ffn_sub_norm(self.act_fn(gate) * up) if FFN_SUB_NORM else self.act_fn(gate) * up)
        if MLP_MULTIPLIERS:
            out = out * self.down_multiplier
        if self.attn_tp_size > 1:
            dist.all_reduce(out, group=self.comm_manager.get_group("attn_tp_group"))
        return out

    def _forward_w8a8int8(self, hidden_states):
        gate_up, pertoken_scale = self.gate_up_proj(hidden_states, out_dtype=torch.int32)
        intermediate, pertoken_scale = torch_npu.npu_dequant_swiglu_quant(
            gate_up, weight_scale=self.gate_up_proj.weight_scale, activation_scale=pertoken_scale,
            quant_scale=self.down_proj.smooth_scales, quant_mode=1,     # 1: dynamic, per token
            activate_left=True)                                         # silu on the first half (the gate)
        return self.down_proj(intermediate, pertoken_scale)
