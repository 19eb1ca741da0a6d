"""The head: lm_head as module.linear's ColumnParallelLinear over lmhead_tp_group, tied to the input embedding
when the checkpoint's config says so (always written: one file serves tied and untied checkpoints), with a bias
where the architecture's head has one, logits
soft-capped where the architecture reads config.final_logit_softcapping (in its forward, or a module of its own:
inkling2's logit_softcap)."""

from __future__ import annotations

from agent.recipe.native.parts.part import Expr, Match, Part


def final_softcaps(probe) -> set:
    """The names of the causal LM's weightless children that soft-cap the logits by config.final_logit_softcapping
    (inkling2's logit_softcap: c * tanh(x / c)), which this part writes (FINAL_SOFTCAP)."""
    import torch

    from agent.recipe.native.parts.probe import children

    cap = getattr(probe.config, "final_logit_softcapping", None)
    if not isinstance(cap, (int, float)) or not cap:
        return set()
    x = torch.linspace(-4 * cap, 4 * cap, 97).view(1, 97)
    found = set()
    for name, child in children(probe.model).items():
        if name in ("model", "lm_head") or any(True for _ in child.parameters()):
            continue
        try:
            with torch.no_grad():
                capped = child(x)
        except Exception:  # noqa: BLE001 - not a map of the logits alone
            continue
        if isinstance(capped, torch.Tensor) and torch.allclose(capped, torch.tanh(x / cap) * cap, rtol=1e-5, atol=1e-6):
            found.add(name)
    return found


def head_bias(probe):
    """Whether the output head has a bias (gptj, codegen, phi): Expr(config.<key>) where toggling a bias key of the
    config gives or takes it (ernie4_5_moe's use_bias), else the literal."""
    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.mlp import BIAS_KEYS

    def has_bias(model) -> bool:
        return getattr(model.get_output_embeddings(), "bias", None) is not None

    present = has_bias(probe.model)
    for key in BIAS_KEYS:
        value = probe.config.to_dict().get(key)
        if not isinstance(value, bool) or value != present:
            continue
        try:
            other = probe.variant({key: not value})
        except NotNative:
            continue
        if has_bias(other.model) != present:
            return Expr(f"config.{key}")
    return present


def ties_when_told(probe) -> bool:
    """Whether transformers' model of the config with tie_word_embeddings set holds one tensor for lm_head and the
    input embedding (moshi's does not: its embedding has vocab_size + 1 rows and no tied keys); True where that config
    cannot be built (not this reading's to judge)."""
    from agent.recipe.native.not_native import NotNative

    try:
        told = getattr(probe.config, "tie_word_embeddings", False)
        tied = probe if told else probe.variant({"tie_word_embeddings": True})
    except NotNative:
        return True
    head, embedding = tied.model.get_output_embeddings(), tied.model.get_input_embeddings()
    return getattr(head, "weight", None) is getattr(embedding, "weight", None)


def _probe(probe, chosen):
    from agent.recipe.native.parts.probe import children

    if "head_transform" in children(probe.model):
        return None         # a transform before the head: parts/head_transform.py's (its refusal names why)
    return read_head(probe)


def read_head(probe) -> Match:
    """The output head's match: its soft-cap, bias and tie."""
    softcap = "final_logit_softcapping" in probe.config.to_dict()
    bias = head_bias(probe)
    # an architecture whose class ties nothing (nemotron_h's empty _tied_weights_keys) keeps lm_head untied even where
    # its config says tie_word_embeddings
    keys = getattr(type(probe.model), "_tied_weights_keys", None)
    never = keys is not None and len(keys) == 0
    if keys is None:
        # no table of tied keys (moshi's class): whether it ties, read on its model built tied
        never = not ties_when_told(probe)
    return Match(LM_HEAD, options={"FINAL_SOFTCAP": softcap, **({"LM_HEAD_BIAS": bias} if bias is not False else {}),
                                   **({"NEVER_TIED": True} if never else {})},
                 facts={"softcap": getattr(probe.config, "final_logit_softcapping", None) is not None})


def _variants(match, probe):
    """The file serves the other tie: a tied checkpoint (no lm_head.weight) from an untied one and back; not where the
    architecture never ties (a tied checkpoint, without lm_head.weight, is one transformers serves with a random head:
    the file refuses it naming the missing tensor)."""
    if match.options.get("NEVER_TIED"):
        return []
    return [("tie_word_embeddings", {"tie_word_embeddings": not bool(getattr(probe.config, "tie_word_embeddings", False))})]


LM_HEAD = Part(
    slot="head", name="lm_head", code=None, provides=None,
    reads=("vocab_size", "tie_word_embeddings", "final_logit_softcapping", "use_bias / mlp_bias / enable_bias"),
    probe=_probe,
    options=("FINAL_SOFTCAP", "LM_HEAD_BIAS", "NEVER_TIED"), variants=_variants,
    kernels=lambda m: ((), ("final logit soft-capping: plain torch tanh",) if m.facts["softcap"] else ()))
