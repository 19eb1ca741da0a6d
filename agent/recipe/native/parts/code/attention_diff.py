"""Differential attention (diffllama) over the paged cache: two npu_fused_infer_attention_score_v2 calls, the
combination in plain torch."""

import math

import torch
import torch_npu
import torchair
from torch import nn

from executor.core.kv_cache.cache_info import CacheEntry

from .attention_fused import ModelAttention


class ModelDiffAttention(ModelAttention):
    """Differential attention (arXiv 2410.05258, transformers' DiffLlamaAttention): query head h's softmax map P_h
    (over key head h // groups) weighs both value halves, [P_h v_a(h), P_h v_b(h)] with a(h) the key head's index
    among the first half of the key heads and b(h) the same index among the second half; head i of the first half
    of the query heads and head i of the second are one pair, A1 - lambda * A2 (2 x head_dim wide each), lambda =
    exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init, lambda_init = 0.8 - 0.6 exp(-0.3 layer),
    then an RMS norm without weight over each pair's 2 x head_dim and a (1 - lambda_init) scale.

    Kernels: npu_fused_infer_attention_score_v2 twice (TND, paged cache through block_table), once on the value
    cache (query heads of the first half get P v_a, the second half's P v_b) and once on a second value cache
    holding each token's key heads' values with the halves swapped (the other one of each); the combination,
    norm and scale in plain torch. The second value cache costs half the layer's KV cache again. A query pair
    spans both halves of the heads, so attention TP (which splits the heads) is refused."""

    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__(config, infer_config, comm_manager, layer_idx, prefix)
        if self.attn_tp_size > 1:
            raise ValueError(f"differential attention with attn_tp_size {self.attn_tp_size}: each pair of query heads "
                             "spans both halves of the heads; set attn_tp_size to 1")
        if self.num_key_value_heads % 2:
            raise ValueError(f"differential attention needs an even num_key_value_heads, not {self.num_key_value_heads}")
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_idx)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.empty(self.head_dim), requires_grad=False))
        self.norm_eps = config.rms_norm_eps
        self.v_swapped_cache = torch.Tensor([])
        self.cache_entries.append(CacheEntry(
            cache_name="v_swapped_cache", attn_type=self.attn_type, dim=self.head_dim,
            num_head=self.num_key_value_heads_per_rank, dtype=torch.get_default_dtype(), block_size=self.block_size,
            needs_block=True, tensor_setter=lambda tensor, layer=self: setattr(layer, "v_swapped_cache", tensor)))

    def _attention(self, query, key, value, forward_metadata):
        """[tokens, heads, head_dim]: each pair's normed difference, the pair's 2 x head_dim in its two heads."""
        half_kv = self.num_key_value_heads_per_rank // 2
        swapped = torch.cat([value[:, half_kv:], value[:, :half_kv]], dim=1)
        slots = forward_metadata.slot_mapping[self.attn_type].view(-1)[:query.size(0)].view(-1, 1)
        torch_npu.npu_scatter_nd_update_(
            self.v_swapped_cache.view(-1, self.num_key_value_heads_per_rank, self.head_dim), slots, swapped)
        own = self._paged(query, self.v_cache, forward_metadata)
        other = self._paged(query, self.v_swapped_cache, forward_metadata)
        half = self.num_heads_per_rank // 2
        first = torch.cat([own[:, :half], other[:, :half]], dim=-1)       # [tokens, half, 2 x head_dim]
        second = torch.cat([other[:, half:], own[:, half:]], dim=-1)
        lambda_1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1, dtype=torch.float32)).to(query.dtype)
        lambda_2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1, dtype=torch.float32)).to(query.dtype)
        out = first - (lambda_1 - lambda_2 + self.lambda_init) * second
        out = (1 - self.lambda_init) * torch.nn.functional.rms_norm(out, (2 * self.head_dim,), eps=self.norm_eps)
        return out.reshape(query.shape)

    def _paged(self, query, v_cache, forward_metadata):
        """npu_fused_infer_attention_score_v2 in TND over the paged k_cache and `v_cache`: causal from the bottom
        right at prefill (sparse_mode 3), one query per sequence at decode."""
        is_prefill = forward_metadata.is_prefill
        if not is_prefill and self.enable_npugraph_ex:
            actual_seq_kvlen = forward_metadata.actual_seq_lengths_list_kv
            actual_seq_qlen = forward_metadata.actual_seq_lengths_cu_list_q
        else:
            actual_seq_kvlen = forward_metadata.actual_seq_lengths_kv
            actual_seq_qlen = forward_metadata.actual_seq_lengths_cu_q
        mask, sparse_mode = (forward_metadata.attention_mask, 3) if is_prefill else (None, 0)
        fa_ops = torchair.ops if self.enable_gegraph and not is_prefill else torch.ops.npu
        k_cache = self.k_cache
        out, _ = fa_ops.npu_fused_infer_attention_score_v2(
            query, k_cache.view(*k_cache.shape[:2], -1), v_cache.view(*v_cache.shape[:2], -1),
            num_query_heads=self.num_heads_per_rank, num_key_value_heads=self.num_key_value_heads_per_rank,
            softmax_scale=self.scaling, input_layout="TND", sparse_mode=sparse_mode, atten_mask=mask,
            actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
            block_table=forward_metadata.block_table[self.attn_type], block_size=self.block_size)
        return out
