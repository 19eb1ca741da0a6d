"""Attention with ALiBi biases over the paged cache: the decode step in npu_fused_infer_attention_score_v2 with the
bias as its pse_shift (BSH, paged), the prefill in plain torch (the op's TND layout takes no pse_shift)."""

import torch
import torchair

from .attention_fused import ModelAttention
from .position_alibi import ModelAlibiSlopes


class ModelAlibiAttention(ModelAttention):
    """Scores q . k x scale + slope x (key position - query position), per head: ALiBi. torch_npu's
    npu_fused_infer_attention_score_v2 documents pse_shift, added to the scaled scores, as (B, N, Q_S, KV_S) with
    KV_S at least the block table's width x block_size under page attention, and not for the TND / NTD_TND layouts
    (op-plugin docs/context/torch_npu-npu_fused_infer_attention_score_v2.md, "pse_shift" and the TND constraints):
    a decode step (one query per sequence) runs it in BSH, a packed prefill runs in plain torch, one sequence at a
    time."""

    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__(config, infer_config, comm_manager, layer_idx, prefix)
        tp_rank = comm_manager.get_rank("attn_tp_group") if self.attn_tp_size > 1 else 0
        self.alibi = ModelAlibiSlopes(config, tp_rank * self.num_heads_per_rank, self.num_heads_per_rank)

    def _attention(self, query, key, value, forward_metadata):
        if forward_metadata.is_prefill:
            return self._prefill_attention(query, key, value, forward_metadata)
        return self._decode_attention(query, forward_metadata)

    def _prefill_attention(self, query, key, value, forward_metadata):
        """One sequence of the packed prefill at a time, over its own keys: causal, the bias added."""
        groups = self.num_heads_per_rank // self.num_key_value_heads_per_rank
        outs, start = [], 0
        for end in forward_metadata.actual_seq_lengths_cu_q.tolist():
            end = int(end)
            q, k, v = (t[start:end].transpose(0, 1).float() for t in (query, key, value))
            k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
            positions = torch.arange(end - start, device=q.device)
            offsets = positions.view(1, -1) - positions.view(-1, 1)          # key - query
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.scaling + self.alibi(offsets)
            probs = scores.masked_fill(offsets > 0, float("-inf")).softmax(dim=-1)
            outs.append(torch.matmul(probs, v).transpose(0, 1).to(query.dtype))
            start = end
        return torch.cat(outs, dim=0)

    def _decode_attention(self, query, forward_metadata):
        """One query per sequence over its paged keys, the bias of every column of the block table (pse_shift
        [rows, heads, 1, width x block_size]: key position - (kv_len - 1))."""
        block_table = forward_metadata.block_table[self.attn_type]
        rows = query.shape[0]
        kv_lens = forward_metadata.actual_seq_lengths_kv.view(-1, 1, 1).long()
        columns = torch.arange(block_table.shape[1] * self.block_size, device=query.device).view(1, 1, -1)
        pse = self.alibi(columns - (kv_lens - 1)).transpose(0, 1).to(query.dtype)     # [rows, heads, 1, width]
        if self.enable_npugraph_ex:
            actual_seq_kvlen = forward_metadata.actual_seq_lengths_list_kv
        else:
            actual_seq_kvlen = forward_metadata.actual_seq_lengths_kv
        fa_ops = torchair.ops if self.enable_gegraph else torch.ops.npu
        k_cache, v_cache = self.k_cache, self.v_cache
        out, _ = fa_ops.npu_fused_infer_attention_score_v2(
            query.reshape(rows, 1, -1), k_cache.view(*k_cache.shape[:2], -1), v_cache.view(*v_cache.shape[:2], -1),
            pse_shift=pse, num_query_heads=self.num_heads_per_rank,
            num_key_value_heads=self.num_key_value_heads_per_rank, softmax_scale=self.scaling, input_layout="BSH",
            actual_seq_kvlen=actual_seq_kvlen, block_table=block_table, block_size=self.block_size)
        return out.view(rows, self.num_heads_per_rank, self.head_dim)
