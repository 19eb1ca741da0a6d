"""What an architecture is, as one part per slot: `derive(config) -> Composition`, from the architecture's own
transformers code and config (agent.recipe.native.parts: each part's probe reads the transformers model built on
a shrunk copy of the config). A slot no part recognises raises `NotNative` with the layer kind and the parts'
reasons: the recipe keeps the adapter."""

from __future__ import annotations

from dataclasses import replace

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts import PARTS, SLOTS, Composition
from agent.recipe.native.parts.part import Expr
from agent.recipe.native.parts.probe import Probe

# the layer kind a slot's refusal names (the report's and the README's fell_back)
KINDS = {"model": "model", "embedding": "model", "norm": "norm", "position": "position", "attention": "attention",
         "moe": "moe", "mlp": "mlp", "block": "decoder layer", "head": "model",
         "mtp": "model", "linear_attention": "linear attention"}


def _optional(slot: str, chosen: dict) -> bool:
    """A slot that may stay empty: no sparse-MoE layers; no dense MLP where every layer is a sparse-MoE block."""
    if slot in ("moe", "mtp", "linear_attention"):       # linear_attention: a hybrid's other layers
        return True
    return slot == "mlp" and chosen.get("moe") is not None and chosen["moe"].options.get("MOE_LAYERS") == "all"


def compose(probe: Probe) -> Composition:
    chosen: dict = {}
    for slot in SLOTS:
        refusals = []
        for part in (p for p in PARTS if p.slot == slot):
            try:
                match = part.probe(probe, chosen)
            except NotNative as exc:
                refusals.append(exc)
                continue
            if match is not None:
                chosen[slot] = match
                break
        if slot in chosen:
            continue
        if refusals:
            first = refusals[0]
            raise NotNative(first.kind, "; ".join(dict.fromkeys(r.reason for r in refusals)))
        if not _optional(slot, chosen):
            raise NotNative(KINDS[slot], f"no part of the generator is this architecture's {slot}")
    composition = Composition(probe.model_type, chosen)
    return composition


def derive(config_dict: dict) -> Composition:
    """The composition of the architecture of `config_dict` (a checkpoint's config.json, text level), with the
    config variants its file must also serve (`variants`: label -> config changes). An image-text checkpoint is
    its text decoder's (agent.recipe.text_decoder): the decoder's config, its tensors read under their names in
    the image-text checkpoint."""
    from agent.recipe.text_decoder import NotServedByText, text_decoder

    try:
        decoder = text_decoder(config_dict)
    except NotServedByText as exc:
        raise NotNative("model", f"image-text model: {exc}") from exc
    if decoder is not None:
        return read_under_image_text_names(derive(decoder.config), decoder.renames, decoder.fixed_in_code)
    probe = Probe(config_dict)
    composition = compose(probe)
    variants = []
    for label, changes in composition.variants(probe):
        try:
            probe.variant(changes)
        except Exception:  # noqa: BLE001 - a config transformers does not build: no such checkpoint to serve
            continue
        if (label, changes) not in variants:        # two parts reading one key (a bias for attention and MLP)
            variants.append((label, changes))
    return Composition(composition.model_type, composition.matches, tuple(variants))


def read_under_image_text_names(composition: Composition, renames: tuple, fixed_in_code: tuple = ()) -> Composition:
    """`composition` whose loader first takes an image-text checkpoint's names to the causal LM's (`renames`), and
    whose code reads each key of `fixed_in_code` ((key, value): one the decoder's own config class has not, its
    value what the decoder's code fixes) with that value as its default: the recipe builds on the decoder's own
    config class, which has no such attribute."""
    fixed = dict(fixed_in_code)

    def read(value):
        key = value.code[len("config."):] if isinstance(value, Expr) and value.code.startswith("config.") else None
        return Expr(f'getattr(config, "{key}", {fixed[key]!r})') if key in fixed else value

    matches = {slot: replace(match, options={name: read(value) for name, value in match.options.items()})
               for slot, match in composition.matches.items()}
    model = matches["model"]
    options = {**model.options, "CHECKPOINT_RENAMES": tuple(renames) + tuple(model.options.get("CHECKPOINT_RENAMES", ()))}
    return replace(composition, matches={**matches, "model": replace(model, options=options)})
