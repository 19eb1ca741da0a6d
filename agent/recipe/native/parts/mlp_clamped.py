"""The dense MLP with gpt_oss's clamped swiglu over gate / up halves, no biases (minimax_m3's dense layers:
down((up + 1) * gate * sigmoid(alpha * gate)), gate clamped above at swiglu_limit, up to +-swiglu_limit), its width
read off the module (minimax_m3: dense_intermediate_size); the formula checked numerically."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.mlp import dense_mlps
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

WIDTH_KEYS = ("intermediate_size", "dense_intermediate_size")


def _clamped(probe, chosen):
    import torch

    from agent.recipe.native.parts.moe import _clamp_of, _clamped_halves

    found = dense_mlps(probe, chosen)
    if not found:
        return None
    source, mlps = found
    if not any(getattr(mlp, "swiglu_limit", getattr(mlp, "limit", None)) is not None for mlp in mlps):
        return None         # no clamp: the gated MLP's
    widths = set()
    for mlp in mlps:
        m = children(mlp)
        clamp = _clamp_of(mlp, source.config)
        if set(m) != {"gate_up_proj", "down_proj"} or clamp is None \
                or any(getattr(p, "bias", None) is not None for p in m.values()):
            raise NotNative("mlp", f"{type(mlp).__name__} ({sorted(m)}): a clamped swiglu other than gate_up / down "
                                   "without biases at the config's swiglu_limit / swiglu_alpha")
        x = torch.randn(3, source.hidden, generator=torch.Generator().manual_seed(17)) * 4
        with torch.no_grad():
            got, want = mlp(x), m["down_proj"](_clamped_halves(m["gate_up_proj"](x), *clamp))
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise NotNative("mlp", f"{type(mlp).__name__} is not down(clamped swiglu of its gate_up halves)")
        widths.add(m["down_proj"].in_features)
    keys = [k for k in WIDTH_KEYS if widths == {getattr(source.config, k, None)}]
    if len(keys) != 1:
        raise NotNative("mlp", f"the dense MLPs' width {sorted(widths)} is not one of the config's {' / '.join(WIDTH_KEYS)}")
    return Match(CLAMPED_MLP, options={"MLP_WIDTH_KEY": keys[0]})


CLAMPED_MLP = Part(
    slot="mlp", name="clamped_gated_mlp", code="mlp_clamped.py", provides="ModelClampedMLP",
    reads=("hidden_size", "intermediate_size / dense_intermediate_size", "swiglu_limit", "swiglu_alpha"),
    probe=_clamped, options=("MLP_WIDTH_KEY",),
    kernels=lambda m: ((), ("dense MLP clamped swiglu (limit / alpha, up + 1) in plain torch: npu_swiglu has no "
                            "clamp",)))
