"""Mamba2 mixer (bamba's mamba layers, as transformers' BambaMixer / Mamba2Mixer compute them): in_proj into
[gate | x B C | dt], a causal depthwise conv1d + SiLU over x B C with its conv state, the SSD recurrence
(dt = softplus(dt + dt_bias) clamped to time_step_limit, h = exp(dt A) h + dt B x^T, y = h C + D x, A = -exp(A_log),
B and C shared by each group's heads) with its ssm state, a gated RMSNorm over n_groups groups (norm(y silu(gate)))
and out_proj. Upstream's models use no NPU op for it: the conv and the recurrence are plain torch, float32 inside.
Both states are one block per request in the executor's Mamba cache (executor.core.kv_cache.cache_info.MambaCacheEntry,
a block table row per request): a prefill starts from zero state and writes each request's last conv inputs and
final ssm state to its block; a decode reads and writes them there."""

import torch
import torch.nn.functional as F
from torch import nn

from executor.core.kv_cache.cache_info import MambaCacheEntry
from executor.utils.forward_metadata import ForwardMetaData
from module.linear import ReplicatedLinear

from .linear_attention_gdn import write_conv_history

# upstream's cache kind of a fixed-size recurrent state (executor/core/kv_cache)
MAMBA = "Mamba"
NORM_EPS = "rms_norm_eps"       # the config key of the norms' epsilon
# the gated norm over each of n_groups groups (mamba_ssm's kernel, transformers after 5.0), else over the whole width
MAMBA_NORM_GROUPED = True
# the config keys of the mixer's sizes, as the architecture names them (bamba's; nemotron_h: mamba_num_heads, ...)
MAMBA_HEADS = "mamba_n_heads"
MAMBA_HEAD_DIM = "mamba_d_head"
MAMBA_GROUPS = "mamba_n_groups"
MAMBA_STATE = "mamba_d_state"
MAMBA_CONV = "mamba_d_conv"
MAMBA_EXPAND = "mamba_expand"   # the inner width is expand x hidden; None: heads x head_dim (nemotron_h)
MAMBA_CONV_BIAS = "mamba_conv_bias"
MAMBA_PROJ_BIAS = "mamba_proj_bias"
# dt's clamp: config.time_step_limit; a key here: (config.<key>, inf) (nemotron_h's time_step_min)
MAMBA_DT_MIN = None
# falcon_h1's multipliers: the input times config.ssm_in_multiplier, in_proj's [gate | x | B | C | dt] each times its
# entry of config.ssm_multipliers
MAMBA_MULTIPLIERS = False
# the config key that switches the gated norm (falcon_h1's mamba_rms_norm): off, y * silu(gate) alone and no norm weight
MAMBA_NORM_KEY = None
# the config key of the norm before the gate (falcon_h1's mamba_norm_before_gate), which the file does not write
MAMBA_NORM_ORDER_KEY = None


def mamba_conv1d_update(hidden_states, conv_state, weight, bias):
    """One token per request through the depthwise conv1d: hidden_states [B, C], conv_state [B, C, K - 1] the
    request's last inputs; returns (silu(out) [B, C] in float32, the new state)."""
    window = torch.cat([conv_state, hidden_states.unsqueeze(-1).to(conv_state.dtype)], dim=-1)     # [B, C, K]
    out = (window.to(weight.dtype) * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out.float()), window[:, :, 1:]


def mamba_conv1d_packed(hidden_states, weight, bias, positions):
    """The depthwise causal conv1d over packed sequences (TND, each from zero history): hidden_states [T, C],
    weight [C, K], positions [T] each token's position in its sequence; silu(out) [T, C] in float32."""
    kernel = weight.shape[-1]
    padded = F.pad(hidden_states, (0, 0, kernel - 1, 0))
    tokens = hidden_states.shape[0]
    out = torch.zeros_like(hidden_states, dtype=weight.dtype)
    for shift in range(kernel):
        # x_{t - shift}, zero where it lies before the token's own sequence
        shifted = padded[kernel - 1 - shift:kernel - 1 - shift + tokens].to(weight.dtype)
        out = out + shifted * weight[:, kernel - 1 - shift] * (positions >= shift).unsqueeze(-1).to(weight.dtype)
    if bias is not None:
        out = out + bias
    return F.silu(out.float())


def ssd_recurrence(x, dt, A, B, C, D, state, lengths):
    """The Mamba2 state-space recurrence token by token in float32, TND, each sequence from its row of `state`
    [B, H, P, N] (updated in place): h = exp(dt A) h + dt x B^T, y = h C + D x. x [T, H, P], dt [T, H] (already
    softplus'd), B and C [T, H, N] (per head). Returns y [T, H, P]."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    decay = torch.exp(dt * A)                                                              # [T, H]
    start = 0
    for row, length in enumerate(lengths):
        current = state[row].float()
        for t in range(start, start + length):
            current = current * decay[t][:, None, None] + (dt[t][:, None] * x[t]).unsqueeze(-1) * B[t].unsqueeze(1)
            out[t] = (current @ C[t].unsqueeze(-1)).squeeze(-1) + D[:, None] * x[t]
        state[row] = current.to(state.dtype)
        start += length
    return out


class ModelMamba2RMSNormGated(nn.Module):
    """RMSNorm of y * silu(gate) over each of n_groups groups, times the weight (transformers' MambaRMSNormGated
    with norm_before_gate False), in float32."""

    def __init__(self, hidden_size, group_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.group_size = group_size

    def forward(self, hidden_states, gate):
        hidden_states = hidden_states.float() * F.silu(gate.float())
        grouped = hidden_states.view(*hidden_states.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight.float() * grouped.view(hidden_states.shape)


class ModelMamba2Mixer(nn.Module):
    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__()
        if infer_config.parallel_config.attn_tp_size > 1:
            raise ValueError("the generated file runs the Mamba2 layers whole on each rank: set attn_tp_size to 1")
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = getattr(config, MAMBA_HEADS)
        self.head_dim = getattr(config, MAMBA_HEAD_DIM)
        self.n_groups = getattr(config, MAMBA_GROUPS)
        self.ssm_state_size = getattr(config, MAMBA_STATE)
        self.conv_kernel_size = getattr(config, MAMBA_CONV)
        self.intermediate_size = (int(getattr(config, MAMBA_EXPAND) * self.hidden_size) if MAMBA_EXPAND
                                  else self.num_heads * self.head_dim)
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * self.ssm_state_size
        if MAMBA_DT_MIN:
            self.time_step_limit = (getattr(config, MAMBA_DT_MIN), float("inf"))
        else:
            self.time_step_limit = tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf")))
        quant_config = getattr(config, "quant_config", None)
        self.in_proj = ReplicatedLinear(self.hidden_size, self.intermediate_size + self.conv_dim + self.num_heads,
                                        bias=getattr(config, MAMBA_PROJ_BIAS), quant_config=quant_config,
                                        prefix=f"{prefix}.in_proj")
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size=self.conv_kernel_size,
                                bias=getattr(config, MAMBA_CONV_BIAS), groups=self.conv_dim, padding=self.conv_kernel_size - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = ModelMamba2RMSNormGated(self.intermediate_size, self.intermediate_size // self.n_groups
                                            if MAMBA_NORM_GROUPED else self.intermediate_size,
                                            eps=getattr(config, NORM_EPS))
        if MAMBA_NORM_KEY and not getattr(config, MAMBA_NORM_KEY):
            del self.norm           # y * silu(gate) alone: the checkpoint holds no norm weight
        elif MAMBA_NORM_ORDER_KEY and getattr(config, MAMBA_NORM_ORDER_KEY, False):
            raise ValueError(f"config.{MAMBA_NORM_ORDER_KEY} is true: the Mamba2 mixer's norm before its gate is not "
                             "written by this file")
        self.out_proj = ReplicatedLinear(self.intermediate_size, self.hidden_size, bias=getattr(config, MAMBA_PROJ_BIAS),
                                         quant_config=quant_config, prefix=f"{prefix}.out_proj")
        if MAMBA_MULTIPLIERS:
            gate_m, x_m, b_m, c_m, dt_m = config.ssm_multipliers
            self.ssm_in_multiplier = config.ssm_in_multiplier
            self.gate_multiplier, self.dt_multiplier = gate_m, dt_m
            groups_state = self.n_groups * self.ssm_state_size
            # x, B and C's multipliers over the conv's channels (not a parameter: no checkpoint tensor)
            self.register_buffer("mixed_multipliers", torch.cat([torch.full((width,), float(value)) for width, value in (
                (self.intermediate_size, x_m), (groups_state, b_m), (groups_state, c_m))]), persistent=False)
        self.conv_state = torch.Tensor([])
        self.ssm_state = torch.Tensor([])
        cache_dtype = torch.get_default_dtype()
        self.cache_entries = [
            MambaCacheEntry(cache_name=name, shape=shape, dtype=cache_dtype, needs_block=True,
                            tensor_setter=lambda tensor, layer=self, name=name: setattr(layer, name, tensor))
            for name, shape in (("conv_state", [self.conv_dim, self.conv_kernel_size - 1]),
                                ("ssm_state", [self.num_heads, self.head_dim, self.ssm_state_size]))]

    def forward(self, hidden_states, forward_metadata: ForwardMetaData):
        is_prefill = forward_metadata.is_prefill
        padded_q_len = hidden_states.size(0)
        q_len = padded_q_len
        if is_prefill and 0 < forward_metadata.prompt_tokens < padded_q_len:
            hidden_states = hidden_states[:forward_metadata.prompt_tokens]
            q_len = forward_metadata.prompt_tokens
        if not self.conv_state.numel() or not self.ssm_state.numel():
            raise RuntimeError("Mamba2 state not allocated: the executor binds it through get_cache_info()")
        if MAMBA_MULTIPLIERS:
            hidden_states = hidden_states * self.ssm_in_multiplier
        gate, mixed, dt = self.in_proj(hidden_states).split(
            (self.intermediate_size, self.conv_dim, self.num_heads), dim=-1)
        if MAMBA_MULTIPLIERS:
            gate, dt = gate * self.gate_multiplier, dt * self.dt_multiplier
            mixed = mixed * self.mixed_multipliers.to(mixed.dtype)
        # each request's state block (one per request: next_n 0)
        blocks = forward_metadata.block_table[MAMBA][:, 0].long()
        weight = self.conv1d.weight.squeeze(1)
        if is_prefill:
            lengths = forward_metadata.actual_seq_lengths_q.long()
            ends = forward_metadata.actual_seq_lengths_cu_q.long()
            starts = ends - lengths
            positions = torch.arange(q_len, device=mixed.device) - torch.repeat_interleave(starts, lengths)
            write_conv_history(self.conv_state, blocks, mixed, starts, ends)
            mixed = mamba_conv1d_packed(mixed, weight, self.conv1d.bias, positions)
            lengths_list = lengths.tolist()
            state = torch.zeros((len(lengths_list), self.num_heads, self.head_dim, self.ssm_state_size),
                                dtype=torch.float32, device=mixed.device)
        else:
            mixed, history = mamba_conv1d_update(mixed, self.conv_state.index_select(0, blocks), weight,
                                                 self.conv1d.bias)
            self.conv_state.index_copy_(0, blocks, history)
            lengths_list = [1] * q_len
            state = self.ssm_state.index_select(0, blocks).float()
        x, B, C = mixed.split((self.intermediate_size, self.n_groups * self.ssm_state_size,
                               self.n_groups * self.ssm_state_size), dim=-1)
        group = self.num_heads // self.n_groups
        B, C = (t.reshape(q_len, self.n_groups, self.ssm_state_size).repeat_interleave(group, dim=1) for t in (B, C))
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.time_step_limit)
        A = -torch.exp(self.A_log.float())
        out = ssd_recurrence(x.reshape(q_len, self.num_heads, self.head_dim), dt, A, B, C, self.D.float(), state,
                             lengths_list)
        self.ssm_state.index_copy_(0, blocks, state.to(self.ssm_state.dtype))
        if MAMBA_NORM_KEY and not hasattr(self, "norm"):
            out = out.reshape(q_len, self.intermediate_size) * F.silu(gate.float())
        else:
            out = self.norm(out.reshape(q_len, self.intermediate_size), gate)
        out = self.out_proj(out.to(hidden_states.dtype))
        if q_len < padded_q_len:
            out = torch.cat([out, out.new_zeros((padded_q_len - q_len, out.size(-1)))], dim=0)
        return out
