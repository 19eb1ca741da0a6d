"""The precision verdict's tolerance at one step (agent.measure.precision's rule), on its own so that the native
generator's self-check (agent.recipe.native.selfcheck, a layer below measure) holds a file by the same rule."""

from __future__ import annotations

NOISE_FACTOR = 2.0
FLOOR = {"float32": 1e-4, "float16": 1e-3, "bfloat16": 1e-3}


def tolerance(own_move: float, scale: float, dtype: str) -> float:
    """The logits tolerance at one step: NOISE_FACTOR x transformers' own |run dtype - float32| move there, at
    least FLOOR x the largest float32 logit."""
    return max(NOISE_FACTOR * own_move, FLOOR.get(dtype, FLOOR["bfloat16"]) * scale)
