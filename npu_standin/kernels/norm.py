"""RMSNorm and SwiGLU. Computed in float32 and rounded once to the input's dtype."""

from __future__ import annotations

import torch

from npu_standin.kernels import refuse, reference


def _rms(x32: torch.Tensor, dims: int, eps: float) -> torch.Tensor:
    axes = tuple(range(x32.dim() - dims, x32.dim()))
    return torch.rsqrt(x32.pow(2).mean(dim=axes, keepdim=True) + eps)


def _rms_norm_fake(x, gamma, epsilon=1e-6):
    shape = list(x.shape[: x.dim() - gamma.dim()]) + [1] * gamma.dim()
    return torch.empty_like(x), x.new_empty(shape, dtype=torch.float32)


@reference("npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
           formulation="y = x * rsqrt(mean(x^2 over gamma's dims) + eps) * gamma in fp32, one rounding; "
                       "rstd (fp32, reduced dims kept as 1)",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py::test_rms_norm_matches_transformers",
           fake=_rms_norm_fake)
def npu_rms_norm(x, gamma, epsilon=1e-6):
    x32 = x.float()
    rstd = _rms(x32, gamma.dim(), epsilon)
    y = (x32 * rstd * gamma.float()).to(x.dtype)
    return y, rstd


def _add_rms_norm_fake(x1, x2, gamma, epsilon=1e-6):
    y, rstd = _rms_norm_fake(x1, gamma, epsilon)
    return y, rstd, torch.empty_like(x1)


@reference("npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)",
           formulation="x = x1 + x2 (in the input dtype, returned as xOut), then npu_rms_norm(x): (y, rstd, x)",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py"
                "::test_add_rms_norm_is_residual_add_then_transformers_norm",
           fake=_add_rms_norm_fake)
def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    x = x1 + x2
    y, rstd = npu_rms_norm(x, gamma, epsilon)
    return y, rstd, x


def _add_rms_norm_cast_fake(x1, x2, gamma, epsilon=1e-6):
    y, rstd, x = _add_rms_norm_fake(x1, x2, gamma, epsilon)
    return torch.empty_like(x1, dtype=torch.float32), y, rstd, x


@reference("npu_add_rms_norm_cast(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) "
           "-> (Tensor, Tensor, Tensor, Tensor)",
           formulation="npu_add_rms_norm(x1, x2): (y2, rstd, x); y1 = float(y2): returns (y1 fp32, y2, rstd, x)",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py"
                "::test_add_rms_norm_cast_is_add_rms_norm_and_its_float_copy",
           fake=_add_rms_norm_cast_fake)
def npu_add_rms_norm_cast(x1, x2, gamma, epsilon=1e-6):
    """CANN's AddRmsNormCast (hicann/ops-nn norm/add_rms_norm_cast/README.md, aclnnAddRmsNormCast): x = x1 + x2,
    y2 = RmsNorm(x) * gamma, y1 = float(y2) — "the Cast after AddRmsNorm fused into it" — in torch_npu's order
    (y1, y2, rstd, x) (op-plugin@517f2e7d _meta_registrations.py: y1 float32, the others as npu_add_rms_norm's).
    The many-rows kernel (op_kernel/add_rms_norm_cast_multi_n.h) computes y1 as that cast; its one-row bf16
    variant (add_rms_norm_cast_single_n.h) keeps y1 unrounded, within one bf16 rounding of this."""
    y, rstd, x = npu_add_rms_norm(x1, x2, gamma, epsilon)
    return y.float(), y, rstd, x


def _swiglu_fake(x, dim=-1):
    shape = list(x.shape)
    shape[dim] //= 2
    return x.new_empty(shape)


@reference("npu_swiglu(Tensor self, int dim=-1) -> Tensor",
           formulation="a, b = x.chunk(2, dim); silu(a) * b in fp32",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py::test_swiglu_matches_transformers_silu_gate",
           fake=_swiglu_fake)
def npu_swiglu(x, dim=-1):
    a, b = x.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


def _geglu_fake(x, dim=-1, approximate=1, activate_left=False):
    half = _swiglu_fake(x, dim)
    return half, x.new_empty(half.shape)


@reference("npu_geglu(Tensor self, int dim=-1, int approximate=1, bool activate_left=False) -> (Tensor, Tensor)",
           formulation="A, B = x.chunk(2, dim); activate_left: (gelu(A) * B, gelu(A)), else (A * gelu(B), gelu(B)); "
                       "gelu erf (approximate 0) or tanh (1), in fp32 (fp16 with tanh: the product in fp16)",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py::test_geglu_matches_transformers_gelu_tanh_gate",
           fake=_geglu_fake)
def npu_geglu(x, dim=-1, approximate=1, activate_left=False):
    """aclnnGeGluV3 (op-plugin@517f2e7d op_plugin/ops/opapi/GeGluKernelNpuOpApi.cpp): out = Gelu(A) * B when
    activate_left, A * Gelu(B) otherwise (A, B: the halves of self along dim), outGelu = the Gelu half (hicann/ops-nn
    activation/ge_glu_v2/docs/aclnnGeGluV3.md). Precision as ops-nn's golden (activation/ge_glu_v2/tests/assets/
    golden.py): computed in fp32, except fp16 with approximate=1, whose product is taken in fp16."""
    if approximate not in (0, 1):
        refuse("npu_geglu", f"approximate={approximate} (0: erf, 1: tanh)")
    half_precision = x.dtype == torch.float16 and approximate == 1
    work = x if half_precision else x.float()
    first, second = work.chunk(2, dim=dim)
    gate, value = (first, second) if activate_left else (second, first)
    gelu = torch.nn.functional.gelu(gate.float(), approximate="tanh" if approximate == 1 else "none")
    out = value * gelu.to(torch.float16) if half_precision else value * gelu
    return out.to(x.dtype), gelu.to(x.dtype)
