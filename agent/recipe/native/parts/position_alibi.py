"""ALiBi positions (bloom's build_alibi_tensor, mpt's build_mpt_alibi_tensor): no rotary and no position table; each
head adds slope x key position to its attention scores (Press et al., "Train Short, Test Long", 2108.12409). The
slopes are read numerically from the architecture's own builder and held to the geometric sequence the file
computes (code/position_alibi.py: 2 ** (-bias_max * k / n) for a power-of-two head count n, the odd powers of the
next power of two appended for another count); the attention part adds the bias (parts/attention.py ALIBI_PAGED)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.part import Expr, Match, Part

BIAS_MAX = 8            # the slopes' exponent range of the ALiBi paper (mpt's config may set another)


def alibi_slopes(heads: int, bias_max: float = BIAS_MAX):
    """The heads' ALiBi slopes, float32: the code file's formula (code/position_alibi.py alibi_slopes)."""
    import math

    import torch

    power = 2 ** math.floor(math.log2(heads))
    slopes = [2.0 ** (-bias_max * k / power) for k in range(1, power + 1)]
    slopes += [2.0 ** (-bias_max * k / (2 * power)) for k in range(1, 2 * (heads - power), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def model_slopes(probe):
    """(the slopes the architecture's own ALiBi builder gives its heads, the config's bias max or None), or None for
    a model without ALiBi. Read as the difference of two adjacent keys' biases."""
    import torch

    modeling, heads = probe.modeling, probe.heads
    if hasattr(modeling, "build_mpt_alibi_tensor"):
        attn_config = getattr(probe.config, "attn_config", None)
        if not getattr(attn_config, "alibi", False):
            return None
        bias_max = attn_config.alibi_bias_max
        bias = modeling.build_mpt_alibi_tensor(heads, 2, bias_max)          # (heads, 1, 2): slope x (-1, 0)
        return (bias[:, 0, 1] - bias[:, 0, 0]).float(), bias_max
    if hasattr(modeling, "build_alibi_tensor") and not hasattr(probe.config, "alibi"):
        bias = modeling.build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)   # (heads, 1, 2): slope x (0, 1)
        return (bias[:, 0, 1] - bias[:, 0, 0]).float(), None
    if getattr(probe.config, "alibi", False):
        raise NotNative("position", f"{probe.model_type}'s ALiBi (config.alibi): slopes rounded to bfloat16 and the "
                                    "bias divided by sqrt(head_dim) inside the mask, which the file does not compute")
    return None


def _probe(probe, chosen):
    import torch

    found = model_slopes(probe)
    if found is None:
        return None
    slopes, bias_max = found
    probe.memo["alibi"] = True          # the attention's softmax scale is read under its ALiBi names
    want = alibi_slopes(probe.heads, bias_max or BIAS_MAX)
    if slopes.shape != want.shape or not torch.allclose(slopes, want, rtol=1e-5):
        raise NotNative("position", f"ALiBi slopes {slopes.tolist()[:4]}... are not the geometric sequence "
                                    f"2 ** (-{bias_max or BIAS_MAX} k / heads)")
    return Match(ALIBI, options={"ALIBI": True, "ALIBI_BIAS_MAX": Expr("config.attn_config.alibi_bias_max")
                                 if bias_max is not None else BIAS_MAX},
                 facts={"heads": probe.heads})


ALIBI = Part(
    slot="position", name="alibi", code="position_alibi.py", provides="ModelAlibiSlopes",
    reads=("num_attention_heads", "attn_config.alibi_bias_max"), probe=_probe, options=("ALIBI", "ALIBI_BIAS_MAX"),
    kernels=lambda m: ((), ("ALiBi slopes: computed once per model (plain torch), added to the attention scores by "
                            "the attention",)))
