"""The config key a model's norms' epsilon follows: EPS_KEYS the names architectures give it, eps_follows the check
that a config with the key changed changes the norms' (the LayerNorm, weightless-norm and RMSNorm parts read it)."""

from __future__ import annotations

import math

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.probe import children

# config keys that hold a LayerNorm's epsilon, as the architectures name it
EPS_KEYS = ("layer_norm_eps", "norm_epsilon", "layer_norm_epsilon", "norm_eps", "rms_norm_eps")


def stated_eps(norm, hidden: int) -> float:
    """The epsilon a norm module holds (`eps`, or `variance_epsilon`)."""
    return getattr(norm, "eps", getattr(norm, "variance_epsilon", 0.0))


def eps_follows(probe, key: str, eps: float, eps_of=stated_eps, rel_tol: float = 1e-9) -> bool:
    """Whether the model's norm epsilon is config.<key>'s: a config with the key changed changes the final norm's
    (read by `eps_of(norm, hidden)`)."""
    try:
        other = probe.variant({key: eps * 10})
    except NotNative:
        return False
    final = getattr(other.base, "norm", None) or children(other.layers[0]).get("input_layernorm")
    return final is not None and math.isclose(eps_of(final, other.hidden), eps * 10, rel_tol=rel_tol)
