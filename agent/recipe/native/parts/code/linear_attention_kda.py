"""Kimi Delta Attention (kimi_linear's KimiLinearDeltaAttention, bailing_hybrid's BailingHybridDeltaAttention: a
linear_attention layer in the attention's place, stored under self_attn): q, k and v projections, a causal depthwise
conv1d over them with its conv state (the Gated DeltaNet's, linear_attention_gdn.py), l2-normed q and k, the delta rule
with a decay per key channel (S = diag(e^g) S + beta k (v - (diag(e^g) S)^T k)^T, o = S^T q scale) from its
recurrent state, an RMSNorm of each head times sigmoid of the output gate, o_proj. No NPU op computes a per-key-channel
decay (npu_chunk_gated_delta_rule takes one per head; npu_recurrent_gated_delta_rule's gk is written two ways on its
page): the rule runs in float32 plain torch, token by token. Both states are one block per request in the executor's
Mamba cache, as the Gated DeltaNet's."""

import torch
import torch_npu
from torch import nn

from executor.core.kv_cache.cache_info import MambaCacheEntry
from executor.utils.forward_metadata import ForwardMetaData
from module.linear import ReplicatedLinear

from .linear_attention_gdn import MAMBA, causal_conv1d_packed, ge_safe_softplus, load_qkv_rows
from .linear_attention_gdn import torch_causal_conv1d_update, write_conv_history

# the forget gate's projection: "low_rank" (kimi_linear: f_b_proj(f_a_proj(x)), A_log [1, 1, H, 1]) or "full"
# (bailing_hybrid: f_proj(x), A_log [H], the gate returned in the run dtype)
KDA_FORGET_GATE = "low_rank"
# the config keys of a bounded forget gate (bailing_hybrid's kda_safe_gate: g = lower_bound sigmoid(e^A_log f)), None
KDA_SAFE_GATE_KEY = None
KDA_LOWER_BOUND_KEY = None
# the output gate's projection: "low_rank" (kimi_linear: g_b_proj(g_a_proj(x))) or "full" (bailing_hybrid: g_proj)
KDA_OUTPUT_GATE = "low_rank"
CONV_SHARDS = False             # the conv's q, k and v kernels stored apart (q_conv1d, k_conv1d, v_conv1d)
L2_EPS = 1e-6                   # q and k over sqrt(sum of squares + eps) (flash-linear-attention's l2norm)


def l2norm(x, eps=L2_EPS):
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def torch_kda_rule(query, key, value, beta, g, scale, state, lengths):
    """The delta rule with a per-key-channel decay, token by token in float32, TND: query / key [T, H, D_k], value
    [T, H, D_v], beta [T, H], g [T, H, D_k]; each sequence of `lengths` from its row of `state` [B, H, D_k, D_v]
    (transformers' layout; updated in place). Returns o [T, H, D_v] float32."""
    query, key, value, beta, g = (x.float() for x in (query, key, value, beta, g))
    out = torch.empty(value.shape, dtype=torch.float32, device=value.device)
    start = 0
    for row, length in enumerate(lengths):
        current = state[row].float()
        for t in range(start, start + length):
            current = current * g[t].exp().unsqueeze(-1)                        # each key channel's own decay
            predicted = (current * key[t].unsqueeze(-1)).sum(dim=-2)            # [H, D_v]
            delta = beta[t].unsqueeze(-1) * (value[t] - predicted)
            current = current + key[t].unsqueeze(-1) * delta.unsqueeze(-2)
            out[t] = (current * (query[t] * scale).unsqueeze(-1)).sum(dim=-2)
        state[row] = current.to(state.dtype)
        start += length
    return out


class ModelKdaForgetGate(nn.Module):
    """g [T, H, D] float32: -e^A_log softplus(f + dt_bias) per key channel (or, bounded, lower_bound
    sigmoid(e^A_log (f + dt_bias)))."""

    def __init__(self, config, hidden_size, num_heads, head_dim, quant_config, prefix=""):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        width = num_heads * head_dim
        if KDA_FORGET_GATE == "low_rank":
            self.f_a_proj = ReplicatedLinear(hidden_size, head_dim, bias=False, quant_config=quant_config,
                                             prefix=f"{prefix}.f_a_proj")
            self.f_b_proj = ReplicatedLinear(head_dim, width, bias=False, quant_config=quant_config,
                                             prefix=f"{prefix}.f_b_proj")
            self.A_log = nn.Parameter(torch.zeros(1, 1, num_heads, 1, dtype=torch.float32))
        else:
            self.f_proj = ReplicatedLinear(hidden_size, width, bias=False, quant_config=quant_config,
                                           prefix=f"{prefix}.f_proj")
            self.A_log = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(width, dtype=torch.float32))
        if KDA_SAFE_GATE_KEY:
            self.safe_gate = getattr(config, KDA_SAFE_GATE_KEY)
            self.lower_bound = getattr(config, KDA_LOWER_BOUND_KEY)

    def forward(self, hidden_states):
        tokens = hidden_states.shape[0]
        if KDA_FORGET_GATE == "low_rank":
            gate_input = self.f_b_proj(self.f_a_proj(hidden_states))
        else:
            gate_input = self.f_proj(hidden_states)
        gate_input = (gate_input.float() + self.dt_bias.float()).view(tokens, self.num_heads, self.head_dim)
        decay_rate = self.A_log.float().exp().view(self.num_heads, 1)
        if KDA_SAFE_GATE_KEY and self.safe_gate:
            gate = self.lower_bound * torch.sigmoid(decay_rate * gate_input)
        else:
            gate = -decay_rate * ge_safe_softplus(gate_input)
        if KDA_FORGET_GATE == "full":
            gate = gate.to(hidden_states.dtype).float()     # bailing_hybrid's gate is returned in the run dtype
        return gate


class ModelKdaGatedNorm(nn.Module):
    """RMSNorm of each head's output in float32 times sigmoid(gate) (transformers' RMSNormGated, activation sigmoid)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states, gate):
        normed = torch_npu.npu_rms_norm(hidden_states.float(), self.weight.float(), self.variance_epsilon)[0]
        return normed * torch.sigmoid(gate.float())


class ModelKimiDeltaAttention(nn.Module):
    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__()
        if infer_config.parallel_config.attn_tp_size > 1:
            raise ValueError("the generated file runs the linear-attention layers whole on each rank: set "
                             "attn_tp_size to 1")
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.linear_num_heads
        self.head_dim = config.linear_head_dim
        self.qkv_dim = self.num_heads * self.head_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.conv_dim = self.qkv_dim * 3
        self.scale = self.head_dim ** -0.5
        quant_config = getattr(config, "quant_config", None)

        def linear(width, name, width_in=None):
            return ReplicatedLinear(width_in or self.hidden_size, width, bias=False, quant_config=quant_config,
                                    prefix=f"{prefix}.{name}")

        self.q_proj = linear(self.qkv_dim, "q_proj")
        self.k_proj = linear(self.qkv_dim, "k_proj")
        self.v_proj = linear(self.qkv_dim, "v_proj")
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size=self.conv_kernel_size, bias=False,
                                groups=self.conv_dim, padding=self.conv_kernel_size - 1)
        if CONV_SHARDS:
            self.conv1d.weight.weight_loader = load_qkv_rows
        self.forget_gate = ModelKdaForgetGate(config, self.hidden_size, self.num_heads, self.head_dim, quant_config,
                                              prefix=f"{prefix}.forget_gate")
        self.b_proj = linear(self.num_heads, "b_proj")
        if KDA_OUTPUT_GATE == "low_rank":
            self.g_a_proj = linear(self.head_dim, "g_a_proj")
            self.g_b_proj = linear(self.qkv_dim, "g_b_proj", width_in=self.head_dim)
        else:
            self.g_proj = linear(self.qkv_dim, "g_proj")
        self.o_norm = ModelKdaGatedNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = linear(self.hidden_size, "o_proj", width_in=self.qkv_dim)
        self.conv_state = torch.Tensor([])
        self.recurrent_state = torch.Tensor([])
        # the recurrent state in float32, as transformers keeps it (its cache's update_recurrent_state)
        self.cache_entries = [
            MambaCacheEntry(cache_name=name, shape=shape, dtype=dtype, needs_block=True,
                            tensor_setter=lambda tensor, layer=self, name=name: setattr(layer, name, tensor))
            for name, shape, dtype in (
                ("conv_state", [self.conv_dim, self.conv_kernel_size - 1], torch.get_default_dtype()),
                ("recurrent_state", [self.num_heads, self.head_dim, self.head_dim], torch.float32))]

    def forward(self, hidden_states, forward_metadata: ForwardMetaData):
        is_prefill = forward_metadata.is_prefill
        padded_q_len = hidden_states.size(0)
        q_len = padded_q_len
        if is_prefill and 0 < forward_metadata.prompt_tokens < padded_q_len:
            hidden_states = hidden_states[:forward_metadata.prompt_tokens]
            q_len = forward_metadata.prompt_tokens
        if not self.conv_state.numel() or not self.recurrent_state.numel():
            raise RuntimeError("linear-attention state not allocated: the executor binds it through get_cache_info()")
        mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], dim=-1)
        # each request's state block (one per request: next_n 0)
        blocks = forward_metadata.block_table[MAMBA][:, 0].long()
        weight = self.conv1d.weight.squeeze(1)
        if is_prefill:
            lengths = forward_metadata.actual_seq_lengths_q.long()
            ends = forward_metadata.actual_seq_lengths_cu_q.long()
            starts = ends - lengths
            positions = torch.arange(q_len, device=mixed.device) - torch.repeat_interleave(starts, lengths)
            write_conv_history(self.conv_state, blocks, mixed, starts, ends)
            mixed = causal_conv1d_packed(mixed, weight, positions)
        else:
            mixed, history = torch_causal_conv1d_update(mixed, self.conv_state.index_select(0, blocks), weight)
            self.conv_state.index_copy_(0, blocks, history)
        shape = (q_len, self.num_heads, self.head_dim)
        query, key, value = (x.reshape(shape) for x in mixed.split((self.qkv_dim,) * 3, dim=-1))
        query, key = l2norm(query.float()), l2norm(key.float())
        g = self.forget_gate(hidden_states)
        beta = torch.sigmoid(self.b_proj(hidden_states))
        lengths_list = forward_metadata.actual_seq_lengths_q.tolist() if is_prefill else [1] * q_len
        state = (torch.zeros((len(lengths_list), self.num_heads, self.head_dim, self.head_dim),
                             dtype=self.recurrent_state.dtype, device=value.device)
                 if is_prefill else self.recurrent_state.index_select(0, blocks))
        out = torch_kda_rule(query, key, value, beta, g, self.scale, state, lengths_list)
        self.recurrent_state.index_copy_(0, blocks, state)
        if KDA_OUTPUT_GATE == "low_rank":
            gate = self.g_b_proj(self.g_a_proj(hidden_states))
        else:
            gate = self.g_proj(hidden_states)
        # transformers' core output is in the run dtype before its norm
        out = self.o_norm(out.to(hidden_states.dtype), gate.view(shape)).to(hidden_states.dtype)
        out = self.o_proj(out.view(q_len, self.qkv_dim))
        if q_len < padded_q_len:
            out = torch.cat([out, out.new_zeros((padded_q_len - q_len, out.size(-1)))], dim=0)
        return out
