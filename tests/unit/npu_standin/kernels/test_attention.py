"""The stand-in's fused-attention references against transformers' attention and torch's sdpa:
layouts, GQA, paged KV, actual sequence lengths, sparse modes, learnable sinks, torchair's variant."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from npu_standin import kernels

MASK_2048 = ~torch.tril(torch.ones(2048, 2048, dtype=torch.bool))    # upstream's compressed causal mask


@pytest.fixture(scope="module", autouse=True)
def registered():
    kernels.install()


def fia(*args, **kwargs):
    return torch.ops.npu.npu_fused_infer_attention_score(*args, **kwargs)


def fia2(*args, **kwargs):
    return torch.ops.npu.npu_fused_infer_attention_score_v2(*args, **kwargs)


def hf_eager(q, k, v, mask, scale, groups, sinks=None):
    """transformers' eager attention (qwen3's, or gpt-oss's with sinks) on BNSD tensors."""
    module = torch.nn.Module()
    module.num_key_value_groups = groups
    module.training = False
    if sinks is not None:
        from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

        module.sinks = sinks
    else:
        from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward
    additive = None if mask is None else torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    out, _ = eager_attention_forward(module, q, k, v, additive, scaling=scale)
    return out                                                   # (B, S, N, D)


def causal(sq, skv):
    return torch.ones(sq, skv, dtype=torch.bool).tril(skv - sq)


def test_fia_v1_bsh_and_bnsd_match_sdpa():
    torch.manual_seed(0)
    b, s, n, d = 2, 6, 4, 8
    q, k, v = (torch.randn(b, n, s, d) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    scale = 1 / math.sqrt(d)
    out, lse = fia(q, k, v, num_heads=n, scale=scale, input_layout="BNSD", sparse_mode=3, atten_mask=MASK_2048)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert lse.shape == (1,)
    bsh = lambda t: t.transpose(1, 2).reshape(b, s, n * d)  # noqa: E731
    out, lse = fia(bsh(q), bsh(k), bsh(v), num_heads=n, scale=scale, input_layout="BSH", sparse_mode=3,
                   atten_mask=MASK_2048, softmax_lse_flag=True)
    torch.testing.assert_close(out, bsh(want), atol=1e-5, rtol=1e-5)
    assert lse.shape == (b, n, s, 1)
    # sparse_mode 0 with a full mask (True = masked) against sdpa's boolean mask (True = kept)
    mask = torch.rand(s, s) > 0.4
    mask[:, 0] = False
    out, _ = fia(q, k, v, num_heads=n, scale=scale, input_layout="BNSD", atten_mask=mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=~mask), atol=1e-5, rtol=1e-5)


def test_fia_v1_gqa_decode_with_kv_lengths_matches_transformers():
    torch.manual_seed(1)
    b, n, kv, d, skv = 3, 8, 2, 16, 10
    q = torch.randn(b, n, 1, d)
    k, v = torch.randn(b, kv, skv, d), torch.randn(b, kv, skv, d)
    lengths = [10, 4, 7]
    out, _ = fia(q, k, v, num_heads=n, num_key_value_heads=kv, scale=0.25, input_layout="BNSD",
                 actual_seq_lengths_kv=lengths)
    for i, length in enumerate(lengths):
        want = hf_eager(q[i:i + 1], k[i:i + 1, :, :length], v[i:i + 1, :, :length], None, 0.25, n // kv)
        torch.testing.assert_close(out[i:i + 1].transpose(1, 2), want, atol=1e-5, rtol=1e-5)


def _paged(seqs_k, seqs_v, block_size, blocks, kv, d, layout4=False):
    """A paged cache holding each sequence's K/V in shuffled blocks, and its block table."""
    rng = torch.Generator().manual_seed(5)
    order = torch.randperm(blocks, generator=rng).tolist()
    cache_k = torch.zeros(blocks, block_size, kv * d)
    cache_v = torch.zeros(blocks, block_size, kv * d)
    width = max(-(-t.shape[0] // block_size) for t in seqs_k)
    table = torch.zeros(len(seqs_k), width, dtype=torch.int32)
    for i, (ks, vs) in enumerate(zip(seqs_k, seqs_v)):
        for j in range(-(-ks.shape[0] // block_size)):
            block = order.pop()
            table[i, j] = block
            part = slice(j * block_size, min((j + 1) * block_size, ks.shape[0]))
            rows = ks[part].shape[0]
            cache_k[block, :rows] = ks[part].reshape(rows, -1)
            cache_v[block, :rows] = vs[part].reshape(rows, -1)
    if layout4:
        cache_k = cache_k.view(blocks, block_size, kv, d).permute(0, 2, 1, 3).contiguous()
        cache_v = cache_v.view(blocks, block_size, kv, d).permute(0, 2, 1, 3).contiguous()
    return cache_k, cache_v, table


@pytest.mark.parametrize("layout4", [False, True])
def test_fia_v2_tnd_paged_causal_matches_transformers_qwen3_attention(layout4):
    """upstream's qwen: packed TND queries, paged KV (block_table), cumulative actual_seq_qlen,
    per-sequence actual_seq_kvlen, sparse_mode 3 — prefill of two prompts, then one decode step."""
    torch.manual_seed(2)
    n, kv, d, block = 4, 2, 8, 4
    lengths = [5, 9]
    ks = [torch.randn(s, kv, d) for s in lengths]
    vs = [torch.randn(s, kv, d) for s in lengths]
    qs = [torch.randn(s, n, d) for s in lengths]
    cache_k, cache_v, table = _paged(ks, vs, block, 8, kv, d, layout4)
    cum = [5, 14]
    out, _ = fia2(torch.cat(qs), cache_k, cache_v, num_query_heads=n, num_key_value_heads=kv, softmax_scale=0.3,
                  input_layout="TND", sparse_mode=3, atten_mask=MASK_2048, actual_seq_qlen=torch.tensor(cum),
                  actual_seq_kvlen=torch.tensor(lengths), block_table=table, block_size=block)
    start = 0
    for q, k, v in zip(qs, ks, vs):
        s = q.shape[0]
        want = hf_eager(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal(s, s),
                        0.3, n // kv)[0]
        torch.testing.assert_close(out[start:start + s], want, atol=1e-5, rtol=1e-5)
        start += s
    # decode: one new token per sequence, attending to the whole cache
    q1 = torch.randn(2, n, d)
    out, _ = fia2(q1, cache_k, cache_v, num_query_heads=n, num_key_value_heads=kv, softmax_scale=0.3,
                  input_layout="TND", sparse_mode=3, atten_mask=MASK_2048, actual_seq_qlen=[1, 2],
                  actual_seq_kvlen=lengths, block_table=table, block_size=block)
    for i, (k, v) in enumerate(zip(ks, vs)):
        want = hf_eager(q1[i][:, None][None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, 0.3, n // kv)
        torch.testing.assert_close(out[i], want[0, 0], atol=1e-5, rtol=1e-5)


def test_fia_v2_learnable_sink_matches_transformers_gpt_oss():
    torch.manual_seed(3)
    n, kv, d, s = 4, 2, 8, 6
    q, k, v = torch.randn(s, n, d), torch.randn(s, kv, d), torch.randn(s, kv, d)
    sinks = torch.randn(n)
    out, _ = fia2(q, k, v, num_query_heads=n, num_key_value_heads=kv, softmax_scale=0.35, input_layout="TND",
                  sparse_mode=3, atten_mask=MASK_2048, actual_seq_qlen=[s], actual_seq_kvlen=[s],
                  learnable_sink=sinks)
    want = hf_eager(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal(s, s), 0.35,
                    n // kv, sinks=sinks)[0]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_fia_v2_band_mode_counts_pre_tokens_previous_tokens_unlike_transformers_window():
    """sparse_mode 4 (band from the bottom right) with pre_tokens=W lets each query see W previous
    tokens and itself: transformers' sliding_window=W sees W-1 previous tokens and itself. Upstream's
    gpt_oss passes pre_tokens=sliding_window: on sequences longer than the window the two differ by a
    key (shown here; the whole recipe under --tiny's short window: tests/e2e/test_upstream_recipes_standin.py)."""
    torch.manual_seed(4)
    n, d, s, window = 2, 8, 9, 3
    q, k, v = torch.randn(s, n, d), torch.randn(s, n, d), torch.randn(s, n, d)
    out, _ = fia2(q, k, v, num_query_heads=n, softmax_scale=0.4, input_layout="TND", sparse_mode=4,
                  atten_mask=MASK_2048, pre_tokens=window, next_tokens=0, actual_seq_qlen=[s], actual_seq_kvlen=[s])
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    band = lambda w: (j <= i) & (j > i - w)  # noqa: E731  transformers' sliding window of w keys
    bnsd = lambda t: t.transpose(0, 1)[None]  # noqa: E731
    torch.testing.assert_close(out, hf_eager(bnsd(q), bnsd(k), bnsd(v), band(window + 1), 0.4, 1)[0],
                               atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, hf_eager(bnsd(q), bnsd(k), bnsd(v), band(window), 0.4, 1)[0], atol=1e-3)


def test_fia_decode_in_tnd_keeps_the_band_and_the_incremental_layouts_ignore_it():
    """A one-token query in TND takes the prompt path, whose mode 4 band holds at decode (the last row of
    the prefill's band: pre_tokens=2 sees the query's key and 2 before it, see the kernel's docs); in
    BNSD (the incremental branch) sparse_mode and the tokens have no effect, as documented."""
    torch.manual_seed(6)
    q, k, v = torch.randn(7, 2, 4), torch.randn(7, 2, 4), torch.randn(7, 2, 4)
    band = dict(sparse_mode=4, pre_tokens=2, next_tokens=0, atten_mask=MASK_2048)
    decode, _ = fia2(q[-1:], k, v, num_query_heads=2, input_layout="TND", actual_seq_qlen=[1], actual_seq_kvlen=[7],
                     **band)
    prefill, _ = fia2(q, k, v, num_query_heads=2, input_layout="TND", actual_seq_qlen=[7], actual_seq_kvlen=[7],
                      **band)
    torch.testing.assert_close(decode, prefill[-1:])
    last3, _ = fia2(q[-1:], k[-3:], v[-3:], num_query_heads=2, input_layout="TND", actual_seq_qlen=[1],
                    actual_seq_kvlen=[3])
    torch.testing.assert_close(decode, last3)
    bnsd = lambda t: t.transpose(0, 1)[None]  # noqa: E731
    ignored, _ = fia2(bnsd(q[-1:]), bnsd(k), bnsd(v), num_query_heads=2, input_layout="BNSD", **band)
    full, _ = fia2(bnsd(q[-1:]), bnsd(k), bnsd(v), num_query_heads=2, input_layout="BNSD")
    torch.testing.assert_close(ignored, full)
    assert not torch.allclose(ignored[0].transpose(0, 1), decode, atol=1e-3)


def test_fia_prefill_without_mask_for_causal_mode_is_refused_as_on_the_npu():
    q = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="needs atten_mask"):
        fia2(q, q, q, num_query_heads=2, input_layout="TND", sparse_mode=3, actual_seq_qlen=[4], actual_seq_kvlen=[4])


def test_torchair_fia_v2_equals_torch_npu_v2():
    torch.manual_seed(7)
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    common = dict(num_query_heads=4, num_key_value_heads=2, softmax_scale=0.3, input_layout="TND", sparse_mode=3,
                  atten_mask=MASK_2048)
    listed, _ = fia2(q, k, v, actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 5], **common)
    tensors, _ = torch.ops.air.npu_fused_infer_attention_score_v2(
        q, k, v, actual_seq_qlen=torch.tensor([2, 5]), actual_seq_kvlen=torch.tensor([2, 5]), **common)
    torch.testing.assert_close(listed, tensors)
    v1, _ = torch.ops.air.npu_fused_infer_attention_score(
        q, k, v, num_heads=4, num_key_value_heads=2, scale=0.3, input_layout="TND", sparse_mode=3,
        atten_mask=MASK_2048, actual_seq_lengths=torch.tensor([2, 5]), actual_seq_lengths_kv=torch.tensor([2, 5]))
    torch.testing.assert_close(v1, listed)


def test_fusion_attention_causal_matches_sdpa():
    torch.manual_seed(8)
    b, n, s, d = 2, 3, 5, 8
    q, k, v = (torch.randn(b, n, s, d) for _ in range(3))
    out, smax, ssum, _, seed, offset, numels = torch.ops.npu.npu_fusion_attention(
        q, k, v, n, "BNSD", atten_mask=MASK_2048[:s, :s], scale=1 / math.sqrt(d), sparse_mode=2)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5, rtol=1e-5)
    assert smax.shape == ssum.shape == (b, n, s, 8) and (seed, offset, numels) == (0, 0, 0)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~causal(s, s), float("-inf"))
    torch.testing.assert_close(smax[..., 0] + torch.log(ssum[..., 0]), torch.logsumexp(scores, -1))
    full, *_ = torch.ops.npu.npu_fusion_attention(q, k, v, n, "BNSD", scale=1 / math.sqrt(d), sparse_mode=3)
    torch.testing.assert_close(full, F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_fia_refuses_quantized_paths_in_one_line():
    from npu_standin.errors import UnsupportedOp

    q = torch.randn(1, 1, 8)
    with pytest.raises(UnsupportedOp) as info:
        fia2(q, q, q, input_layout="BSH", quant_scale_out=torch.ones(1))
    assert "quant_scale_out" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("layout,shape", [("BSH", (2, 3, 32)), ("BNSD", (2, 4, 3, 8)), ("TND", (6, 4, 8)),
                                          ("BNSD_BSND", (2, 4, 3, 8))])
def test_fake_shapes_equal_the_references(layout, shape):
    """What graph capture is told (the fake kernel) is what the reference returns."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q = torch.randn(*shape)
    extra = {"actual_seq_qlen": [3, 6], "actual_seq_kvlen": [3, 6]} if layout == "TND" else {}
    real, _ = fia2(q, q, q, num_query_heads=4, input_layout=layout, **extra)
    with FakeTensorMode() as mode:
        fake, _ = fia2(mode.from_tensor(q), mode.from_tensor(q), mode.from_tensor(q), num_query_heads=4,
                       input_layout=layout, **extra)
    assert tuple(fake.shape) == tuple(real.shape) and fake.dtype == real.dtype


def _paged_decode(rows=2, heads=4, kv_heads=2, dim=16, block=4, blocks_per_row=3, seed=3):
    """One query per row over a paged cache: (query BSH, caches (blocks, block, kv_heads x dim), table, lengths)."""
    gen = torch.Generator().manual_seed(seed)
    cache_k = torch.randn(rows * blocks_per_row, block, kv_heads * dim, generator=gen)
    cache_v = torch.randn(rows * blocks_per_row, block, kv_heads * dim, generator=gen)
    table = torch.arange(rows * blocks_per_row, dtype=torch.int32).view(rows, blocks_per_row).flip(1).contiguous()
    query = torch.randn(rows, 1, heads * dim, generator=gen)
    return query, cache_k, cache_v, table, [9, 5][:rows]


def test_fia_v2_pse_shift_is_added_to_the_scaled_scores_of_a_paged_decode():
    """pse_shift (B, N, 1, KV_S) joins the scores after softmax_scale, each key column its own (the ALiBi decode of
    agent/recipe/native/parts/code/attention_alibi.py)."""
    rows, heads, kv_heads, dim, block = 2, 4, 2, 16, 4
    query, cache_k, cache_v, table, lengths = _paged_decode(rows, heads, kv_heads, dim, block)
    width = table.shape[1] * block
    pse = torch.randn(rows, heads, 1, width, generator=torch.Generator().manual_seed(8))
    out, _ = fia2(query, cache_k, cache_v, pse_shift=pse, num_query_heads=heads, num_key_value_heads=kv_heads,
                  softmax_scale=0.25, input_layout="BSH", actual_seq_kvlen=lengths, block_table=table, block_size=block)
    for b, n in enumerate(lengths):
        slots = (table[b].long().repeat_interleave(block) * block + torch.arange(width) % block)[:n]
        k = cache_k.view(-1, kv_heads, dim)[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        v = cache_v.view(-1, kv_heads, dim)[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        q = query[b].view(heads, 1, dim)
        probs = (q @ k.transpose(-1, -2) * 0.25 + pse[b, :, :, :n]).softmax(-1)
        assert torch.allclose(out[b].view(heads, dim), (probs @ v).view(heads, dim), atol=1e-5)


@pytest.mark.parametrize("case, message", [
    ("tnd", "not supported with input_layout TND"),
    ("narrow", "< the block table's"),
    ("heads", "not (B or 1, N=4"),
])
def test_fia_v2_pse_shift_outside_the_documented_shapes_is_refused(case, message):
    """As op-plugin's torch_npu-npu_fused_infer_attention_score_v2.md documents pse_shift: not in TND; under page
    attention KV_S at least the table's width x block_size; (B or 1, N, Q_S, KV_S)."""
    rows, heads, kv_heads, dim, block = 2, 4, 2, 16, 4
    query, cache_k, cache_v, table, lengths = _paged_decode(rows, heads, kv_heads, dim, block)
    width = table.shape[1] * block
    pse = torch.zeros(rows, heads if case != "heads" else 2, 1, width - 1 if case == "narrow" else width)
    kwargs = dict(pse_shift=pse, num_query_heads=heads, num_key_value_heads=kv_heads, block_table=table,
                  block_size=block)
    with pytest.raises(ValueError, match=re.escape(message)):
        if case == "tnd":
            fia2(query.view(rows, heads, dim), cache_k, cache_v, input_layout="TND",
                 actual_seq_qlen=list(range(1, rows + 1)), actual_seq_kvlen=lengths, **kwargs)
        else:
            fia2(query, cache_k, cache_v, input_layout="BSH", actual_seq_kvlen=lengths, **kwargs)
