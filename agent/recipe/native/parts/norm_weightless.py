"""LayerNorm without a weight or bias (olmo's): (x - mean) / sqrt(var + eps), its epsilon measured numerically (the
module keeps it in its code, not as an attribute) and read from the config key that holds it, or torch's default."""

from __future__ import annotations

import math

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.norm import model_norms
from agent.recipe.native.parts.norm_eps import EPS_KEYS, eps_follows
from agent.recipe.native.parts.norm_layer import TORCH_EPS
from agent.recipe.native.parts.part import Match, Part


def weightless_eps(norm, width: int) -> float:
    """The epsilon of `norm`, a LayerNorm of `width` with no parameters; NotNative for anything else. Measured on an
    input of variance about 1e-5, where the epsilon moves the output: y = z * s / sqrt(s^2 + eps)."""
    import torch
    import torch.nn.functional as F

    if list(norm.parameters()):
        raise NotNative("norm", f"{type(norm).__name__} has parameters: not a LayerNorm without weight")
    gen = torch.Generator().manual_seed(7)
    z = torch.randn(3, width, generator=gen, dtype=torch.float64)
    z = (z - z.mean(-1, keepdim=True)) / z.var(-1, unbiased=False, keepdim=True).sqrt()
    scale = 1e-5 ** 0.5
    with torch.no_grad():
        small = norm((3.0 + scale * z).float()).double()
        ratio = (small * z).mean(-1) / (z * z).mean(-1)         # s / sqrt(s^2 + eps), per row
    eps = float((scale ** 2 * (1.0 / ratio.pow(2) - 1.0)).mean())
    x = 3.0 + torch.randn(3, width, generator=gen)
    with torch.no_grad():
        y = norm(x)
    if not (eps > 0 and torch.allclose(y, F.layer_norm(x, (width,), None, None, eps), rtol=1e-4, atol=1e-5)):
        raise NotNative("norm", f"{type(norm).__name__} is not a LayerNorm (x - mean) / std without weight")
    return eps


def weightless_match(probe, part: Part, eps_of, kind: str) -> Match | None:
    """`part`'s match where no norm of the model has a weight: one epsilon for all, measured by `eps_of` (norm, width),
    read from the config key that holds it (eps_follows) or torch's default; None where a norm has a weight (the other
    norm parts'). `kind` names the norm in a refusal."""
    norms = list(model_norms(probe, full_width_qk=False))
    if not norms or any(list(norm.parameters()) for norm, _ in norms):
        return None
    epsilons = [eps_of(norm, width) for norm, width in norms]
    eps = epsilons[0]
    if any(not math.isclose(e, eps, rel_tol=1e-2) for e in epsilons):
        raise NotNative("norm", f"{kind}s without weight of unequal epsilons in one model")
    config = probe.config.to_dict()
    key = next((k for k in EPS_KEYS if isinstance(config.get(k), float) and math.isclose(config[k], eps, rel_tol=1e-2)
                and eps_follows(probe, k, config[k], eps_of, rel_tol=1e-2)), None)
    if key is None and not math.isclose(eps, TORCH_EPS, rel_tol=1e-2):
        raise NotNative("norm", f"{kind} without weight of epsilon {eps:.3g}: no config key's ({', '.join(EPS_KEYS)}) "
                                "nor torch's default")
    return Match(part, options={"NORM_EPS": key}, facts={"eps": key})   # None: FIXED_NORM_EPS


def _probe(probe, chosen):
    return weightless_match(probe, WEIGHTLESS_LAYER_NORM, weightless_eps, "LayerNorm")


WEIGHTLESS_LAYER_NORM = Part(
    slot="norm", name="weightless_layer_norm", code="norm_weightless.py", provides="ModelWeightlessLayerNorm",
    reads=EPS_KEYS, probe=_probe, options=("NORM_EPS",),
    kernels=lambda m: ((), ("LayerNorm without weight: plain torch F.layer_norm in float32 and the residual add "
                            "(npu_rms_norm / npu_add_rms_norm are RMS only)",)))
