"""MiniMax's lightning attention (transformers' MiniMaxLightningAttention) on config.layer_types' linear_attention
layers: act(qkv_proj(x)) split into each head's q, k and v; a linear attention with a per-head exponential decay
(slope 2^(-8 (h + 1) / H), scaled by the layer's depth: 1 - layer / (layers - 1)) over the recurrent state
S_t = e^-slope S_(t-1) + k_t^T v_t, o_t = q_t S_t (no softmax, no scale), in float32 plain torch (no NPU op computes
it; upstream's models have none); an RMSNorm over all heads' width; sigmoid(output_gate(x)) times it; out_proj. The
state, [H, D, D] per request, is one block of the executor's Mamba cache, as the Gated DeltaNet's: a prefill starts
from zero state (its causal form block by block) and writes each request's final state to its block; a decode reads
and updates it there."""

import torch
import torch_npu
from torch import nn
from transformers.activations import ACT2FN

from executor.utils.forward_metadata import ForwardMetaData
from module.linear import ReplicatedLinear

from .linear_attention_gdn import MAMBA, mamba_cache_entries

LIGHTNING_NORM_EPS = 1e-6   # the norm's epsilon: the architecture's own (MiniMaxRMSNorm's default), no config key
LIGHTNING_BLOCK = 256       # tokens per block of the prefill's causal form (its [H, n, n] decay matrix)


def lightning_slopes(heads, layer_idx, num_layers):
    """Each head's decay per token (minimax's rule): 2^(-8 (h + 1) / H) times 1 - layer / (layers - 1), float32."""
    base = 1 / (2 ** (8 / heads))
    factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return (torch.tensor(base, dtype=torch.float32) ** (torch.arange(heads) + 1)) * factor


def lightning_prefill(query, key, value, slopes, lengths, block=LIGHTNING_BLOCK):
    """The decayed linear attention over packed sequences (TND, float32), each from zero state, block by block:
    within a block q k^T weighted by e^(-slope (i - j)) for j <= i, times v; from the earlier blocks q e^(-slope (i + 1))
    times the state at the block's start. Returns (out [T, H, D], each sequence's final state [B, H, D, D])."""
    heads, dim = query.shape[1], query.shape[2]
    decay = slopes[:, None, None]
    outs, states, start = [], [], 0
    for length in lengths:
        state = torch.zeros(heads, dim, dim, dtype=torch.float32, device=query.device)
        for first in range(start, start + length, block):
            last = min(first + block, start + length)
            q, k, v = (x[first:last].transpose(0, 1) for x in (query, key, value))        # [H, n, D]
            index = torch.arange(last - first, device=query.device, dtype=torch.float32)
            gap = index[:, None] - index[None, :]                                         # i - j
            weights = torch.where(gap >= 0, torch.exp(-decay * gap.clamp_min(0)), torch.zeros((), device=q.device))
            out = ((q @ k.transpose(-1, -2)) * weights) @ v + (q * torch.exp(-decay * (index[:, None] + 1))) @ state
            outs.append(out.transpose(0, 1))
            size = last - first
            state = state * torch.exp(-decay * size) + \
                (k * torch.exp(-decay * (size - 1 - index[:, None]))).transpose(-1, -2) @ v
        states.append(state)
        start += length
    return torch.cat(outs), torch.stack(states)


class ModelLightningNorm(nn.Module):
    """RMSNorm over all heads' width (each rank holds every head: no all-reduce), the architecture's epsilon."""

    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, hidden_states):
        return torch_npu.npu_rms_norm(hidden_states, self.weight, LIGHTNING_NORM_EPS)[0]


class ModelLightningAttention(nn.Module):
    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__()
        if infer_config.parallel_config.attn_tp_size > 1:
            raise ValueError("the generated file runs the lightning-attention layers whole on each rank: set "
                             "attn_tp_size to 1")
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        width = self.num_heads * self.head_dim
        quant_config = getattr(config, "quant_config", None)
        self.qkv_proj = ReplicatedLinear(config.hidden_size, 3 * width, bias=False, quant_config=quant_config,
                                         prefix=f"{prefix}.qkv_proj")
        self.output_gate = ReplicatedLinear(config.hidden_size, width, bias=False, quant_config=quant_config,
                                            prefix=f"{prefix}.output_gate")
        self.out_proj = ReplicatedLinear(width, config.hidden_size, bias=False, quant_config=quant_config,
                                         prefix=f"{prefix}.out_proj")
        self.norm = ModelLightningNorm(width)
        self.act_fn = ACT2FN[config.hidden_act]
        # computed, not loaded (the checkpoint's slope_rate buffers are skipped): float32 whatever the run dtype
        self.slopes = lightning_slopes(self.num_heads, layer_idx, config.num_hidden_layers).tolist()
        self.recurrent_state = torch.Tensor([])
        self.cache_entries = mamba_cache_entries(self, (("recurrent_state", [self.num_heads, self.head_dim,
                                                                             self.head_dim]),), torch.float32)

    def forward(self, hidden_states, forward_metadata: ForwardMetaData):
        is_prefill = forward_metadata.is_prefill
        padded_q_len = hidden_states.size(0)
        q_len = padded_q_len
        if is_prefill and 0 < forward_metadata.prompt_tokens < padded_q_len:
            hidden_states = hidden_states[:forward_metadata.prompt_tokens]
            q_len = forward_metadata.prompt_tokens
        if not self.recurrent_state.numel():
            raise RuntimeError("lightning-attention state not allocated: the executor binds it through get_cache_info()")
        qkv = self.act_fn(self.qkv_proj(hidden_states)).view(q_len, self.num_heads, 3 * self.head_dim).float()
        query, key, value = qkv.split(self.head_dim, dim=-1)
        slopes = torch.tensor(self.slopes, dtype=torch.float32, device=qkv.device)
        # each request's state block (one per request: next_n 0)
        blocks = forward_metadata.block_table[MAMBA][:, 0].long()
        if is_prefill:
            out, states = lightning_prefill(query, key, value, slopes, forward_metadata.actual_seq_lengths_q.tolist())
            self.recurrent_state.index_copy_(0, blocks, states)
        else:
            # one token per request: S = e^-slope S + k^T v, o = q S
            state = self.recurrent_state.index_select(0, blocks) * torch.exp(-slopes)[:, None, None] + \
                key.unsqueeze(-1) * value.unsqueeze(-2)
            self.recurrent_state.index_copy_(0, blocks, state)
            out = (query.unsqueeze(-2) @ state).squeeze(-2)
        out = out.reshape(q_len, -1).to(hidden_states.dtype)
        out = self.norm(out)
        out = self.out_proj(torch.sigmoid(self.output_gate(hidden_states)) * out)
        if q_len < padded_q_len:
            out = torch.cat([out, out.new_zeros((padded_q_len - q_len, out.size(-1)))], dim=0)
        return out
