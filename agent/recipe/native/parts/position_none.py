"""No positions at all (nemotron_h's attention, NoPE on every layer; mamba2, no attention): the model builds no rotary table, no position
embedding and no ALiBi bias, and hands its attention layers no cos / sin — seen on one forward of the model. The file
then builds no table and its attention rotates nothing (code/causal_lm.py NO_POSITIONS, attention_fused.py ROTARY)."""

from __future__ import annotations

from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children


def mamba2_only(probe) -> bool:
    """Every layer one Mamba2 mixer behind one norm (mamba2's layers): no attention and no MLP in the model."""
    layout = probe.layout
    return bool(layout is not None and layout.one_mixer and probe.layers
                and all(set(children(layer)) == {"input_layernorm", "linear_attn"} for layer in probe.layers))


def handed_tables(probe) -> set:
    """The attention layers the model hands a rotary table (position_embeddings not None) on one forward; None where
    the model does not run here."""
    import torch

    handed = set()
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda module, args, kwargs, i=i: handed.add(i) if kwargs.get("position_embeddings") is not None else None,
        with_kwargs=True) for i, layer in enumerate(probe.layers) if "self_attn" in children(layer)]
    try:
        with torch.no_grad():
            probe.model(input_ids=torch.arange(4)[None] % probe.config.vocab_size)
    except Exception:  # noqa: BLE001 - a model that does not run here: not this part's to read
        return None
    finally:
        for hook in hooks:
            hook.remove()
    return handed


def _probe(probe, chosen):
    base = probe.base
    if base is None or {"rotary_emb", "embed_positions"} & set(children(base)) or getattr(base, "rotary_emb", None):
        return None
    if getattr(probe.config, "alibi", None):
        return None
    if not any("self_attn" in children(layer) for layer in probe.layers):
        # no attention at all (mamba2): no table to build; else not this part's to read
        return Match(NO_POSITIONS, options={"NO_POSITIONS": True}) if mamba2_only(probe) else None
    if handed_tables(probe) != set():
        return None
    return Match(NO_POSITIONS, options={"NO_POSITIONS": True})


NO_POSITIONS = Part(
    slot="position", name="no_positions", code=None, provides=None, reads=(), probe=_probe,
    options=("NO_POSITIONS",),
    kernels=lambda m: ((), ("no positions: the attention attends without a rotary or a bias (NoPE on every layer)",)))
