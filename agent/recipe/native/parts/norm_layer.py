"""LayerNorm: (x - mean) / sqrt(var + eps) * w (+ b), with or without a bias, and nemotron's LayerNorm1P (the weight
applied as 1 + w) — read numerically from every norm of the architecture's layers (input, post-attention,
pre/post-feedforward, q/k) and its final norm, its epsilon from the config key that holds it."""

from __future__ import annotations

import math

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.norm import model_norms
from agent.recipe.native.parts.norm_eps import EPS_KEYS, eps_follows
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import refuse_composite_norm



def probe_layer_norm(norm, width: int) -> tuple[bool, bool, float]:
    """(has a bias, weight applied as 1 + w, epsilon) of a LayerNorm of `width`; NotNative for anything else."""
    import torch
    import torch.nn.functional as F

    refuse_composite_norm(norm)
    weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    if not isinstance(weight, torch.nn.Parameter) or tuple(weight.shape) != (width,) or not isinstance(eps, float):
        raise NotNative("norm", f"{type(norm).__name__} has no weight of width {width} and float epsilon")
    if bias is not None and (not isinstance(bias, torch.nn.Parameter) or tuple(bias.shape) != (width,)):
        raise NotNative("norm", f"{type(norm).__name__}'s bias is not one of width {width}")
    gen = torch.Generator().manual_seed(6)
    x = 3.0 + torch.randn(3, width, generator=gen)          # a mean away from 0: LayerNorm and RMSNorm differ
    w, b = torch.randn(width, generator=gen), torch.randn(width, generator=gen)
    saved = [p.detach().clone() for p in (weight, bias) if p is not None]
    try:
        with torch.no_grad():
            weight.copy_(w)
            if bias is not None:
                bias.copy_(b)
            y = norm(x)
    finally:
        with torch.no_grad():
            for p, value in zip((q for q in (weight, bias) if q is not None), saved):
                p.copy_(value)
    for offset in (0.0, 1.0):
        want = F.layer_norm(x, (width,), w + offset, b if bias is not None else None, eps)
        if torch.allclose(y, want, rtol=1e-4, atol=1e-5):
            return bias is not None, offset == 1.0, eps
    raise NotNative("norm", f"{type(norm).__name__} is not a LayerNorm (x - mean) / std * w (+ b)")


TORCH_EPS = 1e-5        # nn.LayerNorm's default: the epsilon of an architecture that reads none from its config


def layer_norm_facts(probe) -> dict:
    """The model's norms, all LayerNorms of one kind: {"bias", "offset", "eps"}; NotNative otherwise."""
    if "layer_norms" not in probe.memo:
        # q/k norms per head only: the full-width q/k code (code/norm_qk_full.py) is an RMSNorm
        kinds = {probe_layer_norm(norm, width) for norm, width in model_norms(probe, full_width_qk=False)}
        if len(kinds) != 1:
            raise NotNative("norm", "LayerNorms of unequal kinds (bias, 1 + w or epsilon) in one model")
        bias, offset, eps = next(iter(kinds))
        config = probe.config.to_dict()
        key = next((k for k in EPS_KEYS if isinstance(config.get(k), float) and math.isclose(config[k], eps)
                    and eps_follows(probe, k, eps)), None)
        if key is None and not math.isclose(eps, TORCH_EPS):
            raise NotNative("norm", f"LayerNorm epsilon {eps} is no config key's ({', '.join(EPS_KEYS)}) nor torch's "
                                    "default")
        probe.memo["layer_norms"] = {"bias": bias, "offset": offset, "eps": key}
    return probe.memo["layer_norms"]


def _probe(probe, chosen):
    facts = layer_norm_facts(probe)
    return Match(LAYER_NORM, options={"NORM_BIAS": facts["bias"], "NORM_OFFSET": facts["offset"],
                                      "NORM_EPS": facts["eps"]}, facts=facts)       # None: FIXED_NORM_EPS


def _kernels(match):
    kind = "LayerNorm1P (1 + w)" if match.facts["offset"] else "LayerNorm" + (" with bias" if match.facts["bias"] else "")
    return (), (f"{kind}: plain torch F.layer_norm in float32 and the residual add (npu_rms_norm / npu_add_rms_norm "
                "are RMS only)",)


LAYER_NORM = Part(
    slot="norm", name="layer_norm", code="norm_layer.py", provides="ModelLayerNorm",
    reads=EPS_KEYS, probe=_probe, kernels=_kernels, options=("NORM_BIAS", "NORM_OFFSET", "NORM_EPS"))
