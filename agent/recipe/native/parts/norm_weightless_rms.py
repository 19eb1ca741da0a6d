"""RMSNorm without a weight (nanochat's, its q/k norms too): x / sqrt(mean(x^2) + eps), its epsilon measured
numerically and read from the config key that holds it, or torch's default."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.norm_eps import EPS_KEYS
from agent.recipe.native.parts.norm_weightless import weightless_match
from agent.recipe.native.parts.part import Part


def weightless_rms_eps(norm, width: int) -> float:
    """The epsilon of `norm`, an RMSNorm of `width` with no parameters; NotNative for anything else. Measured on an
    input of mean square about 1e-5, where the epsilon moves the output: y = z * s / sqrt(s^2 + eps)."""
    import torch

    if list(norm.parameters()):
        raise NotNative("norm", f"{type(norm).__name__} has parameters: not an RMSNorm without weight")
    gen = torch.Generator().manual_seed(7)
    z = torch.randn(3, width, generator=gen, dtype=torch.float64)
    z = z / z.pow(2).mean(-1, keepdim=True).sqrt()
    scale = 1e-5 ** 0.5
    with torch.no_grad():
        small = norm((scale * z).float()).double()
    ratio = (small * z).mean(-1)                              # s / sqrt(s^2 + eps), per row
    eps = float((scale ** 2 * (1.0 / ratio.pow(2) - 1.0)).mean())
    x = 3.0 + torch.randn(3, width, generator=gen)
    with torch.no_grad():
        y = norm(x)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + max(eps, 0.0))
    if not (eps > 0 and torch.allclose(y, want, rtol=1e-4, atol=1e-5)):
        raise NotNative("norm", f"{type(norm).__name__} is not an RMSNorm x / rms(x) without weight")
    return eps


def _probe(probe, chosen):
    return weightless_match(probe, WEIGHTLESS_RMS_NORM, weightless_rms_eps, "RMSNorm")


WEIGHTLESS_RMS_NORM = Part(
    slot="norm", name="weightless_rms_norm", code="norm_weightless_rms.py", provides="ModelWeightlessRMSNorm",
    reads=EPS_KEYS, probe=_probe, options=("NORM_EPS",),
    kernels=lambda m: (("npu_rms_norm / npu_add_rms_norm (residual add fused) on a weight of ones",), ()))
