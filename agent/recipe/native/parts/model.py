"""The causal-LM skeleton (code/causal_lm.py): the model (embedding, layers, final norm, rotary tables), the
ForCausalLM with its head, a loader of checkpoints as they are stored (transformers' own renames of this
architecture's tensor names), get_cache_info, process_weights_after_loading and the parallel rules."""

from __future__ import annotations

import re

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.norm import LAYER_NORMS
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

MODEL_CHILDREN = {"embed_tokens", "layers", "norm", "rotary_emb", "embed_positions"}
LAYER_CHILDREN = {"self_attn", "mlp", *LAYER_NORMS}


def _name(pattern: str) -> str:
    """A pattern as the dotted name it matches ("^model\\.x$" -> "model.x")."""
    return pattern.strip("^$").replace("\\.", ".")


def _plain(pattern: str) -> bool:
    return "(" not in pattern and "\\1" not in pattern


def checkpoint_renames(model_type: str) -> tuple[tuple[str, str], ...]:
    """transformers' renames of the checkpoint's tensor names for `model_type` (regex, replacement), in the
    order it applies them; a conversion other than a rename or the experts' merge (the sparse-MoE part's) is not
    native: the loader reads the checkpoint's names."""
    from transformers import conversion_mapping

    renames = []
    for rule in conversion_mapping.get_checkpoint_conversion_mapping(model_type) or []:
        sources, targets = list(rule.source_patterns), list(rule.target_patterns)
        if type(rule).__name__ == "WeightRenaming":
            if getattr(rule, "scope_prefix", None) or not all(map(_plain, sources + targets)):
                raise NotNative("model", f"transformers renames {sources} -> {targets} for {model_type} in a way "
                                         "the native loader does not write (a scope or a captured group)")
            renames += [(source, targets[0].replace("\\.", ".").lstrip("^")) for source in sources]
        elif [_name(source) for source in sources] == [_name(target) for target in targets]:
            continue          # a conversion of the stored tensor that keeps its name (5.0's gpt_oss: an alignment)
        elif not all("experts.*." in source for source in sources):
            raise NotNative("model", f"transformers converts checkpoint tensors {sources} -> {targets} for "
                                     f"{model_type}: the native loader reads the checkpoint's names")
        else:
            # the experts' merge (the sparse-MoE block loads them itself) under another block name in the
            # checkpoint (transformers 5.0's mixtral: block_sparse_moe.experts.* -> mlp.experts.*)
            stored = sources[0].split("experts.*.", 1)[0].lstrip("^").replace("\\.", ".").strip(".")
            built = targets[0].split("experts.", 1)[0].lstrip("^").replace("\\.", ".").strip(".")
            rename = (f"\\.{re.escape(stored)}\\.experts\\.", f".{built}.experts.")
            if stored and built and stored != built and rename not in renames:
                renames.append(rename)
    for pattern, _ in renames:
        re.compile(pattern)
    return tuple(renames)


def _probe(probe, chosen):
    layout = probe.layout
    if layout is not None and layout.refusal:
        raise NotNative("model", layout.refusal)
    top = children(probe.model)
    if set(top) - {"model", "lm_head"}:
        raise NotNative("model", f"heads other than lm_head: {sorted(set(top) - {'model', 'lm_head'})}")
    if probe.base is None or set(children(probe.base)) - MODEL_CHILDREN:
        extra = sorted(set(children(probe.base)) - MODEL_CHILDREN) if probe.base is not None else ["(no .model)"]
        raise NotNative("model", f"modules the native model does not have: {extra}")
    for index, layer in enumerate(probe.layers):
        names = children(layer)
        unknown = set(names) - LAYER_CHILDREN
        if unknown:
            raise NotNative("decoder layer", f"layer {index} has {sorted(unknown)}")
        if "self_attn" not in names or "mlp" not in names:
            raise NotNative("decoder layer", f"layer {index} has no self_attn / mlp")
    renames = checkpoint_renames(probe.model_type)
    if layout is None:
        return Match(CAUSAL_LM, options={"CHECKPOINT_RENAMES": renames})
    # the root under another name: the stored names to the skeleton's, after transformers' own renames
    return Match(CAUSAL_LM, options={"CHECKPOINT_RENAMES": renames + layout.renames,
                                     "TRANSPOSED_WEIGHTS": layout.transposed},
                 facts={"transposed": bool(layout.transposed)})


CAUSAL_LM = Part(
    slot="model", name="causal_lm", code="causal_lm.py", provides=None,
    reads=("num_hidden_layers", "hidden_size", "vocab_size", "rms_norm_eps", "max_position_embeddings", "head_dim",
           "num_attention_heads", "num_key_value_heads", "intermediate_size"),
    probe=_probe, options=("CHECKPOINT_RENAMES", "STACKED_PARAMS", "MLA", "MOE", "TRANSPOSED_WEIGHTS"),
    kernels=lambda m: ((), ("Conv1D weights (stored [in, out]) transposed once at load into the parallel linears",)
                       if m.facts.get("transposed") else ()))
