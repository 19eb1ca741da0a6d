"""The W8A8 int8 reference kernels (npu_standin/kernels/quant.py), each against the documented formula
written independently here in numpy, the NPU's refusals of inputs it does not take, and upstream's
chains of them (module/quantization/compressed_tensors: a W8A8 linear, the fused MLP, the MoE experts)
against the float computation they stand for. Called through torch.ops.npu (their torch_npu schemas)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from npu_standin import kernels
from npu_standin.errors import UnsupportedOp


@pytest.fixture(scope="module", autouse=True)
def registered():
    kernels.install()


def ops():
    return torch.ops.npu


def np_quantize_rows(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The documented dynamic quantization: scale = rowMax(|v|) / 127, y = round(v / scale) (half to even)."""
    v = v.astype(np.float32)
    scale = np.abs(v).max(axis=-1) / np.float32(127.0)
    y = np.rint(v * (np.float32(1.0) / scale[..., None])).astype(np.int8)
    return y, scale.astype(np.float32)


# ---- npu_dynamic_quant --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dynamic_quant_matches_documented_formula(dtype):
    torch.manual_seed(0)
    x = (torch.randn(2, 5, 64) * 3).to(dtype)
    y, scale = ops().npu_dynamic_quant(x)
    want_y, want_scale = np_quantize_rows(x.float().numpy())
    assert y.dtype == torch.int8 and scale.dtype == torch.float32
    assert y.shape == x.shape and scale.shape == (2, 5)
    np.testing.assert_array_equal(y.numpy(), want_y)
    np.testing.assert_allclose(scale.numpy(), want_scale, rtol=0, atol=0)
    # every row uses the full int8 range at its largest magnitude, and dequantizes back within a step
    assert int(y.abs().amax(-1).min()) == 127
    assert ((y.float() * scale[..., None]) - x.float()).abs().le(scale[..., None] / 2 + 1e-6).all()

    smooth = (torch.rand(64) + 0.5).to(dtype)
    ys, ss = ops().npu_dynamic_quant(x, smooth_scales=smooth)
    want_y, want_scale = np_quantize_rows(x.float().numpy() * smooth.float().numpy())
    np.testing.assert_array_equal(ys.numpy(), want_y)
    np.testing.assert_allclose(ss.numpy(), want_scale, rtol=1e-7)


def test_dynamic_quant_group_index_applies_each_groups_smooth_row():
    """MoE: smooth_scales[i] acts on x[group_index[i-1]:group_index[i]] (cumulative ends)."""
    torch.manual_seed(1)
    x = torch.randn(7, 32).bfloat16()
    smooth = (torch.rand(3, 32) + 0.5).bfloat16()
    ends = torch.tensor([2, 2, 7], dtype=torch.int32)
    y, scale = ops().npu_dynamic_quant(x, smooth_scales=smooth, group_index=ends)
    rows = x.float().numpy().copy()
    for g, (a, b) in enumerate([(0, 2), (2, 2), (2, 7)]):
        rows[a:b] *= smooth[g].float().numpy()
    want_y, want_scale = np_quantize_rows(rows)
    np.testing.assert_array_equal(y.numpy(), want_y)
    np.testing.assert_allclose(scale.numpy(), want_scale, rtol=1e-7)


def test_dynamic_quant_rounds_half_to_even_and_keeps_zero_rows_zero():
    # 127 * (2.5 / 127): v / scale lands on x.5 exactly where the row max is a power-of-two multiple
    x = torch.tensor([[254.0, 1.0, 3.0, -5.0], [0.0, 0.0, 0.0, 0.0]]).bfloat16()
    y, scale = ops().npu_dynamic_quant(x)
    assert y[0].tolist() == [127, 0, 2, -2]          # 0.5 -> 0, 1.5 -> 2, -2.5 -> -2
    assert y[1].tolist() == [0, 0, 0, 0] and scale[1].item() == 0.0


def test_dynamic_quant_refuses_what_the_npu_refuses():
    with pytest.raises(RuntimeError, match=r"aclnnDynamicQuant \(npu stand-in\): x dtype float32 is not supported"):
        ops().npu_dynamic_quant(torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="dtypes of x and smooth_scales are not equal"):
        ops().npu_dynamic_quant(torch.randn(2, 8).bfloat16(), smooth_scales=torch.ones(8))
    with pytest.raises(RuntimeError, match="should be greater than 1"):
        ops().npu_dynamic_quant(torch.randn(8).bfloat16())
    with pytest.raises(UnsupportedOp, match="npu_dynamic_quant with dst_type=quint4x2"):
        ops().npu_dynamic_quant(torch.randn(2, 8).bfloat16(), dst_type=torch.quint4x2)


# ---- npu_quant_matmul ---------------------------------------------------------------------------
def _int8(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, shape, dtype=torch.int8, generator=g)


def test_quant_matmul_matches_documented_formulas():
    """op-plugin torch_npu-npu_quant_matmul.md: x1@x2 * scale * pertoken_scale (+ a float bias after),
    (x1@x2 + int32 bias) * scale ...; the accumulation exact in int32."""
    m, k, n = 5, 96, 12
    x1, x2 = _int8(m, k, seed=1), _int8(k, n, seed=2)
    acc = x1.numpy().astype(np.int64) @ x2.numpy().astype(np.int64)
    scale = torch.rand(n) * 0.01 + 1e-3
    pertoken = torch.rand(m) * 0.02 + 1e-3
    y = ops().npu_quant_matmul(x1, x2, scale, pertoken_scale=pertoken, output_dtype=torch.bfloat16)
    want = acc.astype(np.float32) * scale.numpy() * pertoken.numpy()[:, None]
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    np.testing.assert_array_equal(y.float().numpy(), torch.from_numpy(want).bfloat16().float().numpy())

    # per-tensor scale (one value) vs per-channel; a bf16 scale is read as fp32
    one = torch.tensor([0.004])
    np.testing.assert_allclose(ops().npu_quant_matmul(x1, x2, one, pertoken_scale=pertoken, output_dtype=torch.float16)
                               .float().numpy(), (acc * 0.004 * pertoken.numpy()[:, None]).astype(np.float16), rtol=1e-3)
    bf16_scale = scale.bfloat16()
    yb = ops().npu_quant_matmul(x1, x2, bf16_scale, output_dtype=torch.bfloat16)
    np.testing.assert_array_equal(yb.float().numpy(), torch.from_numpy(
        acc.astype(np.float32) * bf16_scale.float().numpy()).bfloat16().float().numpy())

    # bias: int32 is added to the accumulator before the scale, a float bias after it
    bias_i = torch.randint(-1000, 1000, (n,), dtype=torch.int32)
    yi = ops().npu_quant_matmul(x1, x2, scale, pertoken_scale=pertoken, bias=bias_i, output_dtype=torch.bfloat16)
    want_i = (acc + bias_i.numpy()).astype(np.float32) * scale.numpy() * pertoken.numpy()[:, None]
    np.testing.assert_array_equal(yi.float().numpy(), torch.from_numpy(want_i).bfloat16().float().numpy())
    bias_f = torch.randn(n).bfloat16()
    yf = ops().npu_quant_matmul(x1, x2, scale, pertoken_scale=pertoken, bias=bias_f, output_dtype=torch.bfloat16)
    want_f = acc.astype(np.float32) * scale.numpy() * pertoken.numpy()[:, None] + bias_f.float().numpy()
    np.testing.assert_array_equal(yf.float().numpy(), torch.from_numpy(want_f).bfloat16().float().numpy())
    assert not torch.equal(yi, yf)


def test_quant_matmul_int32_output_is_the_accumulator():
    """The int32 output (models/qwen's fused MLP feeds it to npu_dequant_swiglu_quant, which applies the
    weight scale): x1@x2 (+ int32 bias), exact beyond fp32's 24 bits, the scale not applied."""
    k = 4096
    x1 = torch.full((2, k), 127, dtype=torch.int8)
    x2 = torch.full((k, 3), -127, dtype=torch.int8)
    x2[0, 0] = -126                                         # one off: the sum differs from a float32 rounding
    y = ops().npu_quant_matmul(x1, x2, torch.full((3,), 0.5), output_dtype=torch.int32)
    assert y.dtype == torch.int32
    assert y[0, 0].item() == -127 * 127 * k + 127 and y[0, 1].item() == -127 * 127 * k
    bias = torch.tensor([1, 2, 3], dtype=torch.int32)
    yb = ops().npu_quant_matmul(x1, x2, torch.full((3,), 0.5), bias=bias, output_dtype=torch.int32)
    assert (yb - y)[0].tolist() == [1, 2, 3]


def test_quant_matmul_takes_upstreams_transposed_weight_and_batches():
    """process_weights_after_loading transposes the [n, k] int8 weight to a [k, n] view (not contiguous)."""
    w = _int8(8, 32, seed=3)                                # [n, k] as loaded
    x = _int8(4, 32, seed=4)
    scale = torch.rand(8)
    got = ops().npu_quant_matmul(x, w.t(), scale, pertoken_scale=torch.ones(4), output_dtype=torch.bfloat16)
    want = (x.float() @ w.float().t()) * scale
    torch.testing.assert_close(got.float(), want.bfloat16().float())
    xb = _int8(3, 4, 32, seed=5)
    batched = ops().npu_quant_matmul(xb, w.t(), scale, output_dtype=torch.bfloat16)
    assert batched.shape == (3, 4, 8)
    torch.testing.assert_close(batched[1].float(), ((xb[1].float() @ w.float().t()) * scale).bfloat16().float())


def test_quant_matmul_refuses_what_the_npu_refuses():
    x1, x2 = _int8(2, 16), _int8(16, 4)
    with pytest.raises(RuntimeError, match="When out dtype is INT32, bias dtype should be INT32"):
        ops().npu_quant_matmul(x1, x2, torch.ones(4), bias=torch.ones(4).bfloat16(), output_dtype=torch.int32)
    with pytest.raises(RuntimeError, match="x1 k dim and x2 k dim should be same"):
        ops().npu_quant_matmul(x1, _int8(8, 4), torch.ones(4), output_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="Input x1 and x2 dtype should be INT8"):
        ops().npu_quant_matmul(x1.float(), x2, torch.ones(4), output_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="scale must be 1-D of 1 or n=4"):
        ops().npu_quant_matmul(x1, x2, torch.ones(4, 1), output_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="out dtype is FLOAT16, scale dtype should be FLOAT"):
        ops().npu_quant_matmul(x1, x2, torch.ones(4).bfloat16(), pertoken_scale=torch.ones(2),
                               output_dtype=torch.float16)
    with pytest.raises(UnsupportedOp, match="npu_quant_matmul with output_dtype int8 without pertoken_scale"):
        ops().npu_quant_matmul(x1, x2, torch.ones(4))
    with pytest.raises(UnsupportedOp, match="int64 scale"):
        ops().npu_quant_matmul(x1, x2, torch.ones(4, dtype=torch.int64), output_dtype=torch.bfloat16)


# ---- npu_dequant_swiglu_quant -------------------------------------------------------------------
def np_dequant_swiglu_quant(acc, weight_scale, act_scale, quant_scale, activate_left):
    v = acc.astype(np.float32) * weight_scale.astype(np.float32) * act_scale.astype(np.float32)[:, None]
    h = v.shape[-1] // 2
    a, b = (v[:, :h], v[:, h:]) if activate_left else (v[:, h:], v[:, :h])
    s = a / (np.float32(1) + np.exp(-a)) * b
    if quant_scale is not None:
        s = s * quant_scale.astype(np.float32)
    return np_quantize_rows(s)


@pytest.mark.parametrize("activate_left", [True, False])
def test_dequant_swiglu_quant_matches_documented_chain(activate_left):
    """The op-plugin doc: dequantize (weight_scale, per-token activation_scale), SwiGLU (activate_left:
    swish on the first half), times the smooth quant_scale, dynamic per-token int8."""
    torch.manual_seed(2)
    t, h = 6, 32
    acc = torch.randint(-20000, 20000, (t, 2 * h), dtype=torch.int32)
    w_scale = torch.rand(2 * h) * 1e-3
    a_scale = torch.rand(t) * 1e-2
    q_scale = torch.rand(h) + 0.5
    # upstream passes gate_up_proj.weight_scale as loaded, [2H, 1]: the NPU reads its 2H values
    y, scale = ops().npu_dequant_swiglu_quant(acc, weight_scale=w_scale.reshape(-1, 1), activation_scale=a_scale,
                                              quant_scale=q_scale, activate_left=activate_left, quant_mode=1)
    want_y, want_scale = np_dequant_swiglu_quant(acc.numpy(), w_scale.numpy(), a_scale.numpy(), q_scale.numpy(),
                                                 activate_left)
    assert y.shape == (t, h) and y.dtype == torch.int8 and scale.shape == (t,)
    assert np.abs(y.numpy().astype(int) - want_y.astype(int)).max() <= 1       # exp's last bit may move a .5 tie
    np.testing.assert_allclose(scale.numpy(), want_scale, rtol=1e-5)


def test_dequant_swiglu_quant_group_index_picks_each_groups_scales():
    torch.manual_seed(3)
    h, counts = 32, [3, 0, 2]
    t = 6                                            # one row past the groups: left undefined by the NPU
    acc = torch.randint(-5000, 5000, (t, 2 * h), dtype=torch.int32)
    w_scale = torch.rand(3, 2 * h) * 1e-3
    q_scale = torch.rand(3, h) + 0.5
    a_scale = torch.rand(t) * 1e-2
    y, scale = ops().npu_dequant_swiglu_quant(acc, weight_scale=w_scale, activation_scale=a_scale,
                                              quant_scale=q_scale, group_index=torch.tensor(counts),
                                              activate_left=True, quant_mode=1)
    start = 0
    for g, c in enumerate(counts):
        if c:
            wy, ws = np_dequant_swiglu_quant(acc[start:start + c].numpy(), w_scale[g].numpy(),
                                             a_scale[start:start + c].numpy(), q_scale[g].numpy(), True)
            assert np.abs(y[start:start + c].numpy().astype(int) - wy.astype(int)).max() <= 1
            np.testing.assert_allclose(scale[start:start + c].numpy(), ws, rtol=1e-5)
        start += c
    assert y[5].abs().sum() == 0 and scale[5] == 0


def test_dequant_swiglu_quant_refuses_what_the_npu_refuses():
    acc = torch.zeros(2, 128, dtype=torch.int32)
    ws, qs = torch.ones(128), torch.ones(64)
    with pytest.raises(RuntimeError, match="weight_scale dtype bfloat16 is not supported"):
        ops().npu_dequant_swiglu_quant(acc, weight_scale=ws.bfloat16(), quant_scale=qs, quant_mode=1)
    # upstream casts down_proj.smooth_scales to fp32 for this reason (models/qwen process_weights_after_loading)
    with pytest.raises(RuntimeError, match="quant_scale dtype bfloat16 is not supported"):
        ops().npu_dequant_swiglu_quant(acc, weight_scale=ws, quant_scale=qs.bfloat16(), quant_mode=1)
    with pytest.raises(RuntimeError, match="activation_scale num\\(3\\) must be equal to the tokens num\\(2\\)"):
        ops().npu_dequant_swiglu_quant(acc, weight_scale=ws, activation_scale=torch.ones(3), quant_mode=1)
    with pytest.raises(RuntimeError, match="The shape size of weight_scale \\(64\\) must be equal to 128"):
        ops().npu_dequant_swiglu_quant(acc, weight_scale=torch.ones(64), quant_mode=1)
    with pytest.raises(UnsupportedOp, match="quant_mode=0 \\(static quantization\\)"):
        ops().npu_dequant_swiglu_quant(acc, weight_scale=ws, quant_scale=qs, quant_mode=0)
    with pytest.raises(UnsupportedOp, match="swiglu_mode=1"):
        ops().npu_dequant_swiglu_quant(acc, weight_scale=ws, quant_mode=1, swiglu_mode=1)


# ---- npu_grouped_matmul, quantized --------------------------------------------------------------
def test_grouped_matmul_int8_modes_match_per_expert_formula():
    """int8 x int8: the int32 accumulator (upstream's W8A8 MoE, output_dtype=torch.int32), and the
    per-token dequantization y_g = (x_g @ w_g) * scale_g * per_token_scale (bf16 out)."""
    e, k, n = 3, 32, 8
    sizes = [2, 0, 4]
    x, w = _int8(6, k, seed=6), _int8(e, k, n, seed=7)
    got = ops().npu_grouped_matmul([x], [w], group_list=torch.tensor(sizes), split_item=3, group_type=0,
                                   group_list_type=1, output_dtype=torch.int32, tuning_config=[0])[0]
    assert got.dtype == torch.int32 and got.shape == (6, n)
    scale = torch.rand(e, n) * 1e-2
    pertoken = torch.rand(6) * 1e-2
    deq = ops().npu_grouped_matmul([x], [w], scale=[scale], per_token_scale=[pertoken],
                                   group_list=torch.tensor(np.cumsum(sizes)), split_item=3, group_type=0,
                                   group_list_type=0, output_dtype=torch.bfloat16)[0]
    start = 0
    for g, size in enumerate(sizes):
        acc = x[start:start + size].numpy().astype(np.int64) @ w[g].numpy().astype(np.int64)
        np.testing.assert_array_equal(got[start:start + size].numpy(), acc)
        want = acc.astype(np.float32) * scale[g].numpy() * pertoken[start:start + size].numpy()[:, None]
        np.testing.assert_array_equal(deq[start:start + size].float().numpy(),
                                      torch.from_numpy(want).bfloat16().float().numpy())
        start += size


def test_grouped_matmul_quantized_refusals():
    x, w = _int8(4, 16), _int8(2, 16, 8)
    with pytest.raises(UnsupportedOp, match="npu_grouped_matmul with an int8 output"):
        ops().npu_grouped_matmul([x], [w], group_list=torch.tensor([2, 4]), split_item=3, group_type=0)
    with pytest.raises(UnsupportedOp, match="npu_grouped_matmul with antiquant_scale"):
        ops().npu_grouped_matmul([x.float()], [w], antiquant_scale=[torch.ones(2, 8)],
                                 group_list=torch.tensor([2, 4]), split_item=3, group_type=0)
    with pytest.raises(RuntimeError, match="an int32 output takes no scale"):
        ops().npu_grouped_matmul([x], [w], scale=[torch.ones(2, 8)], group_list=torch.tensor([2, 4]), split_item=3,
                                 group_type=0, output_dtype=torch.int32)
    with pytest.raises(RuntimeError, match="Dim 1 mismatch"):     # a weight left [E, N, K] as loaded
        ops().npu_grouped_matmul([x], [w.transpose(1, 2)], group_list=torch.tensor([2, 4]), split_item=3,
                                 group_type=0, output_dtype=torch.int32)


# ---- npu_moe_init_routing_v2, quant_mode 1 ------------------------------------------------------
def test_init_routing_v2_dynamic_quant_quantizes_each_row_with_its_experts_smooth_scale():
    torch.manual_seed(4)
    x = torch.randn(4, 32).bfloat16()
    idx = torch.tensor([[1, 0], [2, 1], [0, 2], [1, 1]], dtype=torch.int32)
    smooth = torch.rand(3, 32) + 0.5
    plain, row_idx, counts, _ = ops().npu_moe_init_routing_v2(x, idx, active_num=8, expert_num=3,
                                                              expert_tokens_num_type=1, expert_tokens_num_flag=True)
    q, q_row_idx, q_counts, q_scale = ops().npu_moe_init_routing_v2(
        x, idx, scale=smooth, active_num=8, expert_num=3, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        quant_mode=1)
    assert q.dtype == torch.int8 and torch.equal(q_row_idx, row_idx) and torch.equal(q_counts, counts)
    experts = torch.sort(idx.reshape(-1).long(), stable=True).values
    want_y, want_scale = np_quantize_rows(plain.float().numpy() * smooth[experts].numpy())
    np.testing.assert_array_equal(q.numpy(), want_y)
    np.testing.assert_allclose(q_scale.numpy(), want_scale, rtol=1e-7)
    with pytest.raises(UnsupportedOp, match="quant_mode=0"):
        ops().npu_moe_init_routing_v2(x, idx, active_num=8, expert_num=3, quant_mode=0)


# ---- upstream's chains, against the float computation they stand for -----------------------------
def _w8a8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel symmetric int8 of a [n, k] weight, as a compressed-tensors W8A8 checkpoint stores it."""
    scale = weight.abs().amax(dim=1, keepdim=True) / 127
    return torch.round(weight / scale).clamp(-127, 127).to(torch.int8), scale


def _relative(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_upstream_w8a8_linear_and_fused_mlp_chains_track_the_float_mlp():
    """CompressedTensorsW8A8Int8LinearMethod.apply_weights (npu_dynamic_quant -> npu_quant_matmul) and
    models/qwen `_forward_w8a8int8` (gate_up int32 -> npu_dequant_swiglu_quant -> down_proj) on the
    weights of a float MLP: within int8's error of it; a scale off by 2 is not."""
    torch.manual_seed(5)
    hidden, inter, t = 64, 128, 9
    x = torch.randn(t, hidden).bfloat16()
    gate_up = torch.randn(2 * inter, hidden) / hidden ** 0.5
    down = torch.randn(hidden, inter) / inter ** 0.5
    h = x.float() @ gate_up.t()
    want = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ down.t()

    q_gu, s_gu = _w8a8(gate_up)
    q_down, s_down = _w8a8(down)
    smooth = torch.ones(hidden).bfloat16()
    xq, x_scale = ops().npu_dynamic_quant(x, smooth_scales=smooth)
    linear = ops().npu_quant_matmul(xq, q_gu.t(), s_gu.view(-1).float(), pertoken_scale=x_scale,
                                    output_dtype=torch.bfloat16)
    assert _relative(linear, h) < 0.02

    acc = ops().npu_quant_matmul(xq, q_gu.t(), s_gu.view(-1).float(), output_dtype=torch.int32)
    inter_q, inter_scale = ops().npu_dequant_swiglu_quant(acc, weight_scale=s_gu.float(), activation_scale=x_scale,
                                                          quant_scale=torch.ones(inter), activate_left=True,
                                                          quant_mode=1)
    out = ops().npu_quant_matmul(inter_q, q_down.t(), s_down.view(-1).float(), pertoken_scale=inter_scale,
                                 output_dtype=torch.bfloat16)
    assert _relative(out, want) < 0.03
    wrong = ops().npu_quant_matmul(inter_q, q_down.t(), (2 * s_down).view(-1).float(), pertoken_scale=inter_scale,
                                   output_dtype=torch.bfloat16)
    assert _relative(wrong, want) > 0.5


def test_upstream_w8a8_moe_experts_track_the_float_experts():
    """CompressedTensorW8A8Int8MoEGMMMethod.apply: npu_dynamic_quant -> grouped matmul (int32) ->
    npu_dequant_swiglu_quant(group_index) -> grouped matmul (per-token dequant), against per-expert float MLPs."""
    torch.manual_seed(6)
    e, hidden, inter = 3, 64, 64
    counts = [4, 1, 3]
    x = torch.randn(sum(counts), hidden).bfloat16()
    w13 = torch.randn(e, 2 * inter, hidden) / hidden ** 0.5
    w2 = torch.randn(e, hidden, inter) / inter ** 0.5
    q13, s13 = zip(*(_w8a8(w13[i]) for i in range(e)))
    q2, s2 = zip(*(_w8a8(w2[i]) for i in range(e)))
    q13 = torch.stack(q13).transpose(1, 2)          # process_weights_after_loading: [E, K, N]
    q2 = torch.stack(q2).transpose(1, 2)
    s13 = torch.stack([s.view(-1) for s in s13])
    s2 = torch.stack([s.view(-1) for s in s2]).bfloat16()
    group = torch.tensor(counts)

    xq, pertoken = ops().npu_dynamic_quant(x)
    mm13 = ops().npu_grouped_matmul([xq], [q13], group_list=group, split_item=3, output_dtype=torch.int32,
                                    group_type=0, group_list_type=1, tuning_config=[0])[0]
    inter_q, inter_scale = ops().npu_dequant_swiglu_quant(mm13, weight_scale=s13, quant_scale=torch.ones(e, inter),
                                                          group_index=group, activate_left=True, quant_mode=1,
                                                          activation_scale=pertoken)
    out = ops().npu_grouped_matmul([inter_q], [q2], scale=[s2], per_token_scale=[inter_scale], group_list=group,
                                   split_item=3, output_dtype=torch.bfloat16, group_type=0, group_list_type=1,
                                   tuning_config=[0])[0]
    want, start = [], 0
    for i, c in enumerate(counts):
        h = x[start:start + c].float() @ w13[i].t()
        want.append((torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w2[i].t())
        start += c
    assert out.dtype == torch.bfloat16 and _relative(out, torch.cat(want)) < 0.03


def test_quantized_ops_trace_under_torch_compile():
    """Their fake implementations give dynamo the shapes and dtypes: the W8A8 linear chain compiles
    whole (fullgraph) and gives the eager values."""
    torch.manual_seed(7)
    w, s = _w8a8(torch.randn(16, 32))

    def linear(x):
        xq, x_scale = torch.ops.npu.npu_dynamic_quant(x)
        acc = torch.ops.npu.npu_quant_matmul(xq, w.t(), s.view(-1), output_dtype=torch.int32)
        y, y_scale = torch.ops.npu.npu_dequant_swiglu_quant(acc, weight_scale=s.view(-1), activation_scale=x_scale,
                                                            activate_left=True, quant_mode=1)
        return torch.ops.npu.npu_quant_matmul(xq, w.t(), s.view(-1), pertoken_scale=x_scale,
                                              output_dtype=torch.bfloat16), y, y_scale

    x = torch.randn(3, 32).bfloat16()
    compiled = torch.compile(linear, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(x), linear(x)):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want)
