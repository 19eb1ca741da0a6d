"""The W8A8 int8 ops of upstream's quantized paths: dynamic per-token activation quantization, the
quantized matmul, the fused dequant-SwiGLU-quant, and the quantized modes of npu_grouped_matmul and
npu_moe_init_routing_v2 (kernels/matmul.py and kernels/moe.py hand those modes here).

Who calls them (cann-recipes-infer fbc225d): module/quantization/compressed_tensors/
compressed_tensors_w8a8_int8.py and module/linear.py (npu_dynamic_quant -> npu_quant_matmul, int32 out
for the fused MLP), models/qwen `_forward_w8a8int8` and deepseek_r1's MLP / shared expert
(npu_dequant_swiglu_quant), compressed_tensors_moe_gmm.py CompressedTensorW8A8Int8MoEGMMMethod and
linear.py DynamicW8A8MoeFFN (npu_grouped_matmul int8 -> int32, dequant-swiglu-quant with group_index,
npu_grouped_matmul per-token dequant), deepseek_r1's MoE (npu_moe_init_routing_v2 quant_mode=1).
`npu_weight_quant_batchmatmul` and `npu_trans_quant_param` are not on that path (no call in the
checkout's W8A8 int8 code; the latter is the HiF8 scheme's): they stay without a reference.

Sources, cited per op: the torch-npu 2.13.0 wheel (torch_npu/_op_plugin_docs.py, its schemas in
csrc/aten/npu_native_functions_by_codegen.yaml, its meta functions in
op_plugin/meta/_meta_registrations.py), Ascend/op-plugin docs/context/torch_npu-*.md, and CANN's
kernels and host checks in hicann/ops-nn@e5c3fa93. Where the NPU refuses an input (a dtype, a shape),
the reference raises the same refusal as a RuntimeError naming the aclnn API; a mode the references
below do not compute (int4, static quantization, an int64 scale, the SwiGLU variant) is refused with
one line (kernels.refuse).
"""

from __future__ import annotations

import torch

from npu_standin import record
from npu_standin.kernels import refuse, reference

INT8_MAX = 127.0

# torch_npu's integer codes of dtypes (the `int? output_dtype` / `dst_type` arguments receive a
# torch.dtype as its c10::ScalarType number): torch-npu 2.13.0 op_plugin/meta/_meta_registrations.py
# TORCH_DTYPE_ENUM_VALUE_TO_SCALAR_TYPE_MAP, the entries these ops take.
SCALAR_TYPES = {0: torch.uint8, 1: torch.int8, 3: torch.int32, 4: torch.int64, 5: torch.float16, 6: torch.float32,
                15: torch.bfloat16, 16: torch.quint4x2, 23: torch.float8_e5m2, 24: torch.float8_e4m3fn}
NPU_ONLY_TYPES = {285: "int4", 290: "hifloat8", 291: "float8_e5m2", 292: "float8_e4m3fn", 296: "float4_e2m1fn_x2"}


def scalar_type(code):
    """The dtype a code names (None for None); a torch_npu-only type as its name, an unknown code as itself."""
    if code is None or isinstance(code, torch.dtype):
        return code
    return SCALAR_TYPES.get(int(code), NPU_ONLY_TYPES.get(int(code), int(code)))


def _acl(api: str, message: str) -> RuntimeError:
    """The NPU's refusal of an input (an aclnn parameter check), as the stand-in raises it."""
    return RuntimeError(f"{api} (npu stand-in): {message}")


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def quantize_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of fp32 `values` [..., H] as CANN's dynamic kernels compute it: scale =
    row_max(|v|) / 127 (fp32), y = cast_rint(v * (1 / scale)), round half to even. hicann/ops-nn@e5c3fa93
    quant/dequant_swiglu_quant/op_kernel/dequant_swiglu_quant_dynamic_base.hpp `DynamicCompute`
    (`value = max / 127; scale = 1 / value; Muls(...); Cast(int16Local, swiLocal, RoundMode::CAST_RINT)`),
    quant/dynamic_quant/op_kernel/arch35/dynamic_quant_regbase_full_load.h (`maxValue = 1.0 /
    INT8_MAX_VALUE`, castTraitF32ToI16 `RoundMode::CAST_RINT`). A row of zeros (0 * (1/0) in the kernel:
    a NaN whose cast the documentation leaves open) is y = 0, scale = 0 here, noted in the record."""
    values = values.float()
    amax = values.abs().amax(dim=-1, keepdim=True)
    scale = amax / INT8_MAX
    zero = amax == 0
    if bool(zero.any()):
        if not record.compiling():
            record.note("dynamic-quant-zero-row", "a row of zeros quantized: y 0, scale 0 (the kernel's 0*(1/0) "
                                                  "is left to the hardware's NaN cast)")
    inverse = torch.where(zero, torch.zeros_like(scale), 1.0 / torch.where(zero, torch.ones_like(scale), scale))
    y = torch.round(values * inverse).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return y, scale.squeeze(-1)


def _group_ranges(group_index: torch.Tensor, rows: int, *, cumulative: bool) -> list[tuple[int, int]]:
    values = [int(v) for v in group_index.reshape(-1).tolist()]
    if cumulative:
        ends = values
    else:
        ends, total = [], 0
        for v in values:
            total += v
            ends.append(total)
    starts = [0] + ends[:-1]
    if any(v < 0 for v in values) or any(b < a for a, b in zip(starts, ends)) or (ends and ends[-1] > rows):
        raise ValueError(f"group_index {values} does not split {rows} rows")
    return list(zip(starts, ends))


# ---- npu_dynamic_quant ------------------------------------------------------------------------
def _dynamic_quant_fake(input, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken",
                        dst_type_max=0.0):
    return torch.empty_like(input, dtype=torch.int8), input.new_empty(input.shape[:-1], dtype=torch.float32)


@reference("npu_dynamic_quant(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None, "
           "int? dst_type=None, str quant_mode=\"pertoken\", float dst_type_max=0.0) -> (Tensor, Tensor)",
           formulation="per token: v = x * smooth_scales (fp32; group_index: smooth_scales[g] on rows "
                       "[group_index[g-1], group_index[g])), scale = rowmax(|v|) / 127, y = rint(v / scale) int8",
           test="tests/unit/npu_standin/kernels/test_quant.py::test_dynamic_quant_matches_documented_formula",
           fake=_dynamic_quant_fake)
def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken",
                      dst_type_max=0.0):
    """torch_npu.npu_dynamic_quant, per-token symmetric int8. The torch-npu 2.13.0 wheel's doc
    (_op_plugin_docs.py "npu_dynamic_quant"): scale = rowMax(abs(x x smooth_scales)) / DTYPE_MAX,
    y = round(x x smooth_scales / scale); smooth_scales[i] acts on x[group_index[i-1]:group_index[i]]
    (MoE). The NPU's checks (hicann/ops-nn@e5c3fa93 quant/dynamic_quant/op_host/op_api/
    aclnn_dynamic_quant.cpp): x float16/bfloat16 and at least 2-D, smooth_scales the dtype of x,
    1-D of x's last dim (2-D [G, H] with group_index, group_index int32/int64 1-D). Arithmetic in
    fp32, round half to even: quantize_rows."""
    api = "aclnnDynamicQuant"
    target = scalar_type(dst_type)
    if target not in (None, torch.int8):
        refuse("npu_dynamic_quant", f"dst_type={_name(target)} (only int8 has a reference)")
    if quant_mode != "pertoken":
        refuse("npu_dynamic_quant", f"quant_mode={quant_mode!r} (only 'pertoken' has a reference)")
    if input.dtype not in (torch.float16, torch.bfloat16):
        raise _acl(api, f"x dtype {_name(input.dtype)} is not supported (float16, bfloat16)")
    if input.dim() < 2:
        raise _acl(api, f"The dimNum[{input.dim()}] of x should be greater than 1")
    rows = input.reshape(-1, input.shape[-1]).float()
    if smooth_scales is not None:
        if smooth_scales.dtype != input.dtype:
            raise _acl(api, f"The dtypes of x and smooth_scales are not equal ({_name(input.dtype)}, "
                            f"{_name(smooth_scales.dtype)})")
        if smooth_scales.shape[-1] != input.shape[-1]:
            raise _acl(api, f"The last dim[{input.shape[-1]}] of x and the dim[{smooth_scales.shape[-1]}] of "
                            "smooth_scales shoule be equal.")
        if group_index is None:
            if smooth_scales.dim() != 1:
                raise _acl(api, f"The dimNum[{smooth_scales.dim()}] of smooth_scales should be equal to one.")
            rows = rows * smooth_scales.float()
        else:
            if group_index.dim() != 1 or group_index.dtype not in (torch.int32, torch.int64):
                raise _acl(api, "group_index must be a 1-D int32/int64 tensor")
            smooth = smooth_scales.reshape(-1, input.shape[-1]).float()
            ranges = _group_ranges(group_index, rows.shape[0], cumulative=True)
            if len(ranges) != smooth.shape[0]:
                raise _acl(api, f"group_index has {len(ranges)} groups for {smooth.shape[0]} rows of smooth_scales")
            scaled = rows.clone()
            for g, (start, end) in enumerate(ranges):
                scaled[start:end] = rows[start:end] * smooth[g]
            rows = scaled
    y, scale = quantize_rows(rows)
    return y.reshape(input.shape), scale.reshape(input.shape[:-1])


# ---- npu_quant_matmul -------------------------------------------------------------------------
def _quant_matmul_fake(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                       x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None,
                       y_scale=None):
    batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    out = scalar_type(output_dtype)
    out = out if isinstance(out, torch.dtype) else torch.int8
    return x1.new_empty((*batch, x1.shape[-2], x2.shape[-1]), dtype=out)


def int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact int8 x int8 -> int32 accumulation: products summed in float64 (exact below 2^53, and
    |sum| <= 127 * 128 * K < 2^31 for every K the NPU takes, K < 65536), returned as int32."""
    return torch.matmul(a.to(torch.float64), b.to(torch.float64)).to(torch.int32)


@reference("npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, "
           "Tensor? pertoken_scale=None, Tensor? bias=None, int? output_dtype=None, int? x1_dtype=None, "
           "int? x2_dtype=None, int? pertoken_scale_dtype=None, int? scale_dtype=None, int[]? group_sizes=None, "
           "Tensor? y_scale=None) -> Tensor",
           formulation="acc = x1 @ x2 in int32 (+ int32 bias); int32 out: acc; bf16/fp16 out: acc * scale "
                       "[* pertoken_scale] in fp32 (+ a float bias after scaling)",
           test="tests/unit/npu_standin/kernels/test_quant.py::test_quant_matmul_matches_documented_formulas",
           fake=_quant_matmul_fake)
def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                     x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None,
                     y_scale=None):
    """torch_npu.npu_quant_matmul, int8 inputs. Ascend/op-plugin docs/context/torch_npu-npu_quant_matmul.md
    and the ops-nn README of QuantBatchMatmulV3 (hicann/ops-nn@e5c3fa93 matmul/quant_batch_matmul_v3/
    README.md): out = x1@x2 * scale (+ offset); int32 bias: (x1@x2 + bias) * scale; float bias: x1@x2 *
    scale + bias; with pertoken_scale: x1@x2 * scale * pertoken_scale (+ bias as above). The dtype rows
    of the doc's table 2 (A2/A3) and the host checks of matmul/quant_batch_matmul_v3/op_host/op_api/
    aclnn_quant_matmul_v4.cpp (`CheckDtypeValidOnOnlyL0c2outForUnclassified`, `...ForPertoken`): bf16
    out takes a float32/bf16 scale; int32 out a float32/bf16 scale and an int32 bias only; a
    pertoken_scale is float32 with a bf16/fp16 out; fp16 out with pertoken_scale needs a float32 scale.
    The int32 output is the accumulator itself (x1@x2 + int32 bias): the table's row "int8 int8
    float32/bfloat16 None int32/None None int32" has no dequantization, and upstream's fused MLP
    (models/qwen `_forward_w8a8int8`) dequantizes that output by the same weight_scale again in
    npu_dequant_swiglu_quant. int8/fp16 outputs without pertoken_scale take an int64 scale from
    npu_trans_quant_param: refused (no reference), as are int4 (int32-packed) inputs, offset and the
    extra dtype / group arguments."""
    api = "aclnnQuantMatmulV4"
    out = scalar_type(output_dtype) or torch.int8
    extras = {"x1_dtype": x1_dtype, "x2_dtype": x2_dtype, "pertoken_scale_dtype": pertoken_scale_dtype,
              "scale_dtype": scale_dtype, "group_sizes": group_sizes, "y_scale": y_scale, "offset": offset}
    given = [name for name, value in extras.items() if value is not None]
    if given:
        refuse("npu_quant_matmul", f"{', '.join(given)} (only the int8 per-channel / per-token modes have a reference)")
    if x1.dtype == torch.int32 or x2.dtype == torch.int32:
        refuse("npu_quant_matmul", "int32 inputs (int4 packed, A4W4)")
    if x1.dtype != torch.int8 or x2.dtype != torch.int8:
        raise _acl(api, f"Input x1 and x2 dtype should be INT8, actual dtype are {_name(x1.dtype)} and {_name(x2.dtype)}")
    if scale.dtype == torch.int64:
        refuse("npu_quant_matmul", "an int64 scale (npu_trans_quant_param's encoding)")
    if out in (torch.int8, torch.float16) and pertoken_scale is None:
        refuse("npu_quant_matmul", f"output_dtype {_name(out)} without pertoken_scale (it takes npu_trans_quant_param's "
                                   "int64 scale)")
    if out not in (torch.bfloat16, torch.float16, torch.int32):
        raise _acl(api, f"output dtype {_name(out)} is not supported (int8, float16, bfloat16, int32)")
    if scale.dtype not in (torch.float32, torch.bfloat16):
        raise _acl(api, f"scale dtype {_name(scale.dtype)} is not supported with output dtype {_name(out)} "
                        "(float32, bfloat16)")
    if out == torch.int32:
        if pertoken_scale is not None:
            raise _acl(api, "When pertokenScaleOptional is not nullptr, out dtype should be FLOAT16 or BF16, "
                            "actual dtype is INT32.")
        if bias is not None and bias.dtype != torch.int32:
            raise _acl(api, f"When out dtype is INT32, bias dtype should be INT32, actual dtype is {_name(bias.dtype)}.")
    if pertoken_scale is not None:
        if pertoken_scale.dtype != torch.float32:
            raise _acl(api, f"pertoken_scale dtype {_name(pertoken_scale.dtype)} is not supported (float32)")
        if out == torch.float16 and scale.dtype != torch.float32:
            raise _acl(api, "When pertokenScaleOptional is not nullptr, out dtype is FLOAT16, scale dtype should be "
                            f"FLOAT, actual dtype is {_name(scale.dtype)}.")
    if bias is not None and bias.dtype not in (torch.int32, torch.bfloat16, torch.float16, torch.float32):
        raise _acl(api, f"bias dtype {_name(bias.dtype)} is not supported")
    if x1.dim() < 2 or x2.dim() < 2 or x1.dim() > 6 or x2.dim() > 6:
        raise _acl(api, "x1 and x2 take 2 to 6 dimensions")
    m, k, n = x1.shape[-2], x1.shape[-1], x2.shape[-1]
    if x2.shape[-2] != k:
        raise _acl(api, f"x1 k dim and x2 k dim should be same, but x1 is {k}, x2 is {x2.shape[-2]}.")
    if scale.dim() != 1 or scale.numel() not in (1, n):
        raise _acl(api, f"scale must be 1-D of 1 or n={n} values, got shape {tuple(scale.shape)}")
    if pertoken_scale is not None and (pertoken_scale.dim() != 1 or pertoken_scale.numel() != m):
        raise _acl(api, f"pertoken_scale must be 1-D of m={m} values, got shape {tuple(pertoken_scale.shape)}")
    acc = int_matmul(x1, x2)
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.to(torch.int32)
    if out == torch.int32:
        return acc
    y = acc.float() * scale.float()
    if pertoken_scale is not None:
        y = y * pertoken_scale.float().unsqueeze(-1)
    if bias is not None and bias.dtype != torch.int32:
        y = y + bias.float()
    return y.to(out)


# ---- npu_dequant_swiglu_quant -----------------------------------------------------------------
def _dequant_swiglu_quant_fake(x, *, weight_scale=None, activation_scale=None, bias=None, quant_scale=None,
                               quant_offset=None, group_index=None, activate_left=False, quant_mode=0, dst_type=None,
                               round_mode=None, activate_dim=None, swiglu_mode=0, clamp_limit=7.0, glu_alpha=1.702,
                               glu_bias=1.0):
    half = (*x.shape[:-1], x.shape[-1] // 2)
    return x.new_empty(half, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


@reference("npu_dequant_swiglu_quant(Tensor x, *, Tensor? weight_scale=None, Tensor? activation_scale=None, "
           "Tensor? bias=None, Tensor? quant_scale=None, Tensor? quant_offset=None, Tensor? group_index=None, "
           "bool activate_left=False, int quant_mode=0, int? dst_type=None, int? round_mode=None, "
           "int? activate_dim=None, int swiglu_mode=0, float clamp_limit=7.0, float glu_alpha=1.702, "
           "float glu_bias=1.0) -> (Tensor, Tensor)",
           formulation="v = x(int32) * weight_scale * activation_scale (fp32); a, b = split(v, 2); "
                       "s = silu(a) * b (activate_left) else silu(b) * a; s *= quant_scale; dynamic per-row int8",
           test="tests/unit/npu_standin/kernels/test_quant.py::test_dequant_swiglu_quant_matches_documented_chain",
           fake=_dequant_swiglu_quant_fake)
def npu_dequant_swiglu_quant(x, *, weight_scale=None, activation_scale=None, bias=None, quant_scale=None,
                             quant_offset=None, group_index=None, activate_left=False, quant_mode=0, dst_type=None,
                             round_mode=None, activate_dim=None, swiglu_mode=0, clamp_limit=7.0, glu_alpha=1.702,
                             glu_bias=1.0):
    """torch_npu.npu_dequant_swiglu_quant, dynamic quantization (quant_mode=1). The torch-npu 2.13.0
    wheel's doc (_op_plugin_docs.py): dequantize x [T, 2H] (int32) by weight_scale and the per-token
    activation_scale, SwiGLU (activate_left: swish(x[..., :H]) * x[..., H:], else swish(x[..., H:]) *
    x[..., :H]), multiply by the smooth quant_scale, quantize per token; group_index (count mode)
    picks the row of weight_scale [G, 2H] and quant_scale [G, H] per group of tokens; rows past the
    groups are left as garbage by the NPU (zeros here). The order of the arithmetic is the A2/A3
    kernel's, hicann/ops-nn@e5c3fa93 quant/dequant_swiglu_quant/op_kernel/
    dequant_swiglu_quant_dynamic_base.hpp `BaseCompute`: an int32 bias added to x before the cast,
    x * weight_scale then * activation_scale, a float bias after; swish as v / (1 + exp(-v)); the
    product * quant_scale (`BaseComputeWithQuantScale`: Mul, not a division); then quantize_rows.
    The host checks of op_host/dequant_swiglu_quant_tiling_base.cpp (no group_index: weight_scale
    float32 of 2H values in any shape, activation_scale float32 of T values, quant_scale float32 of H
    or 1 values) and dequant_swiglu_quant_tiling.cpp `DequantSwigluQuantDskTiling` (group_index int64
    1-D, 2H a multiple of 64, scales' last dim 2H / H and 2-D [G, .] for G > 1, bias and quant_offset
    None, quant_mode 1) are raised as the NPU's refusals. Static quantization, swiglu_mode 1 (clamped
    variant), another activate_dim or dst_type are refused with one line."""
    api = "aclnnDequantSwigluQuant"
    if quant_mode != 1:
        refuse("npu_dequant_swiglu_quant", f"quant_mode={quant_mode} (static quantization)")
    if swiglu_mode != 0:
        refuse("npu_dequant_swiglu_quant", f"swiglu_mode={swiglu_mode} (the clamped SwiGLU variant)")
    if activate_dim not in (None, -1, x.dim() - 1):
        refuse("npu_dequant_swiglu_quant", f"activate_dim={activate_dim}")
    if scalar_type(dst_type) not in (None, torch.int8) or round_mode not in (None, 0):
        refuse("npu_dequant_swiglu_quant", f"dst_type={dst_type}, round_mode={round_mode} (only int8, rint)")
    if x.dtype not in (torch.int32, torch.bfloat16, torch.float16):
        raise _acl(api, f"x dtype {_name(x.dtype)} is not supported (int32, bfloat16, float16)")
    two_h = x.shape[-1]
    if two_h % 2:
        raise _acl(api, f"the last dim of x ({two_h}) must be even")
    h = two_h // 2
    values = x.reshape(-1, two_h)
    tokens = values.shape[0]
    grouped = group_index is not None
    if grouped:
        if group_index.dtype != torch.int64 or group_index.dim() != 1:
            raise _acl(api, f"group_index must be 1-D int64, got {_name(group_index.dtype)} {tuple(group_index.shape)}")
        if two_h % 64:
            raise _acl(api, f"The last dimension of x must be exactly divisible by 64 (x: {two_h})")
        if bias is not None or quant_offset is not None:
            raise _acl(api, "with group_index, bias and quant_offset must be None")
        ranges = _group_ranges(group_index, tokens, cumulative=False)
    else:
        ranges = [(0, tokens)]
    groups = len(ranges)
    if x.dtype == torch.int32:
        if weight_scale is None:
            raise _acl(api, "weight_scale is required when x is int32")
        if weight_scale.dtype != torch.float32:
            raise _acl(api, f"weight_scale dtype {_name(weight_scale.dtype)} is not supported (float32)")
        w_scale = _scale_rows(api, "weight_scale", weight_scale, two_h, groups, grouped)
        if activation_scale is not None:
            if activation_scale.dtype != torch.float32:
                raise _acl(api, f"activation_scale dtype {_name(activation_scale.dtype)} is not supported (float32)")
            if activation_scale.numel() != tokens:
                raise _acl(api, f"activation_scale num({activation_scale.numel()}) must be equal to the tokens "
                                f"num({tokens}), please check.")
        acc = values
        if bias is not None and bias.dtype == torch.int32:
            acc = acc + bias.reshape(-1)
        v = acc.float()
    else:
        if weight_scale is not None or activation_scale is not None or bias is not None:
            raise _acl(api, "when x is float16 or bfloat16, weight_scale, activation_scale and bias must be None")
        v = values.float()
        w_scale = None
    q_scale = None
    if quant_scale is not None:
        allowed = (torch.float32, torch.float16, torch.bfloat16) if grouped else (torch.float32,)
        if quant_scale.dtype not in allowed:
            raise _acl(api, f"quant_scale dtype {_name(quant_scale.dtype)} is not supported "
                            f"({', '.join(_name(d) for d in allowed)})")
        if not grouped and quant_scale.numel() == 1:
            q_scale = quant_scale.float().reshape(1, 1)
        else:
            q_scale = _scale_rows(api, "quant_scale", quant_scale, h, groups, grouped)
    out = torch.zeros((tokens, h), dtype=torch.float32, device=x.device)
    for g, (start, end) in enumerate(ranges):
        rows = v[start:end]
        if w_scale is not None:
            rows = rows * w_scale[g]
            if activation_scale is not None:
                rows = rows * activation_scale.reshape(-1)[start:end].float().unsqueeze(-1)
            if bias is not None and bias.dtype != torch.int32:
                rows = rows + bias.reshape(-1).float()
        a, b = rows[:, :h], rows[:, h:]
        act, gate = (a, b) if activate_left else (b, a)
        swiglu = act / (1.0 + torch.exp(-act)) * gate
        if q_scale is not None:
            swiglu = swiglu * q_scale[min(g, q_scale.shape[0] - 1)]
        out[start:end] = swiglu
    used = ranges[-1][1] if ranges else 0
    y, scale = quantize_rows(out[:used])
    y_full = torch.zeros((tokens, h), dtype=torch.int8, device=x.device)
    scale_full = torch.zeros((tokens,), dtype=torch.float32, device=x.device)
    y_full[:used], scale_full[:used] = y, scale
    return y_full.reshape(*x.shape[:-1], h), scale_full.reshape(x.shape[:-1])


def _scale_rows(api: str, name: str, scale: torch.Tensor, width: int, groups: int, grouped: bool) -> torch.Tensor:
    """`scale` as [groups, width] fp32 rows, as the host checks let it in (see npu_dequant_swiglu_quant)."""
    if grouped:
        if scale.shape[-1] != width:
            raise _acl(api, f"the last dim of {name} {tuple(scale.shape)} must be {width}")
        if groups > 1 and (scale.dim() != 2 or scale.shape[0] != groups):
            raise _acl(api, f"the first dimension of {name} ({scale.shape[0] if scale.dim() else 0}) must be equal "
                            f"to the first dimension of group_index ({groups})")
        return scale.reshape(-1, width).float()
    if scale.numel() != width:
        raise _acl(api, f"The shape size of {name} ({scale.numel()}) must be equal to {width}")
    return scale.reshape(1, width).float()


# ---- quantized modes of npu_grouped_matmul and npu_moe_init_routing_v2 -------------------------
def grouped_matmul(x, weight, *, bias, scale, per_token_scale, pieces_of, output_dtype, act_type, split_item):
    """npu_grouped_matmul with int8 x and int8 weights (kernels/matmul.py hands it here). The torch-npu
    2.13.0 wheel's doc (_op_plugin_docs.py "npu_grouped_matmul"), group_list a tensor, A2/A3:
    per-channel y_i = (x_i @ w_i + bias_i) * scale_i (bf16/fp16 out with a bf16/float32 scale; an int8
    out takes an int64 scale: refused), per-token y_i = (x_i @ w_i + bias_i) * scale_i *
    per_token_scale_i (float32), bias int32; and the int32 output of upstream's W8A8 MoE
    (module/quantization/compressed_tensors/compressed_tensors_moe_gmm.py, `output_dtype=torch.int32`,
    no scale: the accumulator x_i @ w_i, dequantized by npu_dequant_swiglu_quant next), the case the
    ops-transformer GroupedMatmul host check admits as x int8 / weight int8 / y int32. `pieces_of(t)`
    splits rows of x (and of per_token_scale) into the groups as the unquantized path does; rows past
    the groups come back as zeros (the NPU leaves them undefined)."""
    api = "aclnnGroupedMatmul"
    out = scalar_type(output_dtype)
    if any(t.dtype != torch.int8 for t in [*x, *weight]):
        kinds = sorted({_name(t.dtype) for t in [*x, *weight]})
        if any(t.dtype == torch.int32 for t in weight) or any(t.dtype.is_floating_point for t in x):
            refuse("npu_grouped_matmul", f"x / weight dtypes {', '.join(kinds)} (int4 or weight-only quantization)")
        raise _acl(api, f"x and weight must both be int8 for a quantized grouped matmul, got {', '.join(kinds)}")
    if out in (None, torch.int8):
        refuse("npu_grouped_matmul", "an int8 output (it takes npu_trans_quant_param's int64 scale)")
    if act_type not in (None, 0):
        refuse("npu_grouped_matmul", f"act_type={act_type} with quantized inputs")
    if out == torch.int32:
        if scale is not None or per_token_scale is not None:
            raise _acl(api, "an int32 output takes no scale or per_token_scale")
    elif out in (torch.bfloat16, torch.float16):
        if scale is None:
            raise _acl(api, f"a {_name(out)} output of int8 inputs needs scale")
        if any(s.dtype not in (torch.bfloat16, torch.float32) for s in scale):
            refuse("npu_grouped_matmul", f"scale dtype {_name(scale[0].dtype)} (int64: npu_trans_quant_param's encoding)")
        if per_token_scale is not None and any(s.dtype != torch.float32 for s in per_token_scale):
            raise _acl(api, f"per_token_scale dtype {_name(per_token_scale[0].dtype)} is not supported (float32)")
    else:
        raise _acl(api, f"output dtype {_name(out)} is not supported for int8 inputs (int32, bfloat16, float16)")
    if bias is not None and any(b.dtype != torch.int32 for b in bias):
        raise _acl(api, f"bias of a quantized grouped matmul is int32, got {_name(bias[0].dtype)}")
    ws = list(weight[0].unbind(0)) if len(weight) == 1 and weight[0].dim() == 3 else list(weight)
    if x[0].shape[-1] != ws[0].shape[-2]:
        raise _acl(api, f"Dim 1 mismatch ({x[0].shape[-1]} vs {ws[0].shape[-2]}): x {tuple(x[0].shape)}, "
                        f"weight {tuple(ws[0].shape)}")
    bs = _per_group(bias, len(ws))
    ss = _per_group(scale, len(ws))
    rows, x_pieces = pieces_of(x)
    if per_token_scale is not None:
        token_scale = torch.cat([t.reshape(-1) for t in per_token_scale])
        _, pt_pieces = pieces_of([token_scale.unsqueeze(-1)])
    else:
        pt_pieces = [None] * len(x_pieces)
    if len(x_pieces) != len(ws):
        raise ValueError(f"npu_grouped_matmul: {len(x_pieces)} groups of x for {len(ws)} weights")
    results = []
    for xi, wi, bi, si, pi in zip(x_pieces, ws, bs, ss, pt_pieces):
        acc = int_matmul(xi, wi)
        if bi is not None:
            acc = acc + bi
        if out == torch.int32:
            results.append(acc)
            continue
        yi = acc.float() * si.float()
        if pi is not None:
            yi = yi * pi.float()
        results.append(yi.to(out))
    if not record.compiling():
        record.note("npu_grouped_matmul-quantized", f"int8 x int8 -> {_name(out)}"
                    + (" (per-token dequant)" if per_token_scale is not None else ""))
    if split_item in (2, 3):
        joined = torch.cat(results, dim=0) if results else x[0].new_empty((0, ws[0].shape[-1]), dtype=out)
        if rows > joined.shape[0]:
            pad = joined.new_zeros((rows - joined.shape[0], joined.shape[-1]))
            joined = torch.cat([joined, pad], dim=0)
        return [joined]
    return results


def _per_group(tensors, groups: int) -> list:
    if tensors is None:
        return [None] * groups
    if len(tensors) == 1 and tensors[0].dim() == 2:
        return list(tensors[0].unbind(0))
    if len(tensors) == 1 and groups > 1:
        return [tensors[0]] * groups
    return list(tensors)


def routing_quantize(expanded_x: torch.Tensor, experts: torch.Tensor, scale, start: int):
    """npu_moe_init_routing_v2 quant_mode=1 (kernels/moe.py hands it here), the torch-npu 2.13.0 wheel's
    doc (_op_plugin_docs.py "npu_moe_init_routing_v2"): in the dynamic-quant mode `scale`, when given,
    is float32 (expert_end - expert_start, H), the smooth row of each expanded row's expert; expanded_x
    is int8 and expanded_scale the per-row scale of the quantization (int8 x is refused: "x数据类型为int8
    时仅支持-1"). `experts` are the expanded rows' expert ids. quantize_rows after the smooth product."""
    api = "aclnnMoeInitRoutingV2"
    if expanded_x.dtype == torch.int8:
        raise _acl(api, "quant_mode 1 takes float x (an int8 x cannot be quantized again)")
    rows = expanded_x.float()
    if scale is not None:
        if scale.dtype != torch.float32:
            raise _acl(api, f"scale dtype {_name(scale.dtype)} is not supported (float32)")
        if scale.dim() != 2 or scale.shape[-1] != expanded_x.shape[-1]:
            raise _acl(api, f"scale must be 2-D (expert_end - expert_start, H={expanded_x.shape[-1]}), "
                            f"got {tuple(scale.shape)}")
        index = (experts.long() - start).clamp(min=0) if scale.shape[0] > 1 else torch.zeros_like(experts.long())
        rows = rows * scale.float()[index]
    if not record.compiling():
        record.note("npu_moe_init_routing_v2-quantized", "quant_mode 1: int8 expanded_x, per-row dynamic scale")
    return quantize_rows(rows)
