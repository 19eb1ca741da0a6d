"""Mamba1 mixer (jamba's mamba layers, mamba's and falcon_mamba's mixers, as transformers' JambaMambaMixer /
MambaMixer / FalconMambaMixer compute them): in_proj into [x | gate], a causal depthwise conv1d + SiLU over x with its
conv state, x_proj into [dt | B | C] (jamba: each RMS-normed with its weight, falcon_mamba: without one), dt_proj's
weight then its bias and softplus, the selective scan with a state per channel (h = exp(dt A) h + dt x B^T,
y = h C + D x, A = -exp(A_log) [channels, state]) with its ssm state, y silu(gate), out_proj. Upstream's models use no
NPU op for it: the conv and the scan are plain torch, float32 inside. Both states are one block per request in the
executor's Mamba cache (executor.core.kv_cache.cache_info.MambaCacheEntry), as the Mamba2 mixer keeps them."""

import torch
import torch.nn.functional as F
from torch import nn

from executor.core.kv_cache.cache_info import MambaCacheEntry
from executor.utils.forward_metadata import ForwardMetaData
from module.linear import ReplicatedLinear

from .linear_attention_gdn import write_conv_history
from .linear_attention_mamba2 import mamba_conv1d_packed, mamba_conv1d_update

# upstream's cache kind of a fixed-size recurrent state (executor/core/kv_cache)
MAMBA = "Mamba"
# the config keys of the mixer's sizes (jamba's; mamba's and falcon_mamba's: state_size, conv_kernel, time_step_rank,
# use_conv_bias, use_bias)
MAMBA1_STATE_KEY = "mamba_d_state"
MAMBA1_CONV_KEY = "mamba_d_conv"
MAMBA1_DT_RANK_KEY = "mamba_dt_rank"
MAMBA1_CONV_BIAS_KEY = "mamba_conv_bias"
MAMBA1_PROJ_BIAS_KEY = "mamba_proj_bias"
# the inner width: config[MAMBA1_INNER_KEY] where set (mamba's intermediate_size), else mamba_expand * hidden_size
MAMBA1_INNER_KEY = None
# RMSNorms of dt, B and C after x_proj: None, none (mamba); "weighted", each with its weight (jamba's dt_layernorm,
# b_layernorm, c_layernorm); "weightless" (falcon_mamba's)
MAMBA1_DT_BC_NORM = "weighted"
MAMBA1_DT_BC_NORM_EPS = "rms_norm_eps"     # the config key of their epsilon (falcon_mamba: mixer_rms_eps)


def selective_scan(x, dt, A, B, C, D, state, lengths):
    """The Mamba1 selective scan token by token in float32, TND, each sequence from its row of `state` [R, E, N]
    (updated in place): h = exp(dt A) h + dt x B^T, y = h C + D x. x and dt [T, E] (dt already softplus'd),
    A [E, N], B and C [T, N]. Returns y [T, E]."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for row, length in enumerate(lengths):
        current = state[row].float()
        for t in range(start, start + length):
            current = current * torch.exp(dt[t][:, None] * A) + (dt[t] * x[t])[:, None] * B[t][None, :]
            out[t] = current @ C[t] + D * x[t]
        state[row] = current.to(state.dtype)
        start += length
    return out


class ModelMamba1RMSNorm(nn.Module):
    """RMSNorm of dt, B or C in float32, times its weight (jamba's) or without one (falcon_mamba's)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        if MAMBA1_DT_BC_NORM == "weighted":
            self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        hidden_states = hidden_states.float()
        hidden_states = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        if MAMBA1_DT_BC_NORM == "weighted":
            hidden_states = self.weight.float() * hidden_states
        return hidden_states


class ModelMamba1Mixer(nn.Module):
    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__()
        if infer_config.parallel_config.attn_tp_size > 1:
            raise ValueError("the generated file runs the Mamba layers whole on each rank: set attn_tp_size to 1")
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.ssm_state_size = getattr(config, MAMBA1_STATE_KEY)
        self.conv_kernel_size = getattr(config, MAMBA1_CONV_KEY)
        self.time_step_rank = int(getattr(config, MAMBA1_DT_RANK_KEY))
        if MAMBA1_INNER_KEY is not None:
            self.intermediate_size = getattr(config, MAMBA1_INNER_KEY)
        else:
            self.intermediate_size = int(config.mamba_expand * self.hidden_size)
        inner, proj_bias = self.intermediate_size, getattr(config, MAMBA1_PROJ_BIAS_KEY)
        quant_config = getattr(config, "quant_config", None)
        self.in_proj = ReplicatedLinear(self.hidden_size, 2 * inner, bias=proj_bias, quant_config=quant_config,
                                        prefix=f"{prefix}.in_proj")
        self.conv1d = nn.Conv1d(inner, inner, kernel_size=self.conv_kernel_size,
                                bias=getattr(config, MAMBA1_CONV_BIAS_KEY), groups=inner,
                                padding=self.conv_kernel_size - 1)
        self.x_proj = nn.Linear(inner, self.time_step_rank + 2 * self.ssm_state_size, bias=False)
        self.dt_proj = nn.Linear(self.time_step_rank, inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(inner, self.ssm_state_size))
        self.D = nn.Parameter(torch.ones(inner))
        if MAMBA1_DT_BC_NORM is not None:
            eps = getattr(config, MAMBA1_DT_BC_NORM_EPS)
            self.dt_layernorm = ModelMamba1RMSNorm(self.time_step_rank, eps=eps)
            self.b_layernorm = ModelMamba1RMSNorm(self.ssm_state_size, eps=eps)
            self.c_layernorm = ModelMamba1RMSNorm(self.ssm_state_size, eps=eps)
        self.out_proj = ReplicatedLinear(inner, self.hidden_size, bias=proj_bias, quant_config=quant_config,
                                         prefix=f"{prefix}.out_proj")
        self.conv_state = torch.Tensor([])
        self.ssm_state = torch.Tensor([])
        cache_dtype = torch.get_default_dtype()
        self.cache_entries = [
            MambaCacheEntry(cache_name=name, shape=shape, dtype=cache_dtype, needs_block=True,
                            tensor_setter=lambda tensor, layer=self, name=name: setattr(layer, name, tensor))
            for name, shape in (("conv_state", [inner, self.conv_kernel_size - 1]),
                                ("ssm_state", [inner, self.ssm_state_size]))]

    def forward(self, hidden_states, forward_metadata: ForwardMetaData):
        is_prefill = forward_metadata.is_prefill
        padded_q_len = hidden_states.size(0)
        q_len = padded_q_len
        if is_prefill and 0 < forward_metadata.prompt_tokens < padded_q_len:
            hidden_states = hidden_states[:forward_metadata.prompt_tokens]
            q_len = forward_metadata.prompt_tokens
        if not self.conv_state.numel() or not self.ssm_state.numel():
            raise RuntimeError("Mamba state not allocated: the executor binds it through get_cache_info()")
        mixed, gate = self.in_proj(hidden_states).chunk(2, dim=-1)
        # each request's state block (one per request: next_n 0)
        blocks = forward_metadata.block_table[MAMBA][:, 0].long()
        weight = self.conv1d.weight.squeeze(1)
        if is_prefill:
            lengths = forward_metadata.actual_seq_lengths_q.long()
            ends = forward_metadata.actual_seq_lengths_cu_q.long()
            starts = ends - lengths
            positions = torch.arange(q_len, device=mixed.device) - torch.repeat_interleave(starts, lengths)
            write_conv_history(self.conv_state, blocks, mixed, starts, ends)
            x = mamba_conv1d_packed(mixed, weight, self.conv1d.bias, positions)
            lengths_list = lengths.tolist()
            state = torch.zeros((len(lengths_list), self.intermediate_size, self.ssm_state_size),
                                dtype=torch.float32, device=mixed.device)
        else:
            x, history = mamba_conv1d_update(mixed, self.conv_state.index_select(0, blocks), weight, self.conv1d.bias)
            self.conv_state.index_copy_(0, blocks, history)
            lengths_list = [1] * q_len
            state = self.ssm_state.index_select(0, blocks).float()
        dt, B, C = self.x_proj(x.to(self.x_proj.weight.dtype)).split(
            (self.time_step_rank, self.ssm_state_size, self.ssm_state_size), dim=-1)
        if MAMBA1_DT_BC_NORM is not None:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        # dt_proj's weight, then its bias in float32 (transformers' order)
        dt = F.linear(dt.to(self.dt_proj.weight.dtype), self.dt_proj.weight).float() + self.dt_proj.bias.float()
        dt = F.softplus(dt)
        A = -torch.exp(self.A_log.float())
        out = selective_scan(x, dt, A, B.float(), C.float(), self.D.float(), state, lengths_list)
        self.ssm_state.index_copy_(0, blocks, state.to(self.ssm_state.dtype))
        out = out * F.silu(gate.float())
        out = self.out_proj(out.to(hidden_states.dtype))
        if q_len < padded_q_len:
            out = torch.cat([out, out.new_zeros((padded_q_len - q_len, out.size(-1)))], dim=0)
        return out
