"""The parallel hybrid decoder layer (falcon_h1's): one norm, a Mamba2 mixer (the layout's linear_attn) and the softmax
attention side by side on its output, h + s_out mixer(norm(h)) + a_out attn(a_in norm(h)), then h + mlp(norm2(h)) —
read from the layers' children (every layer holds self_attn, linear_attn and mlp behind two norms) and held
numerically to the architecture's own layer with the mixer, the attention and the MLP replaced by fixed maps (the
attention's a nonlinear one, so its input multiplier is told from its output's). The multipliers are config keys the
file reads at run time (code/block_parallel_hybrid.py), each confirmed on a config with them moved off 1."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

KIND = "decoder layer"
# the code's option -> the config key of that branch multiplier (falcon_h1's names)
MULTIPLIER_KEYS = {"ATTENTION_IN_MULTIPLIER": "attention_in_multiplier",
                   "ATTENTION_OUT_MULTIPLIER": "attention_out_multiplier",
                   "MIXER_OUT_MULTIPLIER": "ssm_out_multiplier"}
# the values the keys are read at (1 hides a multiplier), distinct so that no two can stand in for each other
MOVED = {"attention_in_multiplier": 1.5, "attention_out_multiplier": 0.75, "ssm_out_multiplier": 0.625}
NORMS = ("input_layernorm", "post_attention_layernorm")


def is_parallel_hybrid(layer) -> bool:
    names = children(layer)
    return {"self_attn", "linear_attn", "mlp", *NORMS} <= set(names)


def hybrid_residual(layer, hidden: int, multipliers: dict) -> bool:
    """The layer computes h = x + s_out mix(n1(x)) + a_out attn(a_in n1(x)), then h + mlp(n2(h)) (`multipliers`:
    config key -> value, 1 for a key not held): checked with its mixer, attention and MLP replaced by fixed maps."""
    import torch

    gen = torch.Generator().manual_seed(10)
    a, s, m = (torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5 for _ in range(3))
    x = torch.randn(1, 3, hidden, generator=gen)
    attention, mixer, mlp = layer.self_attn, layer.linear_attn, layer.mlp
    saved = attention.forward, mixer.forward, mlp.forward

    def attend(t):
        return torch.tanh(t @ a)        # nonlinear: its input's multiplier is not its output's

    try:
        attention.forward = lambda hidden_states, *args, **kwargs: (attend(hidden_states), None)
        mixer.forward = lambda hidden_states, *args, **kwargs: hidden_states @ s
        mlp.forward = lambda hidden_states, *args, **kwargs: hidden_states @ m
        with torch.no_grad():
            got = layer(x, attention_mask=None, position_ids=None, position_embeddings=None)
    except Exception:  # noqa: BLE001 - another call shape: not the layer this part writes
        return False
    finally:
        attention.forward, mixer.forward, mlp.forward = saved
    got = got[0] if isinstance(got, tuple) else got
    with torch.no_grad():
        normed = layer.input_layernorm(x)
        h = (x + multipliers["ssm_out_multiplier"] * (normed @ s)
             + multipliers["attention_out_multiplier"] * attend(multipliers["attention_in_multiplier"] * normed))
        want = h + layer.post_attention_layernorm(h) @ m
    return torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def _number(config, key):
    value = getattr(config, key, None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _probe(probe, chosen):
    hybrid = [is_parallel_hybrid(layer) for layer in probe.layers]
    if not any(hybrid):
        return None
    if not all(hybrid):
        raise NotNative(KIND, f"parallel hybrid layers {[i for i, h in enumerate(hybrid) if h]} beside layers of "
                              "another shape: no part writes both")
    held = {key for key in MULTIPLIER_KEYS.values() if _number(probe.config, key) is not None}
    own = {key: _number(probe.config, key) if key in held else 1.0 for key in MULTIPLIER_KEYS.values()}
    if not hybrid_residual(probe.layers[0], probe.hidden, own):
        raise NotNative(KIND, "the parallel hybrid layer is not h + s_out mixer(norm(h)) + a_out attn(a_in norm(h)), "
                              "then h + mlp(norm2(h))" + (f" (its multipliers {sorted(held)})" if held else ""))
    if held:
        # at 1 a multiplier cannot be seen: read on the config with every held key moved off it
        moved = probe.variant({key: MOVED[key] for key in held})
        if not hybrid_residual(moved.layers[0], moved.hidden, {key: MOVED[key] if key in held else 1.0
                                                                 for key in MULTIPLIER_KEYS.values()}):
            raise NotNative(KIND, f"the parallel hybrid layer's branches are not scaled by config {sorted(held)}")
    options = {option: key if key in held else None for option, key in MULTIPLIER_KEYS.items()}
    return Match(PARALLEL_HYBRID, options={**options, "LAYER_CACHES": True}, facts={"held": sorted(held)})


def _variants(match, probe):
    """Another checkpoint's branch multipliers: the file reads each from the config."""
    held = match.facts["held"]
    return [("hybrid multipliers", {key: 0.5 * _number(probe.config, key) + 0.25 for key in held})] if held else []


PARALLEL_HYBRID = Part(
    slot="block", name="parallel_hybrid", code="block_parallel_hybrid.py", provides="ModelParallelHybridDecoderLayer",
    reads=("hidden_size", "rms_norm_eps", *MULTIPLIER_KEYS.values()), probe=_probe,
    options=("ATTENTION_IN_MULTIPLIER", "ATTENTION_OUT_MULTIPLIER", "MIXER_OUT_MULTIPLIER", "LAYER_CACHES"),
    variants=_variants,
    kernels=lambda m: ((), ("parallel Mamba2 mixer + attention: their outputs scaled and summed in plain torch",)))
