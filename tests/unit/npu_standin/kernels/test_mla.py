"""The stand-in's MLA references (npu_kv_rmsnorm_rope_cache_v2, npu_mla_prolog_v3, and the fused
attention with query_rope / key_rope over FRACTAL_NZ paged caches) against independent formulations:
transformers' DeepseekV3 modules (RMSNorm, interleaved RoPE, DeepseekV3Attention itself) and the cache
layouts read back element by element from the documented memory order."""

from __future__ import annotations

import pytest
import torch

from npu_standin import kernels

MASK_2048 = ~torch.tril(torch.ones(2048, 2048, dtype=torch.bool))
BF16 = torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def registered():
    kernels.install()


def ops():
    return torch.ops.npu


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def nz_row(cache, slot, c0=16):
    """Row `slot` (head 0) of a PA_NZ cache, read from flat memory in the documented
    (block_num, D // c0, block_size, 1, c0) order, one element at a time."""
    blocks, block_size, _, dim = cache.shape
    flat = cache.contiguous().view(-1)
    block, offset = divmod(slot, block_size)
    return torch.stack([flat[block * block_size * dim + (d // c0) * block_size * c0 + offset * c0 + d % c0]
                        for d in range(dim)])


def tiny_config(**overrides):
    from transformers import DeepseekV3Config

    settings = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                    qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=16, rms_norm_eps=1e-6,
                    num_hidden_layers=1, vocab_size=64, rope_interleave=True)
    settings.update(overrides)
    config = DeepseekV3Config(**settings)
    config._attn_implementation = "eager"
    return config


@pytest.fixture(scope="module")
def attention():
    """transformers' DeepseekV3Attention with random weights (norm weights too), and its rotary table."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    torch.manual_seed(0)
    config = tiny_config()
    attn = DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
    return attn, DeepseekV3RotaryEmbedding(config), config


def rope_tables(rotary, length):
    x = torch.zeros(1, length, 1)
    cos, sin = rotary(x, torch.arange(length)[None])
    return cos[0], sin[0]                                       # (S, Dr): cat(freqs, freqs)


# ---- npu_kv_rmsnorm_rope_cache_v2 -------------------------------------------------------------------
@pytest.mark.parametrize("cache_mode", ["PA_NZ", "PA_BNSD", "Norm"])
def test_kv_rmsnorm_rope_cache_v2_matches_rmsnorm_rope_and_scatter(cache_mode):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3RMSNorm,
                                                                      apply_rotary_pos_emb_interleave)

    torch.manual_seed(1)
    tokens, dv, dk, blocks, block_size = 6, 32, 16, 4, 16
    kv = torch.randn(tokens, 1, 1, dv + dk).to(BF16)
    norm = DeepseekV3RMSNorm(dv, eps=1e-6)
    norm.weight.data = torch.rand(dv) + 0.5
    norm.requires_grad_(False)
    cos = torch.randn(tokens, dk // 2).repeat(1, 2)
    sin = torch.randn(tokens, dk // 2).repeat(1, 2)
    if cache_mode == "Norm":               # (B, N, S_cache, D): one sequence of `tokens`, at per-batch offsets
        kv = kv.view(1, 1, tokens, dv + dk)
        k_cache, ckv_cache = torch.zeros(1, 1, 10, dk, dtype=BF16), torch.zeros(1, 1, 10, dv, dtype=BF16)
        index = torch.tensor([[3, 4, 5, 6, 7, -1]])
        shape = (1, 1, tokens, -1)
    else:
        k_cache = torch.zeros(blocks, block_size, 1, dk, dtype=BF16)
        ckv_cache = torch.zeros(blocks, block_size, 1, dv, dtype=BF16)
        index = torch.tensor([0, 1, 17, 40, 63, -1])
        shape = (tokens, 1, 1, -1)
    k, y = ops().npu_kv_rmsnorm_rope_cache_v2(kv, norm.weight.to(BF16), cos.view(shape).to(BF16),
                                              sin.view(shape).to(BF16), index, k_cache, ckv_cache, epsilon=1e-6,
                                              cache_mode=cache_mode, is_output_kv=True)
    flat = kv.reshape(tokens, dv + dk).float()
    want_y = norm(flat[:, :dv])
    _, want_k = apply_rotary_pos_emb_interleave(flat[:, None, None, dv:], flat[:, None, None, dv:],
                                                cos[:, None], sin[:, None], unsqueeze_dim=1)
    assert k.shape == kv.shape[:-1] + (dk,) and y.shape == kv.shape[:-1] + (dv,) and k.dtype == BF16
    assert rel(y.reshape(tokens, dv), want_y) < 1e-2
    assert rel(k.reshape(tokens, dk), want_k.reshape(tokens, dk)) < 1e-2
    for t, slot in enumerate(index.reshape(-1).tolist()):
        if slot < 0:
            continue
        if cache_mode == "PA_NZ":
            got_c, got_k = nz_row(ckv_cache, slot), nz_row(k_cache, slot)
        elif cache_mode == "PA_BNSD":
            got_c, got_k = ckv_cache.view(-1, dv)[slot], k_cache.view(-1, dk)[slot]
        else:
            got_c, got_k = ckv_cache[0, 0, slot], k_cache[0, 0, slot]
        assert torch.equal(got_c, y.reshape(tokens, dv)[t]) and torch.equal(got_k, k.reshape(tokens, dk)[t])
    written = int((index >= 0).sum())
    assert int((ckv_cache != 0).sum()) == written * dv and int((k_cache != 0).sum()) == written * dk  # nothing else


def test_kv_rmsnorm_rope_cache_v2_refuses_an_int8_cache_in_one_line():
    from npu_standin.errors import UnsupportedOp

    kv = torch.randn(2, 1, 1, 48, dtype=BF16)
    with pytest.raises(UnsupportedOp, match=r"npu_kv_rmsnorm_rope_cache_v2 with k_rope_scale/c_kv_scale"):
        ops().npu_kv_rmsnorm_rope_cache_v2(kv, torch.ones(32, dtype=BF16), torch.ones(2, 1, 1, 16, dtype=BF16),
                                           torch.ones(2, 1, 1, 16, dtype=BF16), torch.tensor([0, 1]),
                                           torch.zeros(1, 16, 1, 16, dtype=torch.int8),
                                           torch.zeros(1, 16, 1, 32, dtype=torch.int8),
                                           c_kv_scale=torch.ones(32), k_rope_scale=torch.ones(16), cache_mode="PA_NZ")


# ---- npu_mla_prolog_v3 ----------------------------------------------------------------------------
def _reference_branches(attn, config, x, cos, sin):
    """transformers' DeepseekV3Attention, step by step up to its caches: (q_nope absorbed by W_uk,
    q_rope, the normalised latent c_kv, the rotated shared key k_rope)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    n, d, dr, dv = config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    tokens = x.shape[0]
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(tokens, n, d + dr)
    q_nope, q_pe = q[..., :d], q[..., d:]
    kv = attn.kv_a_proj_with_mqa(x)
    c_kv, k_pe = attn.kv_a_layernorm(kv[:, :config.kv_lora_rank]), kv[:, config.kv_lora_rank:]
    q_rope, k_rope = apply_rotary_pos_emb_interleave(q_pe.transpose(0, 1)[None], k_pe[None, None], cos[None], sin[None])
    w_uk = attn.kv_b_proj.weight.view(n, d + dv, config.kv_lora_rank)[:, :d]          # (N, D, Hckv)
    return torch.einsum("tnd,ndc->tnc", q_nope, w_uk), q_rope[0].transpose(0, 1), c_kv, k_rope[0, 0]


def _prolog(attn, config, x, cos, sin, kv_cache, kr_cache, index):
    n, d, dv = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    w_uk = attn.kv_b_proj.weight.view(n, d + dv, config.kv_lora_rank)[:, :d].contiguous()
    weights = [attn.q_a_proj.weight.T, attn.q_b_proj.weight.T, w_uk, attn.kv_a_proj_with_mqa.weight.T,
               attn.q_a_layernorm.weight, attn.kv_a_layernorm.weight]
    weights = [w.detach().contiguous().to(BF16) for w in weights]
    return ops().npu_mla_prolog_v3(x.to(BF16), *weights[:4], weights[4], weights[5], sin.to(BF16), cos.to(BF16),
                                   kv_cache, kr_cache, cache_index=index, rmsnorm_epsilon_cq=config.rms_norm_eps,
                                   rmsnorm_epsilon_ckv=config.rms_norm_eps, cache_mode="PA_NZ")


def test_mla_prolog_v3_is_the_composition_of_its_matmuls_norms_and_rope(attention):
    attn, rotary, config = attention
    torch.manual_seed(2)
    tokens = 5
    x = torch.randn(tokens, config.hidden_size)
    cos, sin = rope_tables(rotary, tokens)
    kv_cache = torch.zeros(3, 16, 1, config.kv_lora_rank, dtype=BF16)
    kr_cache = torch.zeros(3, 16, 1, config.qk_rope_head_dim, dtype=BF16)
    index = torch.tensor([16, 17, 18, 2, 40])
    q_nope, q_rope, dequant, norm, _ = _prolog(attn, config, x, cos, sin, kv_cache, kr_cache, index)
    with torch.no_grad():
        want_q, want_rope, want_ckv, want_kr = _reference_branches(attn, config, x, cos, sin)
    assert q_nope.shape == (tokens, config.num_attention_heads, config.kv_lora_rank) and q_nope.dtype == BF16
    assert q_rope.shape == (tokens, config.num_attention_heads, config.qk_rope_head_dim)
    assert dequant.numel() == 0 and norm.numel() == 0            # non-quantized, query_norm_flag False
    assert rel(q_nope, want_q) < 2e-2 and rel(q_rope, want_rope) < 2e-2
    for t, slot in enumerate(index.tolist()):
        assert rel(nz_row(kv_cache, slot), want_ckv[t]) < 2e-2
        assert rel(nz_row(kr_cache, slot), want_kr[t]) < 2e-2


# ---- fused attention with query_rope / key_rope (MLA) -------------------------------------------------
def _hf_attention(attn, rotary, x):
    tokens = x.shape[0]
    cos, sin = rotary(x[None], torch.arange(tokens)[None])
    mask = torch.full((tokens, tokens), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out, _ = attn(x[None], (cos, sin), mask)
    return out[0]


def test_fia_v1_mla_prefill_ntd_tnd_matches_transformers_deepseek_v3_attention(attention):
    """upstream's prefill (forward_page_attention_normal): un-absorbed heads, NTD in, TND out,
    query_rope / key_rope, sparse_mode 3."""
    attn, rotary, config = attention
    torch.manual_seed(3)
    tokens, n = 7, config.num_attention_heads
    d, dr, dv = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    x = torch.randn(tokens, config.hidden_size)
    cos, sin = rope_tables(rotary, tokens)
    with torch.no_grad():
        _, q_rope, c_kv, k_rope = _reference_branches(attn, config, x, cos, sin)
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(tokens, n, d + dr)
        kv = attn.kv_b_proj(c_kv).view(tokens, n, d + dv)
    out, _ = ops().npu_fused_infer_attention_score(
        q[..., :d].transpose(0, 1), kv[..., :d].transpose(0, 1), kv[..., d:].transpose(0, 1),
        query_rope=q_rope.transpose(0, 1), key_rope=k_rope[None].expand(n, -1, -1), num_heads=n,
        num_key_value_heads=n, input_layout="NTD_TND", atten_mask=MASK_2048, sparse_mode=3,
        actual_seq_lengths=[tokens], actual_seq_lengths_kv=[tokens], scale=attn.scaling)
    assert out.shape == (tokens, n, dv)
    with torch.no_grad():
        got = attn.o_proj(out.reshape(tokens, n * dv))
    assert rel(got, _hf_attention(attn, rotary, x)) < 1e-4


def test_fia_v2_mla_absorbed_over_nz_caches_matches_transformers_deepseek_v3_attention(attention):
    """upstream's decode (forward_page_attention_mla_prolog): npu_mla_prolog_v3 fills PA_NZ caches, the
    v2 attention reads them as (blocks, 1, D // 16, block_size, 16) with TND_NTD, the latent output
    is un-absorbed by W_uv (npu_transpose_batchmatmul) — a multi-token step (sparse_mode 3) and a
    one-token decode (sparse_mode 0) against transformers on the whole sequence."""
    attn, rotary, config = attention
    torch.manual_seed(4)
    tokens, n, block_size = 20, config.num_attention_heads, 16
    d, dv, lora, dr = config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank, config.qk_rope_head_dim
    x = torch.randn(tokens + 1, config.hidden_size)
    cos, sin = rope_tables(rotary, tokens + 1)
    kv_cache = torch.zeros(4, block_size, 1, lora, dtype=BF16)
    kr_cache = torch.zeros(4, block_size, 1, dr, dtype=BF16)
    table = torch.tensor([[3, 1]], dtype=torch.int32)                 # the sequence's blocks, shuffled
    slots = torch.tensor([int(table[0, t // block_size]) * block_size + t % block_size for t in range(tokens + 1)])
    w_uv = attn.kv_b_proj.weight.view(n, d + dv, lora)[:, d:].transpose(1, 2).contiguous().to(BF16)   # (N, Hckv, V)

    def step(rows, sparse_mode):
        q_nope, q_rope, *_ = _prolog(attn, config, x[rows], cos[rows], sin[rows], kv_cache, kr_cache, slots[rows])
        k_nope = kv_cache.view(4, 1, lora // 16, block_size, 16)
        k_rope = kr_cache.view(4, 1, dr // 16, block_size, 16)
        out, _ = ops().npu_fused_infer_attention_score_v2(
            q_nope, k_nope, k_nope, query_rope=q_rope, key_rope=k_rope, atten_mask=MASK_2048 if sparse_mode else None,
            actual_seq_kvlen=[rows.stop], actual_seq_qlen=[rows.stop - rows.start], block_table=table,
            num_query_heads=n, num_key_value_heads=1, softmax_scale=attn.scaling, input_layout="TND_NTD",
            sparse_mode=sparse_mode, block_size=block_size)
        assert out.shape == (n, rows.stop - rows.start, lora)
        latent = ops().npu_transpose_batchmatmul(out, w_uv, perm_x1=(0, 1, 2), perm_x2=(0, 1, 2), perm_y=(1, 0, 2))
        with torch.no_grad():
            return attn.o_proj(latent.reshape(-1, n * dv).float())

    want = _hf_attention(attn, rotary, x)
    assert rel(step(slice(0, tokens), 3), want[:tokens]) < 3e-2
    assert rel(step(slice(tokens, tokens + 1), 0), want[tokens:]) < 3e-2


# ---- MoE un-permutation, row-ordered (upstream deepseek_r1's double routing) ----------------------------
def test_moe_finalize_routing_drop_pad_mode_2_reads_the_index_by_row():
    """drop_pad_mode 2 (op-plugin page: non-dropping, expanded_src_to_dst_row "by row"): the page's
    equivalent loop with position i*K + k instead of k*NUM_ROWS + i; the order npu_moe_init_routing_v2
    writes, so init -> identity experts -> finalize gives back sum_k w[i,k] * x[i]."""
    torch.manual_seed(5)
    rows, k, h = 5, 3, 4
    permuted = torch.randn(rows * k, h)
    skip = torch.randn(rows, h)
    scales = torch.rand(rows, k)
    index = torch.randperm(rows * k).to(torch.int32)
    out = ops().npu_moe_finalize_routing(permuted, skip, None, None, scales, index, None, drop_pad_mode=2)
    want = skip.clone()
    for i in range(rows):
        for j in range(k):
            want[i] += scales[i, j] * permuted[int(index[i * k + j])]
    torch.testing.assert_close(out, want)
    column = ops().npu_moe_finalize_routing(permuted, skip, None, None, scales, index, None, drop_pad_mode=0)
    assert not torch.allclose(column, want)               # the two orders differ
    x = torch.randn(rows, h)
    experts = torch.stack([torch.randperm(4)[:k] for _ in range(rows)]).to(torch.int32)
    expanded, row_idx, _, _ = ops().npu_moe_init_routing_v2(x, experts, active_num=rows * k, expert_num=4,
                                                           expert_tokens_num_type=1, expert_tokens_num_flag=True,
                                                           active_expert_range=[0, 4])
    back = ops().npu_moe_finalize_routing(expanded, None, None, None, scales, row_idx, None, drop_pad_mode=2)
    torch.testing.assert_close(back, x * scales.sum(-1, keepdim=True))
