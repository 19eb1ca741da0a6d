"""Attention with soft-capped logits over the paged cache, in plain torch (no fused kernel soft-caps)."""

import torch

from .attention_fused import ModelAttention

WINDOWS = False         # the architecture attends in a sliding window where its config says so (see attention_fused)


class ModelSoftcapAttention(ModelAttention):
    """Scores soft-capped as the architecture does (cap * tanh(scores / cap), config.attn_logit_softcapping) in
    plain torch over the paged cache: npu_fused_infer_attention_score has no soft-cap. The projections, the
    rotary and the paged KV write are the fused kernels' as everywhere."""

    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__(config, infer_config, comm_manager, layer_idx, prefix)
        self.softcap = config.attn_logit_softcapping

    def _attention(self, query, key, value, forward_metadata):
        if forward_metadata.is_prefill:
            return self._prefill_attention(query, key, value, forward_metadata)
        return self._decode_attention(query, forward_metadata.block_table[self.attn_type], forward_metadata)

    def _scores(self, query, keys):
        """Soft-capped scaled scores of query [heads, q, dim] against keys [kv_heads, k, dim]."""
        keys = keys.repeat_interleave(self.num_heads_per_rank // self.num_key_value_heads_per_rank, dim=0)
        scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * self.scaling
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        return scores

    def _prefill_attention(self, query, key, value, forward_metadata):
        """One sequence of the packed prefill at a time (its own keys: causal, and the window where the layer
        has one)."""
        outs, start = [], 0
        for end in forward_metadata.actual_seq_lengths_cu_q.tolist():
            end = int(end)
            q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
            scores = self._scores(q, k)
            i = torch.arange(end - start, device=q.device).view(-1, 1)
            j = torch.arange(end - start, device=q.device).view(1, -1)
            allowed = j <= i
            if WINDOWS and self.sliding_window:
                allowed = allowed & (j > i - self.sliding_window)
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
            v = v.repeat_interleave(self.num_heads_per_rank // self.num_key_value_heads_per_rank, dim=0)
            outs.append(torch.matmul(probs, v.float()).transpose(0, 1).to(query.dtype))
            start = end
        return torch.cat(outs, dim=0)

    def _decode_attention(self, query, block_table, forward_metadata):
        """Each row reads only its own blocks (_own_blocks): the window's (_window_blocks) or, for full
        attention, those its length fills; a fixed width in a compiled decode (one shape: the table's), in
        eager no wider than the longest row. Positions past a row's length and before its window are masked
        in the scores; nothing read back to the host in a compiled decode."""
        kv_lens = forward_metadata.actual_seq_lengths_kv.view(-1, 1).long()
        if WINDOWS and self.sliding_window:
            block_table, start = self._window_blocks(block_table, kv_lens)
            kv_lens = kv_lens - start
        elif not torch.compiler.is_compiling():      # eager reads lengths back (as its prefill does)
            block_table = block_table[:, :-(-int(kv_lens.max()) // self.block_size)]
        block_table = self._own_blocks(block_table, kv_lens)
        rows, width = block_table.shape
        columns = torch.arange(width * self.block_size, device=block_table.device).view(1, -1)
        slots = block_table.long().repeat_interleave(self.block_size, dim=1) * self.block_size + columns % self.block_size
        cache_k = self.k_cache.view(-1, self.num_key_value_heads_per_rank, self.head_dim)
        cache_v = self.v_cache.view(-1, self.num_key_value_heads_per_rank, self.head_dim)
        keys, values = cache_k[slots].permute(0, 2, 1, 3), cache_v[slots].permute(0, 2, 1, 3)   # [rows, kv_heads, L, dim]
        groups = self.num_heads_per_rank // self.num_key_value_heads_per_rank
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        q = query.view(rows, self.num_heads_per_rank, 1, self.head_dim).float()
        scores = torch.matmul(q, keys.float().transpose(-1, -2)) * self.scaling
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        allowed = columns < kv_lens
        if WINDOWS and self.sliding_window:
            allowed = allowed & (columns >= kv_lens - self.sliding_window)
        probs = scores.masked_fill(~allowed.view(rows, 1, 1, -1), float("-inf")).softmax(dim=-1)
        # the values unmasked: every block read is the row's own (its unwritten tail weighted 0)
        return torch.matmul(probs, values.float()).view(rows, self.num_heads_per_rank, self.head_dim).to(query.dtype)

    def _own_blocks(self, block_table, kv_lens):
        """block_table [rows, n] with each row's columns past its last filled block pointed at that block:
        the table's padding (the null block, which holds anything) is never read. kv_lens [rows, 1] counted
        from the table's first column."""
        last = ((kv_lens + self.block_size - 1) // self.block_size - 1).clamp_min(0)
        columns = torch.arange(block_table.shape[1], device=block_table.device).view(1, -1)
        return block_table.gather(1, torch.minimum(columns, last))
