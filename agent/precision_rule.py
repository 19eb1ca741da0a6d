"""The precision verdict's tolerance at one step (agent.measure.precision's rule), on its own so that the native
generator's self-check (agent.recipe.native.selfcheck, a layer below measure) holds a file by the same rule."""

from __future__ import annotations

import math

NOISE_FACTOR = 2.0
FLOOR = {"float32": 1e-4, "float16": 1e-3, "bfloat16": 1e-3}
# explicit mantissa bits: one unit in the last place of x is 2 ** (floor(log2 |x|) - bits)
MANTISSA_BITS = {"float32": 23, "float16": 10, "bfloat16": 7}


def tolerance(own_move: float, scale: float, dtype: str) -> float:
    """The logits tolerance at one step: NOISE_FACTOR x transformers' own |run dtype - float32| move there, at
    least FLOOR x the largest float32 logit."""
    return max(NOISE_FACTOR * own_move, FLOOR.get(dtype, FLOOR["bfloat16"]) * scale)


def compiled_step_allowance(scale: float, dtype: str) -> float:
    """What a compiled step adds to its tolerance: one unit in the last place of the run's dtype at the step's
    largest float32 |logit|. A graph compiled on the host (torch.compile under npugraph_ex / ge_graph) sums its
    reductions (the norms, the attention, the matmuls' blocks) in its compiler's order, not eager's: the same
    step's logits land one rounding of the run dtype away from the eager ones at that scale."""
    if scale <= 0 or not math.isfinite(scale):
        return 0.0
    return 2.0 ** (math.floor(math.log2(scale)) - MANTISSA_BITS.get(dtype, MANTISSA_BITS["bfloat16"]))
