"""Reference kernels of the npu stand-in, each against an independent formulation: transformers' own
implementation where one exists, the op-plugin pages' numpy "equivalent logic" (re-written here in
numpy), or a naive loop. The ops are called through torch.ops.npu (their torch_npu schemas)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from npu_standin import kernels

BF16_RTOL = 2e-2


@pytest.fixture(scope="module", autouse=True)
def registered():
    kernels.install()


def ops():
    return torch.ops.npu


# ---- norms ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(0)
    x = torch.randn(3, 5, 64, dtype=dtype)
    norm = Qwen3RMSNorm(64, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(64).to(dtype)
    y, rstd = ops().npu_rms_norm(x, norm.weight, 1e-6)
    want = norm(x)
    assert y.dtype == dtype and rstd.dtype == torch.float32 and rstd.shape == (3, 5, 1)
    if dtype == torch.float32:
        torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-6)
    else:   # one rounding here, two in transformers (normalised x, then * weight): a bf16 ulp apart
        torch.testing.assert_close(y.float(), want.float(), atol=5e-2, rtol=BF16_RTOL)
    torch.testing.assert_close(rstd, 1 / torch.sqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6))


def test_rms_norm_gamma_over_two_trailing_dims():
    x = torch.randn(2, 3, 4, 8)
    gamma = torch.randn(4, 8)
    y, rstd = ops().npu_rms_norm(x, gamma, 1e-5)
    ms = x.pow(2).mean(dim=(-2, -1), keepdim=True)
    torch.testing.assert_close(y, x / torch.sqrt(ms + 1e-5) * gamma)
    assert rstd.shape == (2, 3, 1, 1)


def test_add_rms_norm_is_residual_add_then_transformers_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(1)
    x1, x2 = torch.randn(2, 7, 32), torch.randn(2, 7, 32)
    norm = LlamaRMSNorm(32, eps=1e-6)
    norm.weight.data = torch.rand(32) + 0.5
    y, rstd, x = ops().npu_add_rms_norm(x1, x2, norm.weight, 1e-6)
    torch.testing.assert_close(x, x1 + x2)
    torch.testing.assert_close(y, norm(x1 + x2), atol=1e-6, rtol=1e-6)
    assert rstd.shape == (2, 7, 1)


def test_add_rms_norm_cast_is_add_rms_norm_and_its_float_copy():
    """aclnnAddRmsNormCast: x = x1 + x2, y2 = RmsNorm(x) * gamma, y1 = float(y2); torch_npu's order (y1, y2, rstd,
    x). Upstream's qwen3_moe feeds y1 (fp32) to its router and y2 (bf16) to the experts."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    torch.manual_seed(2)
    x1, x2 = torch.randn(3, 5, 64).bfloat16(), torch.randn(3, 5, 64).bfloat16()
    norm = Qwen3MoeRMSNorm(64, eps=1e-6).bfloat16()
    norm.weight.data = (torch.rand(64) + 0.5).bfloat16()
    y1, y2, rstd, x = ops().npu_add_rms_norm_cast(x1, x2, norm.weight, 1e-6)
    assert (y1.dtype, y2.dtype, rstd.dtype, x.dtype) == (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16)
    assert torch.equal(x, x1 + x2) and rstd.shape == (3, 5, 1)
    assert torch.equal(y1, y2.float())                                   # the cast of the bf16 result
    same = ops().npu_add_rms_norm(x1, x2, norm.weight, 1e-6)
    assert torch.equal(y2, same[0]) and torch.equal(rstd, same[1])
    torch.testing.assert_close(y2.float(), norm(x1 + x2).float(), atol=5e-2, rtol=BF16_RTOL)


def test_swiglu_matches_transformers_silu_gate():
    from transformers.activations import ACT2FN

    x = torch.randn(4, 6, 16)
    a, b = x.chunk(2, dim=-1)
    torch.testing.assert_close(ops().npu_swiglu(x), ACT2FN["silu"](a) * b)
    y = torch.randn(6, 10, 3)
    a, b = y.chunk(2, dim=1)
    torch.testing.assert_close(ops().npu_swiglu(y, dim=1), torch.nn.functional.silu(a) * b)


def test_geglu_matches_transformers_gelu_tanh_gate():
    """gemma_4's experts: npu_geglu(x, dim=-1, approximate=1, activate_left=True) is transformers'
    gelu_pytorch_tanh(gate) * up on [gate | up]; the default (activate_left False) activates the right half; the
    second output is the activated half; approximate 0 is the erf gelu."""
    from transformers.activations import ACT2FN

    x = torch.randn(4, 6, 16)
    gate, up = x.chunk(2, dim=-1)
    out, gelu = ops().npu_geglu(x, dim=-1, approximate=1, activate_left=True)
    torch.testing.assert_close(out, ACT2FN["gelu_pytorch_tanh"](gate) * up)
    torch.testing.assert_close(gelu, ACT2FN["gelu_pytorch_tanh"](gate))
    right, right_gelu = ops().npu_geglu(x)
    torch.testing.assert_close(right, gate * ACT2FN["gelu_pytorch_tanh"](up))
    assert not torch.allclose(right, out)
    erf, _ = ops().npu_geglu(x, dim=1, approximate=0, activate_left=True)
    a, b = x.chunk(2, dim=1)
    torch.testing.assert_close(erf, torch.nn.functional.gelu(a) * b)
    bf16 = x.bfloat16()
    assert ops().npu_geglu(bf16, activate_left=True)[0].dtype == torch.bfloat16


# ---- rotary -----------------------------------------------------------------------------------
def _hf_cos_sin(seq, dim, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    freqs = torch.outer(torch.arange(seq).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def test_rotary_mul_half_matches_transformers_rope():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q = torch.randn(2, 4, 9, 16)   # BNSD
    cos, sin = _hf_cos_sin(9, 16)
    want, _ = apply_rotary_pos_emb(q, q, cos[None], sin[None])          # unsqueeze_dim=1
    got = ops().npu_rotary_mul(q, cos[None, None], sin[None, None])
    torch.testing.assert_close(got, want)


def test_rotary_mul_interleave_and_rotate_matrix_match_naive():
    x = torch.randn(1, 2, 3, 8)
    r1, r2 = torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8)
    naive = torch.empty_like(x)
    for i in range(0, 8, 2):   # pairs (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])
        naive[..., i] = -x[..., i + 1]
        naive[..., i + 1] = x[..., i]
    torch.testing.assert_close(ops().npu_rotary_mul(x, r1, r2, "interleave"), r1 * x + r2 * naive)
    rotate = torch.zeros(8, 8)
    for i in range(0, 8, 2):
        rotate[i + 1, i] = -1
        rotate[i, i + 1] = 1
    torch.testing.assert_close(ops().npu_rotary_mul(x, r1, r2, "interleave", rotate), r1 * x + r2 * (x @ rotate))


@pytest.mark.parametrize("layout", ["BSND", "BSH", "TND"])
def test_apply_rotary_pos_emb_matches_transformers_bsnd_and_tnd(layout):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    torch.manual_seed(2)
    b, s, n, kv, d = 2, 5, 4, 2, 16
    q = torch.randn(b, s, n, d)
    k = torch.randn(b, s, kv, d)
    cos, sin = _hf_cos_sin(s, d)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos[None].expand(b, s, d),
                                          sin[None].expand(b, s, d))
    want_q, want_k = want_q.transpose(1, 2), want_k.transpose(1, 2)
    if layout == "TND":
        q, k = q.reshape(b * s, n, d).clone(), k.reshape(b * s, kv, d).clone()
        c, sn = cos.repeat(b, 1)[:, None], sin.repeat(b, 1)[:, None]
        want_q, want_k = want_q.reshape(b * s, n, d), want_k.reshape(b * s, kv, d)
    else:
        c, sn = cos[None, :, None].expand(b, s, 1, d), sin[None, :, None].expand(b, s, 1, d)
    entry = kernels.op_callable("npu_apply_rotary_pos_emb")
    got_q, got_k = entry(q, k, c, sn, layout=layout)
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()   # in place, as documented
    torch.testing.assert_close(q, want_q)


def test_apply_rotary_pos_emb_refuses_undocumented_mode_in_one_line(capsys):
    from npu_standin.errors import UnsupportedOp

    q = torch.randn(2, 1, 2, 8)
    with pytest.raises(UnsupportedOp) as info:
        ops().npu_apply_rotary_pos_emb(q, q.clone(), torch.ones(2, 1, 1, 8), torch.zeros(2, 1, 1, 8),
                                       "BSND", "quarter")
    message = str(info.value)
    assert "\n" not in message and "npu_apply_rotary_pos_emb" in message and "rotary_mode='quarter'" in message
    assert "test_reference_kernels.py:" in message     # where it was called


def test_interleave_rope_matches_naive_loop():
    x = torch.randn(1, 2, 3, 8)
    cos, sin = torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8)
    q = torch.empty_like(x)
    for i in range(4):                       # even positions first, then odd
        q[..., i] = x[..., 2 * i]
        q[..., 4 + i] = x[..., 2 * i + 1]
    rot = torch.cat((-q[..., 4:], q[..., :4]), dim=-1)
    torch.testing.assert_close(ops().npu_interleave_rope(x, cos, sin), q * cos + rot * sin)


# ---- cache updates ------------------------------------------------------------------------------
def test_scatter_nd_update_matches_naive_loop():
    cache = torch.randn(10, 2, 4)
    slots = torch.tensor([[7], [2], [5]], dtype=torch.int32)
    new = torch.randn(3, 2, 4)
    want = cache.clone()
    for row, slot in enumerate(slots[:, 0].tolist()):
        want[slot] = new[row]
    copy = ops().npu_scatter_nd_update(cache, slots, new)
    torch.testing.assert_close(copy, want)
    assert not torch.equal(cache, want)                       # the out-of-place one left its input alone
    out = kernels.op_callable("npu_scatter_nd_update_")(cache, slots, new)
    assert out is cache
    torch.testing.assert_close(cache, want)
    # two index dims: (row, col) pairs pick rows of the last axis
    grid = torch.zeros(3, 4, 5)
    idx = torch.tensor([[0, 1], [2, 3]])
    ops().npu_scatter_nd_update_(grid, idx, torch.ones(2, 5))
    assert grid[0, 1].sum() == 5 and grid[2, 3].sum() == 5 and grid.sum() == 10


def test_scatter_update_writes_each_batch_at_its_offset():
    cache = torch.zeros(2, 3, 6, 4)                 # (B, N, S, D), axis -2
    new = torch.randn(2, 3, 1, 4)
    offsets = torch.tensor([4, 1])
    kernels.op_callable("scatter_update_")(cache, offsets, new, -2)
    for b, offset in enumerate(offsets.tolist()):
        torch.testing.assert_close(cache[b, :, offset], new[b, :, 0])
    assert cache.abs().sum() == new.abs().sum()


def test_format_cast_keeps_values_and_reports_format():
    from npu_standin.kernels.misc import get_npu_format

    w = torch.randn(8, 4)
    nz = ops().npu_format_cast(w, 29)
    torch.testing.assert_close(nz, w)
    assert get_npu_format(nz) == 29 and get_npu_format(w) == 2


def test_prefetch_changes_nothing():
    w = torch.randn(4, 4)
    before = w.clone()
    assert ops().npu_prefetch(w, None, 1024) is None
    torch.testing.assert_close(w, before)


def test_transpose_batchmatmul_matches_permute_bmm():
    x = torch.randn(5, 3, 8)        # (M, B, K) with perm_x1 [1, 0, 2]
    w = torch.randn(3, 8, 6)        # (B, K, N)
    got = ops().npu_transpose_batchmatmul(x, w, perm_x1=[1, 0, 2], perm_y=[1, 0, 2])
    want = torch.bmm(x.permute(1, 0, 2), w).permute(1, 0, 2)
    assert got.shape == (5, 3, 6)
    torch.testing.assert_close(got, want)


# ---- MoE ---------------------------------------------------------------------------------------
def test_moe_gating_top_k_softmax_matches_per_row_sort():
    torch.manual_seed(3)
    logits = torch.randn(6, 8)
    y, idx, row_idx = ops().npu_moe_gating_top_k_softmax(logits, None, k=3)
    for r in range(6):
        probs = [float(v) for v in torch.softmax(logits[r], -1)]
        order = sorted(range(8), key=lambda e: -probs[e])[:3]
        assert idx[r].tolist() == order
        torch.testing.assert_close(y[r], torch.tensor([probs[e] for e in order]))
    assert row_idx.tolist() == [[j * 6 + i for j in range(3)] for i in range(6)]
    assert idx.dtype == row_idx.dtype == torch.int32


def test_moe_gating_top_k_matches_deepseek_v3_router():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    torch.manual_seed(4)
    router.weight.data = torch.randn(16, 16)
    router.e_score_correction_bias.data = torch.randn(16) * 0.1
    x = torch.randn(5, 16)
    logits, want_w, want_idx = router(x)
    y, idx, normed = ops().npu_moe_gating_top_k(logits, 4, bias=router.e_score_correction_bias, k_group=2,
                                                group_count=4, group_select_mode=1, norm_type=1,
                                                routed_scaling_factor=2.5)
    for r in range(5):   # transformers returns the top-k unsorted: compare as sets
        assert sorted(idx[r].tolist()) == sorted(want_idx[r].tolist())
        mapping = dict(zip(want_idx[r].tolist(), want_w[r].tolist()))
        torch.testing.assert_close(y[r], torch.tensor([mapping[e] for e in idx[r].tolist()]))
    torch.testing.assert_close(normed, logits.sigmoid())


def _numpy_init_routing(x, row_idx, expert_idx, active_num):
    """op-plugin docs, torch_npu-npu_moe_init_routing.md, 等价计算逻辑 (cpu_op_exec)."""
    num_rows, k = x.shape[0], expert_idx.shape[-1]
    sort_expert_for_source_row = np.argsort(expert_idx.reshape((-1,)), axis=-1, kind="stable")
    expanded_expert_idx = np.sort(expert_idx.reshape((-1,)), axis=-1)
    expanded_dst_to_src_row = np.take_along_axis(row_idx.reshape((-1,)), sort_expert_for_source_row, axis=-1)
    expanded_row_idx = np.zeros(expanded_dst_to_src_row.shape).astype(np.int32)
    expanded_row_idx[expanded_dst_to_src_row] = np.arange(expanded_dst_to_src_row.shape[-1])
    active = min(active_num, num_rows) * k
    expanded_x = x[expanded_dst_to_src_row[:active] % num_rows, :]
    return expanded_x, expanded_row_idx, expanded_expert_idx


def test_moe_init_routing_matches_op_plugin_numpy_logic():
    rng = np.random.default_rng(5)
    n, h, k = 10, 6, 2
    x = rng.uniform(-1, 1, size=(n, h)).astype(np.float32)
    row_idx = np.arange(n * k).reshape([k, n]).transpose(1, 0).astype(np.int32)
    expert_idx = rng.integers(0, 5, size=(n, k)).astype(np.int32)
    want = _numpy_init_routing(x, row_idx, expert_idx, n)
    got = ops().npu_moe_init_routing(torch.from_numpy(x), torch.from_numpy(row_idx), torch.from_numpy(expert_idx), n)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w)


def test_moe_compute_expert_tokens_is_cumulative_count():
    sorted_experts = torch.tensor([0, 0, 0, 1, 1, 3, 3, 3], dtype=torch.int32)
    got = ops().npu_moe_compute_expert_tokens(sorted_experts, 5)
    assert got.tolist() == np.cumsum(np.bincount(sorted_experts.numpy(), minlength=5)).tolist() == [3, 5, 5, 8, 8]


def _numpy_init_routing_v2(x, expert_idx, expert_range, row_idx_type, expert_tokens_num_type, active_num=-1):
    """op-plugin docs, torch_npu-npu_moe_init_routing_v2.md, cpu_op_exec (quant_mode -1, drop_pad_mode 0)."""
    expert_start, expert_end = expert_range
    num_rows, k = x.shape[0], expert_idx.shape[-1]
    expert_idx_in = expert_idx.copy().reshape(-1)
    actual_expert_total_num = np.sum((expert_idx >= expert_start) & (expert_idx < expert_end))
    expert_idx_in[(expert_idx_in < expert_start)] = np.int32(np.iinfo(np.int32).max)
    sorted_expert_indices = np.argsort(expert_idx_in, axis=-1, kind="stable")
    sorted_expert_idx = expert_idx_in[sorted_expert_indices]
    if row_idx_type == 1:
        expanded_row_idx = sorted_expert_indices.astype(np.int32)
    else:
        expanded_row_idx = np.ones(num_rows * k).astype(np.int32) * -1
        expanded_row_idx[sorted_expert_indices[:actual_expert_total_num]] = np.arange(actual_expert_total_num)
    counts = np.bincount(sorted_expert_idx[:actual_expert_total_num] - expert_start)
    counts = np.concatenate([counts, np.zeros((expert_end - expert_start) - len(counts)).astype(np.int64)])
    tokens = np.cumsum(counts) if expert_tokens_num_type == 0 else counts
    active = actual_expert_total_num if active_num in (0, -1) else min(active_num, actual_expert_total_num)
    return x[sorted_expert_indices[:active] // k, :], expanded_row_idx, tokens.astype(np.int64)


@pytest.mark.parametrize("row_idx_type,tokens_type,expert_range", [(0, 1, [0, 8]), (1, 0, [2, 6]), (0, 0, [0, 8])])
def test_moe_init_routing_v2_matches_op_plugin_numpy_logic(row_idx_type, tokens_type, expert_range):
    rng = np.random.default_rng(6)
    n, h, k = 9, 4, 3
    x = rng.uniform(-1, 1, size=(n, h)).astype(np.float32)
    expert_idx = rng.integers(0, 8, size=(n, k)).astype(np.int32)
    want = _numpy_init_routing_v2(x, expert_idx, expert_range, row_idx_type, tokens_type)
    got = ops().npu_moe_init_routing_v2(torch.from_numpy(x), torch.from_numpy(expert_idx),
                                        active_expert_range=expert_range, row_idx_type=row_idx_type,
                                        expert_tokens_num_type=tokens_type, expert_tokens_num_flag=True)
    np.testing.assert_array_equal(got[0].numpy(), want[0])
    np.testing.assert_array_equal(got[1].numpy(), want[1])
    np.testing.assert_array_equal(got[2].numpy(), want[2])


def test_grouped_matmul_matches_per_expert_loop():
    torch.manual_seed(7)
    x = torch.randn(7, 5)
    w = torch.randn(3, 5, 4)
    b = torch.randn(3, 4)
    sizes = [2, 0, 5]
    ends = torch.tensor(np.cumsum(sizes))
    got = ops().npu_grouped_matmul([x], [w], bias=[b], group_list=ends, split_item=3, group_type=0)
    want, start = [], 0
    for e, size in enumerate(sizes):
        want.append(x[start:start + size] @ w[e] + b[e])
        start += size
    torch.testing.assert_close(got[0], torch.cat(want))
    counts = ops().npu_grouped_matmul([x], [w], bias=[b], group_list=torch.tensor(sizes), split_item=3,
                                      group_type=0, group_list_type=1)
    torch.testing.assert_close(counts[0], got[0])
    separate = ops().npu_grouped_matmul([x[:2], x[2:]], [w[0], w[2]], split_item=0)   # multi-multi-multi
    torch.testing.assert_close(separate[1], x[2:] @ w[2])


def test_grouped_matmul_refuses_quantized_paths_without_reference_in_one_line():
    """int8 x int8 has a reference (kernels/quant.py, tests/unit/npu_standin/kernels/test_quant.py); a
    scale on float inputs (weight-only / int4 schemes) and antiquant arguments do not."""
    from npu_standin.errors import UnsupportedOp

    with pytest.raises(UnsupportedOp, match=r"npu_grouped_matmul with x / weight dtypes float32 "
                                            r"\(int4 or weight-only quantization\)"):
        ops().npu_grouped_matmul([torch.randn(2, 4)], [torch.randn(1, 4, 4)], scale=[torch.ones(4)],
                                 group_list=torch.tensor([2]), split_item=3, group_type=0)
    with pytest.raises(UnsupportedOp, match=r"npu_grouped_matmul with antiquant_scale, antiquant_offset"):
        ops().npu_grouped_matmul([torch.randn(2, 4)], [torch.randn(1, 4, 4)], antiquant_scale=[torch.ones(4)],
                                 antiquant_offset=[torch.ones(4)], group_list=torch.tensor([2]), split_item=3)


def test_grouped_matmul_refuses_mixed_float_dtypes_as_aclnn_does():
    """aclnnGroupedMatmul's unquantized path needs x's dtype == weight's (ops-transformer
    aclnn_grouped_matmul.cpp, CheckFunctionParams): no promotion, unlike torch.matmul on the NPU."""
    x, w = torch.randn(4, 8).bfloat16(), torch.randn(2, 8, 3)
    with pytest.raises(RuntimeError, match="x dtype DT_BF16 and weight dtype DT_FLOAT is not supported"):
        ops().npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 4]), split_item=3, group_type=0)
    y = ops().npu_grouped_matmul([x], [w.bfloat16()], group_list=torch.tensor([1, 4]), split_item=3, group_type=0)
    assert y[0].dtype == torch.bfloat16                        # the output takes x's dtype (op-plugin)


def test_moe_routing_chain_matches_transformers_gpt_oss_experts():
    """gpt-oss's path in upstream's modeling: gating softmax top-k -> init_routing -> expert tokens ->
    grouped matmuls -> finalize_routing, against transformers' GptOssMLP on the same weights."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(8)
    mlp = GptOssMLP(config).eval()
    for p in mlp.parameters():
        p.data = torch.randn_like(p) * 0.3
    x = torch.randn(6, 16)
    want = mlp(x[None])[0][0]
    experts = mlp.experts
    logits = torch.nn.functional.linear(x, mlp.router.weight, mlp.router.bias)
    w, idx, row_idx = ops().npu_moe_gating_top_k_softmax(logits, None, k=2)
    w = w / w.sum(-1, keepdim=True)
    ex, ex_row, ex_expert = ops().npu_moe_init_routing(x, row_idx, idx, 6)
    tokens = ops().npu_moe_compute_expert_tokens(ex_expert, 4).long()
    gate_up = ops().npu_grouped_matmul([ex], [experts.gate_up_proj], bias=[experts.gate_up_proj_bias],
                                       group_list=tokens, split_item=3, group_type=0)[0]
    gate, up = gate_up[..., ::2].clamp(max=experts.limit), gate_up[..., 1::2].clamp(-experts.limit, experts.limit)
    act = (up + 1) * (gate * torch.sigmoid(gate * experts.alpha))
    down = ops().npu_grouped_matmul([act], [experts.down_proj], bias=[experts.down_proj_bias], group_list=tokens,
                                    split_item=3, group_type=0)[0]
    got = ops().npu_moe_finalize_routing(down, None, None, None, w, ex_row, idx)
    torch.testing.assert_close(got, want.reshape(6, 16), atol=1e-5, rtol=1e-5)


def test_moe_re_routing_regroups_by_expert():
    counts = torch.tensor([[1, 2], [3, 0], [1, 1]])        # [rank, expert]
    tokens = torch.arange(8).float()[:, None].repeat(1, 2)
    out, _, idx, per_expert = ops().npu_moe_re_routing(tokens, counts)
    # rows arrive as rank0: e0 x1, e1 x2 | rank1: e0 x3 | rank2: e0 x1, e1 x1
    want = [0, 3, 4, 5, 6, 1, 2, 7]
    assert idx.tolist() == want and out[:, 0].tolist() == [float(v) for v in want]
    assert per_expert.tolist() == [5, 3]


# ---- the table and the one-line refusals -------------------------------------------------------
def test_every_reference_names_its_formulation_and_an_existing_test():
    import inspect
    import sys
    from pathlib import Path

    rows = kernels.table()
    assert len({r["op"].split("torchair.ops.")[-1] for r in rows}) >= 20
    from locations import REPO_ROOT

    for row in rows:
        path, _, name = row["test"].partition("::")
        module_file = REPO_ROOT / path
        assert module_file.is_file(), row
        assert f"def {name}(" in module_file.read_text(), row
        assert row["reference"]


def test_an_op_without_reference_fails_with_one_line_naming_it_and_the_call_site():
    from npu_standin.errors import UnsupportedOp

    with pytest.raises(UnsupportedOp) as info:
        torch.ops.npu.npu_weight_quant_batchmatmul(torch.randn(2, 2))
    text = str(info.value)
    assert "\n" not in text and "torch.ops.npu.npu_weight_quant_batchmatmul" in text and "test_reference_kernels.py:" in text


def test_schemas_are_the_torch_npu_wheels():
    """Each reference is declared with the schema torch-npu 2.13.0 declares (its codegen YAML), except
    the documented in-place npu_apply_rotary_pos_emb, whose capturable twin says what it writes."""
    from npu_wheel import torch_npu_wheel

    folder, why = torch_npu_wheel()
    if folder is None:
        pytest.skip(why)
    declared = {}
    for name in ("npu_native_functions_by_codegen.yaml", "npu_native_functions.yaml"):
        path = folder / "torch_npu" / "csrc" / "aten" / name
        for line in path.read_text().splitlines():
            line = line.strip()
            if line.startswith(("- func:", "func:")):
                schema = line.split("func:", 1)[1].strip()
                declared.setdefault(schema.split("(", 1)[0], schema)
    checked = 0
    for key, ref in kernels.REFERENCES.items():
        if ref.namespace != "npu":
            continue
        assert declared.get(ref.name) == ref.schema, ref.name
        checked += 1
    assert checked >= 20


# ---- torch.matmul / mm of mixed dtypes: the NPU promotes (kernels/matmul.py, mixed_matmul_dtypes) ----
def test_mixed_dtype_matmul_computes_in_fp32_and_returns_the_first_inputs_dtype():
    """op-plugin's matmul allocates its output as `self.options()` and aclnnMatmul casts both inputs to
    the promoted FP32 (ops-nn Dav2201MatMulRule): bf16 x fp32 -> fp32 product, bf16 result. The host's
    own matmul refuses the pair ("same dtype"), which is not what the NPU does."""
    from npu_standin.kernels.matmul import _npu_dtype_rule, mixed_matmul_dtypes
    from npu_standin.patches import PATCHED

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    host_matmul = PATCHED["torch.matmul"].real if "torch.matmul" in PATCHED else torch.matmul
    rules = {(bf16, fp32): (fp32, bf16), (fp32, bf16): (fp32, fp32), (fp16, fp32): (fp32, fp16),
             (fp16, bf16): (fp32, fp16), (bf16, bf16): None, (fp32, fp32): None, (torch.int32, fp32): None}
    for (a, b), want in rules.items():
        assert mixed_matmul_dtypes(torch.zeros(1, dtype=a), torch.zeros(1, dtype=b)) == want, (a, b)
    torch.manual_seed(3)
    x, w = torch.randn(5, 64).to(bf16), torch.randn(64, 8)       # qwen3_moe's router: bf16 x fp32 gate
    with pytest.raises(RuntimeError, match="same dtype"):
        host_matmul(x, w)
    matmul = _npu_dtype_rule("matmul", host_matmul)
    y = matmul(x, w)
    assert y.dtype == bf16 and torch.equal(y, host_matmul(x.float(), w).to(bf16))
    assert matmul(w.T, x.T).dtype == fp32                        # fp32 first: an fp32 result
    x3 = x.view(1, 5, 64).expand(2, 5, 64)
    assert torch.equal(matmul(x3, w), host_matmul(x3.float(), w).to(bf16))          # batched x 2-D
    assert matmul(x[0], w[:, 0]).dtype == bf16 and matmul(x[0], w[:, 0]).dim() == 0  # dot
    out = torch.empty(5, 8, dtype=bf16)
    assert matmul(x, w, out=out) is out and torch.equal(out, y)
    same = torch.randn(5, 64)
    assert torch.equal(matmul(same, w), host_matmul(same, w))    # equal dtypes: torch's own call


def test_mixed_dtype_bmm_addmm_and_linear_follow_op_plugins_kernels():
    """bmm: op-plugin allocates `self.options()`, aclnnBatchMatMul promotes as aclnnMatmul (first input's
    dtype back). addmm: the output takes the ADDED term's dtype (`self.options()`, aclnnAddmm). F.linear
    is aten's composite: addmm with a bias on a 2-D / contiguous input (the bias's dtype), else matmul
    then add_ (the input's dtype). The host's own kernels refuse every one of these pairs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from npu_standin.kernels.matmul import _npu_addmm_rule, _npu_dtype_rule, mixed_addmm_dtypes, npu_linear_rule

    bf16, fp32 = torch.bfloat16, torch.float32
    torch.manual_seed(4)
    x, w, b = torch.randn(5, 64).to(bf16), torch.randn(8, 64), torch.randn(8)
    for host, args in ((torch.bmm, (x[None], w.T[None])), (torch.addmm, (b, x, w.T)),
                       (torch.nn.functional.linear, (x, w, b)), (torch.nn.functional.linear, (x, w))):
        with pytest.raises(RuntimeError):
            host(*args)
    bmm = _npu_dtype_rule("bmm", torch.bmm)
    y = bmm(x[None].expand(3, 5, 64), w.T[None].expand(3, 64, 8))
    assert y.dtype == bf16 and torch.equal(y[1], (x.float() @ w.T).to(bf16))
    assert bmm(w[None], x.T[None]).dtype == fp32

    assert mixed_addmm_dtypes(b, x, w.T) == (fp32, fp32)
    assert mixed_addmm_dtypes(b.to(bf16), x, w.T.to(bf16)) is None
    assert mixed_addmm_dtypes(b.to(bf16), x, w.T) == (fp32, bf16)
    addmm = _npu_addmm_rule(torch.addmm)
    y = addmm(b, x, w.T, beta=0.5, alpha=2.0)
    assert y.dtype == fp32 and torch.allclose(y, 0.5 * b + 2.0 * (x.float() @ w.T))
    assert addmm(b.to(bf16), x, w.T).dtype == bf16

    npu_linear = npu_linear_rule(torch.nn.functional.linear)
    strided = torch.randn(5, 2, 64).to(bf16).transpose(0, 1)          # a non-contiguous 3-D input
    for inp, bias, dtype in ((x, b, fp32), (x, None, bf16), (x.view(1, 5, 64), b, fp32),
                             (strided, b, bf16), (strided, b.to(bf16), bf16)):
        y = npu_linear(inp, w, bias)
        assert y.dtype == dtype and y.shape == (*inp.shape[:-1], 8), (inp.shape, bias is None, y.dtype)
        ref = inp.float() @ w.T + (bias.float() if bias is not None else 0)
        torch.testing.assert_close(y.float(), ref, atol=0.1, rtol=0.02)
    same = torch.randn(5, 64)
    assert torch.equal(npu_linear(same, w, b), torch.nn.functional.linear(same, w, b))

    class Calls(TorchDispatchMode):      # aten's composite linear on this torch: which kernel each case meets
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    f = torch.randn(5, 64)
    for inp, bias, kernel in ((f, b, "addmm"), (f.view(1, 5, 64), b, "addmm"), (f, None, "mm"),
                              (torch.randn(5, 2, 64).transpose(0, 1), b, "bmm")):
        mode = Calls()
        mode.seen = []
        with mode:
            torch.nn.functional.linear(inp, w, bias)
        assert kernel in mode.seen and ("addmm" in mode.seen) == (kernel == "addmm"), mode.seen
