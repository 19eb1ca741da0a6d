"""Fused attention: npu_fused_infer_attention_score (v1, v2, torchair's) and npu_fusion_attention.

One reference computes them all, per batch, in float32: softmax(scale * q k^T + pse, masked) v, with
grouped KV heads, the layouts BSH / BSND / BNSD / TND / NTD (and the out-layout variants BNSD_BSND,
TND_NTD, NTD_TND, *_NBSD), paged KV (block_table: (blocks, block_size, H) or
(blocks, KV_N, block_size, D)), actual sequence lengths (cumulative for TND, per batch otherwise and
for paged KV) and the documented sparse modes, anchored as torch_npu anchors them:

* 0 defaultMask: the given mask (True = masked) and the band pre_tokens/next_tokens from the top left;
  no mask, nothing masked;
* 1 allMask: the given mask;
* 2 leftUpCausal: key j <= query i;
* 3 rightDownCausal: j <= i + (S_kv - S_q);
* 4 band from the bottom right: i + (S_kv - S_q) - pre_tokens <= j <= i + (S_kv - S_q) + next_tokens.

For modes 2-4 the mask passed is the compressed 2048x2048 one: required when S_q > 1, its contents
unused. When every query has one token (decode) and there is no rope input, sparse_mode, pre_tokens
and next_tokens have no effect in the BSH / BSND / BNSD layouts, as documented for the incremental
branch ("Q_S为1时该参数无效"): only a mode 0/1 mask applies, read as (B, KV_S) when 2-D; any other
first dimension (the prefill's 2048x2048 mask passed at decode) raises the NPU's
`batchSize[2048] of atten_mask != batchSize[1] of query`. One exception is established here: in TND /
NTD, sparse_mode 4's band applies to a one-token query as at prefill, from the bottom right (the query at
kv_len - 1 attends keys kv_len - 1 - pre_tokens .. kv_len - 1; pre_tokens = W: W + 1 keys; next_tokens
>= 0 changes nothing), and needs the compressed mask as there; other modes at a TND decode keep the
rule above. Source, hicann/ops-transformer: attention/fused_infer_attention_score/op_host/
fused_infer_attention_score_tiling.cpp `IsUsingIFA` (TND goes to the incremental kernel only for
D = 512 or an antiquantized KV), prompt_flash_attention_tiling.cpp (TND with paged KV takes sparseMode
0, 3 or 4; mode 4 sets the band from pre/next tokens, per batch `pre - kv + q`, `next + kv - q`); the
newer arch32 FIA kernel masks a one-row query by the same band (fia_block_vec_nonquant.h, S1_EQUAL1);
vllm-ascend's attention_v1.py passes sparse_mode 4, pre_tokens = the window at decode.
A learnable sink adds one logit per head to the softmax denominator (gpt-oss). Rows with every key
masked give zeros.
"""

from __future__ import annotations

import torch

from npu_standin.kernels import refuse, reference

INT_MAX = 2147483647
_LAYOUTS = {"BSH", "BSND", "BNSD", "TND", "NTD"}


def _split_layout(layout: str) -> tuple[str, str]:
    if "_" in layout:
        src, dst = layout.split("_", 1)
        return src, dst
    return layout, layout


def _seq_list(value) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    return [int(v) for v in value]


def _per_batch(lengths: list[int] | None, batch: int, default: int) -> list[int]:
    if not lengths:
        return [default] * batch
    if len(lengths) == 1:
        return lengths * batch
    return lengths[:batch]


def _cum_to_spans(cum: list[int]) -> list[tuple[int, int]]:
    spans, start = [], 0
    for end in cum:
        spans.append((start, end))
        start = end
    return spans


def _queries(query, layout: str, num_heads: int, actual_q):
    """Per-batch queries (N, S_q, D) and the facts needed to put the output back."""
    if layout in ("TND", "NTD"):
        q = query if layout == "TND" else query.transpose(0, 1)
        cum = _seq_list(actual_q)
        if cum is None:
            raise ValueError("npu_fused_infer_attention_score: input_layout TND needs actual_seq_qlen "
                             "(cumulative lengths)")
        spans = _cum_to_spans(cum)
        return [q[s:e].transpose(0, 1) for s, e in spans], {"tokens": q.shape[0], "spans": spans}
    if layout == "BSH":
        b, s, h = query.shape
        q4 = query.view(b, s, num_heads, h // num_heads).transpose(1, 2)
    elif layout == "BSND":
        q4 = query.transpose(1, 2)
    elif layout == "BNSD":
        q4 = query
    else:
        raise ValueError(f"unknown input_layout {layout!r}")
    b, _, s, _ = q4.shape
    lengths = _per_batch(_seq_list(actual_q), b, s) if s > 1 else [s] * b
    return [q4[i, :, : lengths[i]] for i in range(b)], {"batch": b, "seq": s}


def _kv_heads_first(t, layout: str, kv_heads: int):
    if layout == "BSH":
        b, s, h = t.shape
        return t.view(b, s, kv_heads, h // kv_heads).transpose(1, 2)
    if layout == "BSND":
        return t.transpose(1, 2)
    return t


def _keys(key, value, layout: str, kv_heads: int, actual_kv, block_table, block_size: int, q_lengths):
    """Per-batch keys and values (KV_N, S_kv, D)."""
    batch = len(q_lengths)
    if block_table is not None:
        lengths = _seq_list(actual_kv)
        if lengths is None:
            raise ValueError("npu_fused_infer_attention_score: page attention needs actual_seq_kvlen")
        lengths = _per_batch(lengths, batch, 0)
        out = []
        for b in range(batch):
            n_blocks = -(-lengths[b] // block_size) if lengths[b] else 0
            blocks = block_table[b, :n_blocks].long()
            pair = []
            for cache in (key, value):
                picked = cache[blocks]
                if cache.dim() == 3:            # (blocks, block_size, H)
                    picked = picked.reshape(n_blocks * block_size, kv_heads, -1).transpose(0, 1)
                else:                           # (blocks, KV_N, block_size, D)
                    picked = picked.permute(1, 0, 2, 3).reshape(kv_heads, n_blocks * block_size, -1)
                pair.append(picked[:, : lengths[b]])
            out.append(tuple(pair))
        return out
    if layout in ("TND", "NTD"):
        cum = _seq_list(actual_kv)
        if cum is None:
            raise ValueError("npu_fused_infer_attention_score: input_layout TND needs actual_seq_kvlen "
                             "(cumulative lengths)")
        k = key if layout == "TND" else key.transpose(0, 1)
        v = value if layout == "TND" else value.transpose(0, 1)
        return [(k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)) for s, e in _cum_to_spans(cum)]
    k4 = _kv_heads_first(key, layout, kv_heads)
    v4 = _kv_heads_first(value, layout, kv_heads)
    lengths = _per_batch(_seq_list(actual_kv), k4.shape[0], k4.shape[2])
    return [(k4[b, :, : lengths[b]], v4[b, :, : lengths[b]]) for b in range(batch)]


def _user_mask(mask, b: int, sq: int, skv: int):
    if mask is None:
        return None
    m = mask
    if m.dim() == 2 and sq == 1 and m.shape[0] != 1 and m.shape[0] != sq:
        m = m[b].reshape(1, -1)                 # (B, KV_S) for one query token
    elif m.dim() == 4:
        m = m[b if m.shape[0] > 1 else 0, 0]
    elif m.dim() == 3:
        m = m[b if m.shape[0] > 1 else 0]
    return m[:sq, :skv].to(torch.bool)


def _allowed(sq: int, skv: int, sparse_mode: int, pre: int, nxt: int, user_mask, decode: bool, device,
             packed: bool = False):
    """Which (query, key) pairs take part, or None for all. `packed`: TND / NTD, whose one-token queries
    keep mode 4's band (see the module docs)."""
    if decode and not (packed and sparse_mode == 4):
        if user_mask is not None and sparse_mode in (0, 1):
            return ~user_mask
        return None
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(skv, device=device)[None, :]
    if sparse_mode == 0:
        if user_mask is None:
            return None
        band = (j >= i - pre) & (j <= i + nxt)
        return band & ~user_mask
    if sparse_mode == 1:
        return ~user_mask
    if sparse_mode == 2:
        return j <= i
    offset = skv - sq
    if sparse_mode == 3:
        return j <= i + offset
    if sparse_mode == 4:
        return (j >= i + offset - pre) & (j <= i + offset + nxt)
    refuse("npu_fused_infer_attention_score", f"sparse_mode={sparse_mode}")


def _attend(q, k, v, scale: float, allowed, pse, sink):
    """q (N, S_q, D), k/v (KV_N, S_kv, D): out (N, S_q, Dv), the row max and the row sum of
    exp(score - max) (N, S_q), float32."""
    heads, kv_heads = q.shape[0], k.shape[0]
    if heads % kv_heads:
        raise ValueError(f"num_query_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    groups = heads // kv_heads
    k32 = k.float().repeat_interleave(groups, dim=0)
    v32 = v.float().repeat_interleave(groups, dim=0)
    scores = torch.matmul(q.float(), k32.transpose(-1, -2)) * scale
    if pse is not None:
        scores = scores + pse.float()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sink is not None:
        sinks = sink.float().reshape(heads, 1, 1).expand(heads, scores.shape[1], 1)
        scores = torch.cat([scores, sinks], dim=-1)
    peak = scores.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(scores - peak)
    denom = weights.sum(dim=-1, keepdim=True)
    probs = torch.where(denom > 0, weights / denom.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(weights))
    if sink is not None:
        probs = probs[..., :-1]
    out = torch.matmul(probs, v32)
    return out, peak.squeeze(-1), denom.squeeze(-1)


def _attention(op, query, key, value, *, layout, num_heads, num_kv_heads, scale, atten_mask, pse_shift,
               actual_q, actual_kv, block_table, block_size, sparse_mode, pre_tokens, next_tokens, sink,
               want_lse, rope=False, want_stats=False, incremental=True):
    src, dst = _split_layout(layout)
    if src not in _LAYOUTS:
        refuse(op, f"input_layout={layout!r}")
    kv_heads = num_kv_heads or num_heads
    queries, shape = _queries(query, src, num_heads, actual_q)
    q_lengths = [q.shape[1] for q in queries]
    pairs = _keys(key, value, src, kv_heads, actual_kv, block_table, block_size, q_lengths)
    max_q = max(q_lengths) if q_lengths else 0
    decode = incremental and (max_q <= 1) and not rope
    banded_decode = decode and sparse_mode == 4 and src in ("TND", "NTD")
    if (not decode or banded_decode) and sparse_mode in (2, 3, 4) and atten_mask is None:
        raise ValueError(f"{op}: sparse_mode={sparse_mode} needs atten_mask (the 2048x2048 lower-triangular "
                         "mask), as on the NPU")
    if decode and sparse_mode in (0, 1) and atten_mask is not None and atten_mask.dim() == 2 \
            and atten_mask.shape[0] not in (1, len(queries)):
        # one query token: a 2-D mask is (B, KV_S); the prefill's (2048, 2048) causal one is not (the
        # NPU's check, as upstream's common_issues.md quotes it)
        raise RuntimeError(f"{op}: batchSize[{atten_mask.shape[0]}] of atten_mask != batchSize[{len(queries)}] "
                           "of query (npu stand-in: a 2-D atten_mask at Q_S=1 is (B, KV_S))")
    if pse_shift is not None:
        _check_pse(op, pse_shift, src, num_heads, len(queries), max_q, block_table, block_size)
    outs, stats = [], []
    for b, (q, (k, v)) in enumerate(zip(queries, pairs)):
        sq, skv = q.shape[1], k.shape[1]
        mask = None if sparse_mode in (2, 3, 4) else _user_mask(atten_mask, b, sq, skv)
        allowed = _allowed(sq, skv, sparse_mode, pre_tokens, next_tokens, mask, decode, q.device,
                           packed=src in ("TND", "NTD"))
        pse = None
        if pse_shift is not None:
            pse = pse_shift[b if pse_shift.shape[0] > 1 else 0, :, :sq, :skv]
        out, peak, denom = _attend(q, k, v, scale, allowed, pse, sink)
        outs.append(out)
        stats.append(torch.stack((peak, denom), dim=-1))
    result, packed = _assemble(outs, stats, src, dst, shape, query, num_heads)
    if want_stats:
        return result, packed
    lse = packed[..., :1] + torch.log(packed[..., 1:])
    return result, (lse if want_lse else query.new_zeros((1,), dtype=torch.float32))


def _check_pse(op, pse, layout, heads, batch, max_q, block_table, block_size):
    """pse_shift as torch_npu documents it for the fused infer attention (op-plugin docs/context/
    torch_npu-npu_fused_infer_attention_score_v2.md, pse_shift and the constraints): (B, N, Q_S, KV_S) or
    (1, N, Q_S, KV_S); not with the TND / NTD layouts; under page attention KV_S at least the block table's width
    x block_size."""
    if op == "npu_fusion_attention":
        return
    if layout in ("TND", "NTD"):
        raise ValueError(f"{op}: pse_shift is not supported with input_layout {layout} (npu stand-in: as "
                         "documented for TND / NTD_TND)")
    if pse.dim() != 4 or pse.shape[0] not in (1, batch) or pse.shape[1] != heads or pse.shape[2] < max_q:
        raise ValueError(f"{op}: pse_shift of shape {tuple(pse.shape)}: not (B or 1, N={heads}, Q_S, KV_S)")
    if block_table is not None and pse.shape[3] < block_table.shape[1] * block_size:
        raise ValueError(f"{op}: pse_shift's KV_S {pse.shape[3]} < the block table's {block_table.shape[1]} blocks x "
                         f"block_size {block_size} (page attention)")


def _assemble(outs, stats, src, dst, shape, query, heads):
    """The output in `dst` layout, and the per-row (max, sum) as (T, N, 2) or (B, N, S, 2)."""
    dtype = query.dtype
    dv = outs[0].shape[-1] if outs else 0
    if src in ("TND", "NTD"):
        tokens = shape["tokens"]
        out = query.new_zeros((tokens, heads, dv), dtype=torch.float32)
        packed = query.new_zeros((tokens, heads, 2), dtype=torch.float32)
        packed[..., 1] = 1.0
        for (s, e), o, st in zip(shape["spans"], outs, stats):
            out[s:e] = o.transpose(0, 1)
            packed[s:e] = st.transpose(0, 1)
        result = out if dst == "TND" else out.transpose(0, 1)
    else:
        batch, seq = shape["batch"], shape["seq"]
        out = query.new_zeros((batch, heads, seq, dv), dtype=torch.float32)
        packed = query.new_zeros((batch, heads, seq, 2), dtype=torch.float32)
        packed[..., 1] = 1.0
        for b, (o, st) in enumerate(zip(outs, stats)):
            out[b, :, : o.shape[1]] = o
            packed[b, :, : st.shape[1]] = st
        result = _to_layout(out, dst)
    return result.contiguous().to(dtype), packed


def _to_layout(bnsd: torch.Tensor, dst: str) -> torch.Tensor:
    b, n, s, d = bnsd.shape
    if dst == "BNSD":
        return bnsd
    if dst == "BSND":
        return bnsd.transpose(1, 2)
    if dst == "BSH":
        return bnsd.transpose(1, 2).reshape(b, s, n * d)
    if dst == "NBSD":
        return bnsd.transpose(0, 1)
    raise ValueError(f"unknown output layout {dst!r}")


def _value_d(value, block_table, layout, kv_heads):
    if block_table is not None:
        if value.dim() == 5:                    # FRACTAL_NZ (blocks, KV_N, D // c0, block_size, c0)
            return value.shape[2] * value.shape[4]
        return value.shape[-1] // kv_heads if value.dim() == 3 else value.shape[-1]
    src, _ = _split_layout(layout)
    return value.shape[-1] // kv_heads if src == "BSH" else value.shape[-1]


def _fake(query, value, *, layout, num_heads, num_kv_heads, block_table, want_lse):
    src, dst = _split_layout(layout)
    kv_heads = num_kv_heads or num_heads
    dv = _value_d(value, block_table, layout, kv_heads)
    if src in ("TND", "NTD"):
        tokens = query.shape[0] if src == "TND" else query.shape[1]
        shape = (tokens, num_heads, dv) if dst == "TND" else (num_heads, tokens, dv)
        lse = (tokens, num_heads, 1)
    else:
        if src == "BSH":
            b, s = query.shape[0], query.shape[1]
        elif src == "BSND":
            b, s = query.shape[0], query.shape[1]
        else:
            b, s = query.shape[0], query.shape[2]
        shape = {"BSH": (b, s, num_heads * dv), "BSND": (b, s, num_heads, dv), "BNSD": (b, num_heads, s, dv),
                 "NBSD": (num_heads, b, s, dv)}[dst]
        lse = (b, num_heads, s, 1)
    return query.new_empty(shape), query.new_empty(lse if want_lse else (1,), dtype=torch.float32)


def _refuse_quant(op, **tensors):
    given = [name for name, value in tensors.items() if value is not None]
    if given:
        refuse(op, f"{', '.join(given)} (a quantized path)")


def nd_paged(cache):
    """A paged cache given in FRACTAL_NZ, (blocks, KV_N, D // c0, block_size, c0), as the documented ND
    (blocks, KV_N, block_size, D); any other tensor as it is."""
    if cache is None or cache.dim() != 5:
        return cache
    blocks, heads, d1, block_size, c0 = cache.shape
    return cache.permute(0, 1, 3, 2, 4).reshape(blocks, heads, block_size, d1 * c0)


def _mla_inputs(op, query, key, value, query_rope, key_rope, layout, block_table):
    """MLA (query_rope and key_rope given): the scores are q.k + q_rope.k_rope, i.e. the attention of
    the concatenated (q, q_rope) and (k, k_rope) over value as it is. Paged NZ caches read as ND."""
    if block_table is not None:
        key, value, key_rope = nd_paged(key), nd_paged(value), nd_paged(key_rope)
    if query_rope is None and key_rope is None:
        return query, key, value, False
    if query_rope is None or key_rope is None:
        raise ValueError(f"{op}: query_rope and key_rope are given together or not at all (MLA)")
    src, _ = _split_layout(layout)
    if src == "BSH" or (block_table is not None and key.dim() == 3):
        refuse(op, f"query_rope/key_rope with input_layout={layout!r} or a (blocks, block_size, H) cache")
    query = torch.cat((query, query_rope.to(query.dtype)), dim=-1)
    key = torch.cat((key, key_rope.to(key.dtype)), dim=-1)
    return query, key, value, True


# ---- v1 -------------------------------------------------------------------------------------
V1_SCHEMA = (
    "npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, "
    "Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, "
    "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, Tensor? quant_scale2=None, "
    "Tensor? quant_offset2=None, Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, "
    "Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, Tensor? value_antiquant_scale=None, "
    "Tensor? value_antiquant_offset=None, Tensor? block_table=None, Tensor? query_padding_size=None, "
    "Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, Tensor? value_shared_prefix=None, "
    "SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, Tensor? key_rope=None, "
    "Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, int pre_tokens=2147483647, "
    "int next_tokens=2147483647, str input_layout=\"BSH\", int num_key_value_heads=0, int sparse_mode=0, "
    "int inner_precise=0, int block_size=0, int antiquant_mode=0, int key_antiquant_mode=0, "
    "int value_antiquant_mode=0, bool softmax_lse_flag=False) -> (Tensor, Tensor)")


def _v1(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
        dequant_scale1=None, quant_scale1=None, dequant_scale2=None, quant_scale2=None, quant_offset2=None,
        antiquant_scale=None, antiquant_offset=None, key_antiquant_scale=None, key_antiquant_offset=None,
        value_antiquant_scale=None, value_antiquant_offset=None, block_table=None, query_padding_size=None,
        kv_padding_size=None, key_shared_prefix=None, value_shared_prefix=None, actual_shared_prefix_len=None,
        query_rope=None, key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0,
        pre_tokens=INT_MAX, next_tokens=INT_MAX, input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
        inner_precise=0, block_size=0, antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0,
        softmax_lse_flag=False, op="npu_fused_infer_attention_score"):
    _refuse_quant(op, dequant_scale1=dequant_scale1, quant_scale1=quant_scale1, dequant_scale2=dequant_scale2,
                  quant_scale2=quant_scale2, quant_offset2=quant_offset2, antiquant_scale=antiquant_scale,
                  antiquant_offset=antiquant_offset, key_antiquant_scale=key_antiquant_scale,
                  key_antiquant_offset=key_antiquant_offset, value_antiquant_scale=value_antiquant_scale,
                  value_antiquant_offset=value_antiquant_offset, key_rope_antiquant_scale=key_rope_antiquant_scale)
    if query_padding_size is not None or kv_padding_size is not None:
        refuse(op, "query_padding_size/kv_padding_size (left padding)")
    if key_shared_prefix is not None or value_shared_prefix is not None:
        refuse(op, "key_shared_prefix/value_shared_prefix")
    query, key, value, rope = _mla_inputs(op, query, key, value, query_rope, key_rope, input_layout, block_table)
    return _attention(op, query, key, value, layout=input_layout, num_heads=num_heads,
                      num_kv_heads=num_key_value_heads, scale=scale, atten_mask=atten_mask, pse_shift=pse_shift,
                      actual_q=actual_seq_lengths, actual_kv=actual_seq_lengths_kv, block_table=block_table,
                      block_size=block_size, sparse_mode=sparse_mode, pre_tokens=pre_tokens,
                      next_tokens=next_tokens, sink=None, want_lse=softmax_lse_flag, rope=rope)


def _v1_fake(query, key, value, *, block_table=None, num_heads=1, input_layout="BSH", num_key_value_heads=0,
             softmax_lse_flag=False, **kwargs):
    return _fake(query, value, layout=input_layout, num_heads=num_heads, num_kv_heads=num_key_value_heads,
                 block_table=block_table, want_lse=softmax_lse_flag)


reference(V1_SCHEMA, fake=_v1_fake,
          formulation="per batch softmax(scale*q@k^T + pse, sparse_mode mask) @ v in fp32; BSH/BSND/BNSD/TND(+_NTD), "
                      "GQA, paged block_table, actual_seq_lengths(_kv)",
          test="tests/unit/npu_standin/kernels/test_attention.py::test_fia_v1_bsh_and_bnsd_match_sdpa")(
    lambda *args, **kwargs: _v1(*args, **kwargs))


# ---- v2 -------------------------------------------------------------------------------------
def _v2_schema(name: str, seq_type: str) -> str:
    return (
        f"{name}(Tensor query, Tensor key, Tensor value, *, Tensor? query_rope=None, Tensor? key_rope=None, "
        f"Tensor? pse_shift=None, Tensor? atten_mask=None, {seq_type} actual_seq_qlen=None, "
        f"{seq_type} actual_seq_kvlen=None, Tensor? block_table=None, Tensor? dequant_scale_query=None, "
        "Tensor? dequant_scale_key=None, Tensor? dequant_offset_key=None, Tensor? dequant_scale_value=None, "
        "Tensor? dequant_offset_value=None, Tensor? dequant_scale_key_rope=None, Tensor? quant_scale_out=None, "
        "Tensor? quant_offset_out=None, Tensor? quant_scale_p=None, Tensor? learnable_sink=None, "
        "int num_query_heads=1, int num_key_value_heads=0, float softmax_scale=1.0, int pre_tokens=2147483647, "
        "int next_tokens=2147483647, str input_layout=\"BSH\", int sparse_mode=0, int block_size=0, "
        "int query_quant_mode=0, int key_quant_mode=0, int value_quant_mode=0, int inner_precise=0, "
        "bool return_softmax_lse=False, int? query_dtype=None, int? key_dtype=None, int? value_dtype=None, "
        "int? query_rope_dtype=None, int? key_rope_dtype=None, int? key_shared_prefix_dtype=None, "
        "int? value_shared_prefix_dtype=None, int? dequant_scale_query_dtype=None, "
        "int? dequant_scale_key_dtype=None, int? dequant_scale_value_dtype=None, "
        "int? dequant_scale_key_rope_dtype=None, int? out_dtype=None) -> (Tensor, Tensor)")


def _v2(query, key, value, *, query_rope=None, key_rope=None, pse_shift=None, atten_mask=None, actual_seq_qlen=None,
        actual_seq_kvlen=None, block_table=None, dequant_scale_query=None, dequant_scale_key=None,
        dequant_offset_key=None, dequant_scale_value=None, dequant_offset_value=None, dequant_scale_key_rope=None,
        quant_scale_out=None, quant_offset_out=None, quant_scale_p=None, learnable_sink=None, num_query_heads=1,
        num_key_value_heads=0, softmax_scale=1.0, pre_tokens=INT_MAX, next_tokens=INT_MAX, input_layout="BSH",
        sparse_mode=0, block_size=0, query_quant_mode=0, key_quant_mode=0, value_quant_mode=0, inner_precise=0,
        return_softmax_lse=False, query_dtype=None, key_dtype=None, value_dtype=None, query_rope_dtype=None,
        key_rope_dtype=None, key_shared_prefix_dtype=None, value_shared_prefix_dtype=None,
        dequant_scale_query_dtype=None, dequant_scale_key_dtype=None, dequant_scale_value_dtype=None,
        dequant_scale_key_rope_dtype=None, out_dtype=None, op="npu_fused_infer_attention_score_v2"):
    _refuse_quant(op, dequant_scale_query=dequant_scale_query, dequant_scale_key=dequant_scale_key,
                  dequant_offset_key=dequant_offset_key, dequant_scale_value=dequant_scale_value,
                  dequant_offset_value=dequant_offset_value, dequant_scale_key_rope=dequant_scale_key_rope,
                  quant_scale_out=quant_scale_out, quant_offset_out=quant_offset_out, quant_scale_p=quant_scale_p)
    if out_dtype is not None or query.dtype in (torch.int8, torch.uint8):
        refuse(op, "int8 / fp8 inputs or out_dtype (a quantized path)")
    query, key, value, rope = _mla_inputs(op, query, key, value, query_rope, key_rope, input_layout, block_table)
    if learnable_sink is not None and _split_layout(input_layout)[0] not in ("TND", "NTD"):
        raise ValueError(f"{op}: learnable_sink is supported with TND / NTD_TND only, got {input_layout}")
    return _attention(op, query, key, value, layout=input_layout, num_heads=num_query_heads,
                      num_kv_heads=num_key_value_heads, scale=softmax_scale, atten_mask=atten_mask,
                      pse_shift=pse_shift, actual_q=actual_seq_qlen, actual_kv=actual_seq_kvlen,
                      block_table=block_table, block_size=block_size, sparse_mode=sparse_mode,
                      pre_tokens=pre_tokens, next_tokens=next_tokens, sink=learnable_sink,
                      want_lse=return_softmax_lse, rope=rope)


def _v2_fake(query, key, value, *, block_table=None, num_query_heads=1, num_key_value_heads=0, input_layout="BSH",
             return_softmax_lse=False, **kwargs):
    return _fake(query, value, layout=input_layout, num_heads=num_query_heads, num_kv_heads=num_key_value_heads,
                 block_table=block_table, want_lse=return_softmax_lse)


reference(_v2_schema("npu_fused_infer_attention_score_v2", "SymInt[]?"), fake=_v2_fake,
          formulation="as npu_fused_infer_attention_score, v2 names; learnable_sink adds a per-head logit to the "
                      "softmax denominator",
          test="tests/unit/npu_standin/kernels/test_attention.py"
               "::test_fia_v2_tnd_paged_causal_matches_transformers_qwen3_attention")(
    lambda *args, **kwargs: _v2(*args, **kwargs))

# torchair.ops.npu_fused_infer_attention_score_v2: the same op taking the lengths as tensors (air::).
reference(_v2_schema("npu_fused_infer_attention_score_v2", "Tensor?"), namespace="air", fake=_v2_fake,
          formulation="torch_npu's v2 with actual_seq_qlen/kvlen as tensors (torchair's graph-mode op)",
          test="tests/unit/npu_standin/kernels/test_attention.py::test_torchair_fia_v2_equals_torch_npu_v2")(
    lambda *args, **kwargs: _v2(*args, op="torchair.ops.npu_fused_infer_attention_score_v2", **kwargs))


def _air_v1_schema() -> str:
    return V1_SCHEMA.replace("SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None",
                             "Tensor? actual_seq_lengths=None, Tensor? actual_seq_lengths_kv=None")


reference(_air_v1_schema(), namespace="air", fake=_v1_fake,
          formulation="torch_npu's v1 with actual_seq_lengths(_kv) as tensors (torchair's graph-mode op)",
          test="tests/unit/npu_standin/kernels/test_attention.py::test_torchair_fia_v2_equals_torch_npu_v2")(
    lambda *args, **kwargs: _v1(*args, op="torchair.ops.npu_fused_infer_attention_score", **kwargs))


# ---- npu_fusion_attention (training FA; forward, keep_prob 1) --------------------------------
def _fusion_fake(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None, scale=1.0,
                 keep_prob=1.0, pre_tockens=INT_MAX, next_tockens=INT_MAX, inner_precise=0, prefix=None,
                 actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
                 softmax_layout="", sink=None, dropout_mask=None, seed=0, offset=0):
    out, _ = _fake(query, value, layout=input_layout, num_heads=head_num, num_kv_heads=_fusion_kv_heads(
        query, key, head_num, input_layout), block_table=None, want_lse=False)
    if input_layout == "TND":
        stats = (query.shape[0], head_num, 8)
    else:
        b = query.shape[1] if input_layout == "SBH" else query.shape[0]
        s = {"BSH": query.shape[1], "SBH": query.shape[0], "BSND": query.shape[1]}.get(input_layout, query.shape[2])
        stats = (b, head_num, s, 8)
    f32 = torch.float32
    return out, query.new_empty(stats, dtype=f32), query.new_empty(stats, dtype=f32), query.new_empty((0,)), 0, 0, 0


def _fusion_kv_heads(query, key, head_num, layout):
    if layout in ("BSH", "SBH"):
        d = query.shape[-1] // head_num
        return key.shape[-1] // d
    if layout == "BNSD":
        return key.shape[1]
    return key.shape[-2]


@reference("npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
           "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., "
           "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
           "int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
           "bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", Tensor? sink=None, "
           "Tensor? dropout_mask=None, int seed=0, int offset=0) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)",
           formulation="the attention reference (modes 0-4, TND cumulative lengths); softmax_max / softmax_sum "
                       "(fp32, 8 copies on the last axis); keep_prob 1 only",
           test="tests/unit/npu_standin/kernels/test_attention.py::test_fusion_attention_causal_matches_sdpa",
           fake=_fusion_fake)
def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1.0, keep_prob=1.0, pre_tockens=INT_MAX, next_tockens=INT_MAX, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False, softmax_layout="", sink=None, dropout_mask=None,
                         seed=0, offset=0):
    op = "npu_fusion_attention"
    if keep_prob != 1.0 or dropout_mask is not None:
        refuse(op, f"keep_prob={keep_prob} (dropout)")
    if prefix is not None or sparse_mode > 4 or padding_mask is not None or sink is not None:
        refuse(op, f"prefix/padding_mask/sink or sparse_mode={sparse_mode}")
    layout = input_layout
    q, k, v = query, key, value
    if layout == "SBH":
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        layout = "BSH"
    if atten_mask is None:
        sparse_mode = 0      # documented: without a mask, sparse_mode / pre / next do not apply (full attention)
    kv_heads = _fusion_kv_heads(query, key, head_num, input_layout)
    out, packed = _attention(op, q, k, v, layout=layout, num_heads=head_num, num_kv_heads=kv_heads, scale=scale,
                             atten_mask=atten_mask, pse_shift=pse, actual_q=actual_seq_qlen,
                             actual_kv=actual_seq_kvlen, block_table=None, block_size=0, sparse_mode=sparse_mode,
                             pre_tokens=pre_tockens, next_tokens=next_tockens, sink=None, want_lse=False,
                             want_stats=True, incremental=False)
    if input_layout == "SBH":
        out = out.transpose(0, 1).contiguous()
    stats_max = packed[..., 0:1].expand(*packed.shape[:-1], 8).contiguous()
    stats_sum = packed[..., 1:2].expand(*packed.shape[:-1], 8).contiguous()
    return out, stats_max, stats_sum, query.new_empty((0,)), 0, 0, 0
