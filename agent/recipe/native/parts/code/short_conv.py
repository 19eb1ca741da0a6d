"""The gated short convolution in the attention's place (lfm2's conv layers, transformers' Lfm2ShortConv):
in_proj to B, C and x; B * x through a causal depthwise conv1d of conv_L_cache taps; C times its output; out_proj.
Its conv state (each request's last conv_L_cache - 1 inputs) is one block per request in the executor's Mamba cache
(executor.core.kv_cache.cache_info.MambaCacheEntry, a block table row per request), as the Gated DeltaNet's is: a
prefill starts from zero history and writes each request's last inputs to its block; a decode reads and writes them
there."""

import torch
import torch.nn.functional as F
from torch import nn

from executor.core.kv_cache.cache_info import MambaCacheEntry
from executor.utils.forward_metadata import ForwardMetaData
from module.linear import ReplicatedLinear

from .linear_attention_gdn import write_conv_history

# upstream's cache kind of a fixed-size recurrent state (executor/core/kv_cache)
MAMBA = "Mamba"


def short_conv_packed(hidden_states, weight, positions):
    """The depthwise causal conv1d over packed sequences (TND, each from zero history): hidden_states [T, C],
    weight [C, K], positions [T] each token's position in its sequence; out [T, C] (no activation)."""
    kernel = weight.shape[-1]
    padded = F.pad(hidden_states, (0, 0, kernel - 1, 0))
    tokens = hidden_states.shape[0]
    out = torch.zeros_like(hidden_states, dtype=weight.dtype)
    for shift in range(kernel):
        # x_{t - shift}, zero where it lies before the token's own sequence
        shifted = padded[kernel - 1 - shift:kernel - 1 - shift + tokens].to(weight.dtype)
        out = out + shifted * weight[:, kernel - 1 - shift] * (positions >= shift).unsqueeze(-1).to(weight.dtype)
    return out


class ModelShortConv(nn.Module):
    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__()
        if infer_config.parallel_config.attn_tp_size > 1:
            raise ValueError("the generated file runs the short-convolution layers whole on each rank: set "
                             "attn_tp_size to 1")
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.conv_kernel_size = config.conv_L_cache
        quant_config = getattr(config, "quant_config", None)
        self.in_proj = ReplicatedLinear(self.hidden_size, 3 * self.hidden_size, bias=config.conv_bias,
                                        quant_config=quant_config, prefix=f"{prefix}.in_proj")
        self.conv = nn.Conv1d(self.hidden_size, self.hidden_size, kernel_size=self.conv_kernel_size,
                              bias=config.conv_bias, groups=self.hidden_size, padding=self.conv_kernel_size - 1)
        self.out_proj = ReplicatedLinear(self.hidden_size, self.hidden_size, bias=config.conv_bias,
                                         quant_config=quant_config, prefix=f"{prefix}.out_proj")
        self.conv_state = torch.Tensor([])
        self.cache_entries = [
            MambaCacheEntry(cache_name="conv_state", shape=[self.hidden_size, self.conv_kernel_size - 1],
                            dtype=torch.get_default_dtype(), needs_block=True,
                            tensor_setter=lambda tensor, layer=self: setattr(layer, "conv_state", tensor))]

    def forward(self, hidden_states, forward_metadata: ForwardMetaData):
        is_prefill = forward_metadata.is_prefill
        padded_q_len = hidden_states.size(0)
        q_len = padded_q_len
        if is_prefill and 0 < forward_metadata.prompt_tokens < padded_q_len:
            hidden_states = hidden_states[:forward_metadata.prompt_tokens]
            q_len = forward_metadata.prompt_tokens
        if not self.conv_state.numel():
            raise RuntimeError("short-convolution state not allocated: the executor binds it through get_cache_info()")
        gate_b, gate_c, x = self.in_proj(hidden_states).chunk(3, dim=-1)
        mixed = gate_b * x
        # each request's state block (one per request: next_n 0)
        blocks = forward_metadata.block_table[MAMBA][:, 0].long()
        weight = self.conv.weight.squeeze(1)
        if is_prefill:
            lengths = forward_metadata.actual_seq_lengths_q.long()
            ends = forward_metadata.actual_seq_lengths_cu_q.long()
            starts = ends - lengths
            positions = torch.arange(q_len, device=mixed.device) - torch.repeat_interleave(starts, lengths)
            write_conv_history(self.conv_state, blocks, mixed, starts, ends)
            conv = short_conv_packed(mixed, weight, positions)
        else:
            # one token per request: its window is the state's K - 1 inputs and this one
            window = torch.cat([self.conv_state.index_select(0, blocks),
                                mixed.unsqueeze(-1).to(self.conv_state.dtype)], dim=-1)          # [B, C, K]
            conv = (window.to(weight.dtype) * weight).sum(-1)
            self.conv_state.index_copy_(0, blocks, window[:, :, 1:])
        if self.conv.bias is not None:
            conv = conv + self.conv.bias
        out = self.out_proj(gate_c * conv.to(gate_c.dtype))
        if q_len < padded_q_len:
            out = torch.cat([out, out.new_zeros((padded_q_len - q_len, out.size(-1)))], dim=0)
        return out
