"""Gated DeltaNet linear attention (qwen3_next / qwen3_5's linear_attention layers), as upstream's models/qwen3_5
writes it (Qwen3_5MoeGatedDeltaNet): the projections, a causal depthwise conv1d over q/k/v with its conv state, l2
-normed q and k, the gated delta rule (npu_chunk_gated_delta_rule over the packed prefill, npu_recurrent_gated_delta_rule
at decode) with its recurrent state, a gated RMSNorm and the output projection. Both states are one block per
request in the executor's Mamba cache (executor.core.kv_cache.cache_info.MambaCacheEntry, a block table row per
request): a prefill starts from zero state and writes each request's last conv inputs and final state to its block;
a decode reads and writes them there."""

import torch
import torch.nn.functional as F
import torch_npu
from torch import nn

from executor.core.kv_cache.cache_info import MambaCacheEntry
from executor.utils.forward_metadata import ForwardMetaData
from module.linear import ReplicatedLinear

# upstream's cache kind of a fixed-size recurrent state (executor/core/kv_cache)
MAMBA = "Mamba"
# the checkpoint's projections: "qkvz_ba" (qwen3_next: in_proj_qkvz and in_proj_ba, grouped by key head) or
# "qkv_z_b_a" (qwen3_5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, each whole), "in_proj" (lara_mini: one
# in_proj, rows [q|k|v|z|b|a]) or "q_k_v_g_b_a" (olmo_hybrid: q, k and v stored apart, loaded into merged_qkv_proj)
GDN_PROJECTIONS = "qkvz_ba"
NORM_EPS = "rms_norm_eps"       # the config key of the norms' epsilon
GATED_NORM_EPS = None           # the gated norm's epsilon where the architecture fixes it (olmo_hybrid: 1e-5)
CONV_SHARDS = False             # the conv's q, k and v kernels stored apart (q_conv1d, k_conv1d, v_conv1d)
NEG_EIGVAL_KEY = None           # the config key that doubles beta (olmo_hybrid's linear_allow_neg_eigval)
# head widths past npu_chunk_gated_delta_rule's 128 (olmo_hybrid's value heads: 192): the prefill's rule in plain
# torch (npu_recurrent_gated_delta_rule takes up to 512 at decode)
WIDE_HEADS = False
CHUNK_OP_MAX_DIM = 128          # op-plugin's ChunkGatedDeltaRule: 0 < D_k, D_v <= 128


def mamba_cache_entries(layer, states, dtype):
    """The layer's states ((name, shape) each) as the executor's Mamba cache entries: one block per request, bound to
    the layer's attribute of that name when the executor allocates it (a linear-attention layer's cache)."""
    return [MambaCacheEntry(cache_name=name, shape=shape, dtype=dtype, needs_block=True,
                            tensor_setter=lambda tensor, layer=layer, name=name: setattr(layer, name, tensor))
            for name, shape in states]


def ge_safe_softplus(x):
    """softplus without aten::softplus (upstream's: a GE graph lowers this form)."""
    return torch.relu(x) + torch.log1p(torch.exp(-torch.abs(x)))


def load_qkv_rows(param, tensor, shard):
    """q, k or v stored apart: its rows of the parameter that holds them end to end, q first, v last (q and k of one
    width; transformers' save_pretrained writes the conv kernels as three equal thirds, which land alike)."""
    rows = tensor.shape[0]
    offset = {"q": 0, "k": rows, "v": param.shape[0] - rows}[shard]
    param.data[offset:offset + rows].copy_(tensor)


def torch_causal_conv1d_update(hidden_states, conv_state, weight):
    """One token per request through the depthwise conv1d (upstream's torch_causal_conv1d_update): hidden_states
    [B, C], conv_state [B, C, K - 1] the request's last inputs; returns (silu(out) [B, C], the new state)."""
    window = torch.cat([conv_state, hidden_states.unsqueeze(-1).to(conv_state.dtype)], dim=-1)     # [B, C, K]
    # summed in float32 and rounded once, as transformers' conv1d (a bfloat16 product per tap rounds K times)
    out = (window.to(weight.dtype).float() * weight.float()).sum(-1).to(weight.dtype)
    return F.silu(out).to(hidden_states.dtype), window[:, :, 1:]


def causal_conv1d_packed(hidden_states, weight, positions):
    """The depthwise causal conv1d over packed sequences (TND, each from zero history): hidden_states [T, C],
    weight [C, K], positions [T] each token's position in its sequence; silu(out) [T, C]."""
    kernel = weight.shape[-1]
    padded = F.pad(hidden_states, (0, 0, kernel - 1, 0))
    tokens = hidden_states.shape[0]
    # the taps summed in float32 and rounded once to the weight's dtype, as transformers' conv1d: a bfloat16 sum
    # rounds every product and partial sum (qwen3_5_moe's bfloat16 self-check drifted 3x transformers' own move)
    out = torch.zeros_like(hidden_states, dtype=torch.float32)
    for shift in range(kernel):
        # x_{t - shift}, zero where it lies before the token's own sequence
        shifted = padded[kernel - 1 - shift:kernel - 1 - shift + tokens].to(weight.dtype).float()
        out = out + shifted * weight[:, kernel - 1 - shift].float() * (positions >= shift).unsqueeze(-1).float()
    return F.silu(out.to(weight.dtype)).to(hidden_states.dtype)


def write_conv_history(conv_state, blocks, conv_inputs, starts, ends):
    """A prefill's conv state: each request's last K - 1 conv inputs (zeros before its first token) written to its
    block of conv_state [blocks, C, K - 1]; conv_inputs [T, C] packed, request i in starts[i]:ends[i]."""
    offsets = torch.arange(-conv_state.shape[-1], 0, device=conv_inputs.device)
    index = ends.unsqueeze(-1) + offsets                                               # [B, K - 1]
    inside = (index >= starts.unsqueeze(-1)).unsqueeze(-1).to(conv_inputs.dtype)
    history = (conv_inputs[index.clamp_min(0)] * inside).transpose(1, 2)
    conv_state.index_copy_(0, blocks, history.to(conv_state.dtype))


def torch_gated_delta_rule(query, key, value, beta, g, scale, state, lengths):
    """The gated delta rule token by token in float32 (fp32 runs: the NPU ops return bfloat16), TND, each sequence
    from its row of `state` [B, N_v, D_v, D_k] (updated in place): S = e^g S + beta (v - e^g S k) k^T, o = S q scale,
    value head h reading key head h // (N_v / N_k). Returns o [T, N_v, D_v]."""
    group = value.shape[1] // key.shape[1]
    query, key = (x.float().repeat_interleave(group, dim=1) for x in (query, key))
    value, beta, g = value.float(), beta.float(), g.float()
    out = torch.empty(value.shape, dtype=torch.float32, device=value.device)
    start = 0
    for row, length in enumerate(lengths):
        current = state[row].float()
        for t in range(start, start + length):
            current = current * g[t].exp()[:, None, None]
            predicted = (current @ key[t].unsqueeze(-1)).squeeze(-1)
            current = current + (beta[t].unsqueeze(-1) * (value[t] - predicted)).unsqueeze(-1) * key[t].unsqueeze(1)
            out[t] = (current @ (query[t] * scale).unsqueeze(-1)).squeeze(-1)
        state[row] = current.to(state.dtype)
        start += length
    return out


class ModelRMSNormGated(nn.Module):
    """RMSNorm of each value head's output, times silu(z) (upstream's Qwen3_5MoeRMSNormGated)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states, gate):
        input_dtype = hidden_states.dtype
        hidden_states = torch_npu.npu_rms_norm(hidden_states, self.weight, self.variance_epsilon)[0]
        return (hidden_states * F.silu(gate.to(torch.float32))).to(input_dtype)


class ModelGatedDeltaNet(nn.Module):
    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__()
        if infer_config.parallel_config.attn_tp_size > 1:
            raise ValueError("the generated file runs the linear-attention layers whole on each rank: set "
                             "attn_tp_size to 1 (upstream's models/qwen3_5 splits them by head)")
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_v_heads = config.linear_num_value_heads
        self.num_k_heads = config.linear_num_key_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.conv_dim = self.key_dim * 2 + self.value_dim
        self.scale = self.head_k_dim ** -0.5
        quant_config = getattr(config, "quant_config", None)

        def linear(width, name):
            return ReplicatedLinear(self.hidden_size, width, bias=False, quant_config=quant_config,
                                    prefix=f"{prefix}.{name}")

        if GDN_PROJECTIONS == "qkvz_ba":
            self.in_proj_qkvz = linear(self.key_dim * 2 + self.value_dim * 2, "in_proj_qkvz")
            self.in_proj_ba = linear(self.num_v_heads * 2, "in_proj_ba")
        elif GDN_PROJECTIONS == "in_proj":
            self.in_proj = linear(self.conv_dim + self.value_dim + self.num_v_heads * 2, "in_proj")
        else:
            if GDN_PROJECTIONS == "q_k_v_g_b_a":
                self.merged_qkv_proj = linear(self.conv_dim, "merged_qkv_proj")
                self.merged_qkv_proj.weight.weight_loader = load_qkv_rows
            else:
                self.in_proj_qkv = linear(self.conv_dim, "in_proj_qkv")
            self.in_proj_z = linear(self.value_dim, "in_proj_z")
            self.in_proj_b = linear(self.num_v_heads, "in_proj_b")
            self.in_proj_a = linear(self.num_v_heads, "in_proj_a")
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size=self.conv_kernel_size, bias=False,
                                groups=self.conv_dim, padding=self.conv_kernel_size - 1)
        if CONV_SHARDS:
            self.conv1d.weight.weight_loader = load_qkv_rows
        if NEG_EIGVAL_KEY:
            # beta in [0, 2]: the state's eigenvalues may turn negative
            self.beta_scale = 2.0 if getattr(config, NEG_EIGVAL_KEY) else 1.0
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = ModelRMSNormGated(self.head_v_dim, eps=GATED_NORM_EPS if GATED_NORM_EPS else getattr(config, NORM_EPS))
        self.out_proj = ReplicatedLinear(self.value_dim, self.hidden_size, bias=False, quant_config=quant_config,
                                         prefix=f"{prefix}.out_proj")
        self.conv_state = torch.Tensor([])
        self.recurrent_state = torch.Tensor([])
        self.cache_entries = mamba_cache_entries(self, (("conv_state", [self.conv_dim, self.conv_kernel_size - 1]),
                                                        ("recurrent_state", [self.num_v_heads, self.head_v_dim,
                                                                             self.head_k_dim])),
                                                 torch.get_default_dtype())

    def _project(self, hidden_states):
        """(q/k/v as the conv reads them [T, 2 key_dim + value_dim], z [T, N_v, D_v], b [T, N_v], a [T, N_v])."""
        tokens = hidden_states.shape[0]
        if GDN_PROJECTIONS == "qkvz_ba":
            # grouped by key head: per key head [q, k, its value heads' v, their z] and [their b, their a]
            group = self.num_v_heads // self.num_k_heads
            qkvz = self.in_proj_qkvz(hidden_states).view(tokens, self.num_k_heads, -1)
            ba = self.in_proj_ba(hidden_states).view(tokens, self.num_k_heads, -1)
            q, k, v, z = qkvz.split((self.head_k_dim, self.head_k_dim, group * self.head_v_dim,
                                     group * self.head_v_dim), dim=-1)
            b, a = ba.split((group, group), dim=-1)
            mixed = torch.cat([x.reshape(tokens, -1) for x in (q, k, v)], dim=-1)
            return mixed, z.reshape(tokens, self.num_v_heads, self.head_v_dim), b.reshape(tokens, -1), \
                a.reshape(tokens, -1)
        if GDN_PROJECTIONS == "in_proj":
            mixed, z, b, a = self.in_proj(hidden_states).split((self.conv_dim, self.value_dim, self.num_v_heads,
                                                                self.num_v_heads), dim=-1)
            return mixed, z.reshape(tokens, self.num_v_heads, self.head_v_dim), b, a
        if GDN_PROJECTIONS == "q_k_v_g_b_a":
            return (self.merged_qkv_proj(hidden_states), self.in_proj_z(hidden_states).view(tokens, self.num_v_heads, -1),
                    self.in_proj_b(hidden_states), self.in_proj_a(hidden_states))
        return (self.in_proj_qkv(hidden_states), self.in_proj_z(hidden_states).view(tokens, self.num_v_heads, -1),
                self.in_proj_b(hidden_states), self.in_proj_a(hidden_states))

    def forward(self, hidden_states, forward_metadata: ForwardMetaData):
        is_prefill = forward_metadata.is_prefill
        padded_q_len = hidden_states.size(0)
        q_len = padded_q_len
        if is_prefill and 0 < forward_metadata.prompt_tokens < padded_q_len:
            hidden_states = hidden_states[:forward_metadata.prompt_tokens]
            q_len = forward_metadata.prompt_tokens
        if not self.conv_state.numel() or not self.recurrent_state.numel():
            raise RuntimeError("linear-attention state not allocated: the executor binds it through get_cache_info()")
        mixed, z, b, a = self._project(hidden_states)
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
        query, key, value = mixed.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        query = F.normalize(query.reshape(q_len, self.num_k_heads, self.head_k_dim).float(), p=2, dim=-1, eps=1e-6)
        key = F.normalize(key.reshape(q_len, self.num_k_heads, self.head_k_dim).float(), p=2, dim=-1, eps=1e-6)
        value = value.reshape(q_len, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()
        if NEG_EIGVAL_KEY:
            beta = beta * self.beta_scale
        g = -self.A_log.float().exp() * ge_safe_softplus(a.float() + self.dt_bias.float())
        if hidden_states.dtype == torch.float32 or (WIDE_HEADS and is_prefill and max(
                self.head_k_dim, self.head_v_dim) > CHUNK_OP_MAX_DIM):
            # the NPU ops return bfloat16: a float32 run keeps the rule in float32, in plain torch
            lengths_list = forward_metadata.actual_seq_lengths_q.tolist() if is_prefill else [1] * q_len
            state = (torch.zeros((len(lengths_list), self.num_v_heads, self.head_v_dim, self.head_k_dim),
                                 dtype=self.recurrent_state.dtype, device=value.device)
                     if is_prefill else self.recurrent_state.index_select(0, blocks))
            out = torch_gated_delta_rule(query, key, value, beta, g, self.scale, state, lengths_list)
            self.recurrent_state.index_copy_(0, blocks, state)
        elif is_prefill:
            initial_state = torch.zeros((blocks.shape[0], self.num_v_heads, self.head_v_dim, self.head_k_dim),
                                        dtype=self.recurrent_state.dtype, device=value.device)
            out, final_state = torch_npu.npu_chunk_gated_delta_rule(
                query.to(value.dtype), key.to(value.dtype), value, beta=beta.to(value.dtype),
                initial_state=initial_state, actual_seq_lengths=lengths.to(torch.int32), scale=self.scale,
                g=g.to(torch.float32))
            self.recurrent_state.index_copy_(0, blocks, final_state.to(self.recurrent_state.dtype))
        else:
            out = torch_npu.npu_recurrent_gated_delta_rule(
                query.to(value.dtype), key.to(value.dtype), value, self.recurrent_state, beta=beta.to(value.dtype),
                scale=self.scale, actual_seq_lengths=torch.ones_like(blocks, dtype=torch.int32),
                ssm_state_indices=blocks.to(torch.int32), g=g.to(torch.float32))
        out = self.norm(out.to(hidden_states.dtype).reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        out = self.out_proj(out.view(q_len, self.value_dim))
        if q_len < padded_q_len:
            out = torch.cat([out, out.new_zeros((padded_q_len - q_len, out.size(-1)))], dim=0)
        return out
