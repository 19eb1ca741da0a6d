"""The causal-LM skeleton (code/causal_lm.py): the model (embedding, layers, final norm, rotary tables), the
ForCausalLM with its head, a loader of checkpoints as they are stored (transformers' own renames of this
architecture's tensor names), get_cache_info, process_weights_after_loading and the parallel rules."""

from __future__ import annotations

import re

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.head import final_softcaps
from agent.recipe.native.parts.layout import weightless_lists
from agent.recipe.native.parts.linear_attention import refuse_recurrent_attention, stored_conversion
from agent.recipe.native.parts.norm import LAYER_NORMS
from agent.recipe.native.parts.norm_roles import norm_roles
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

MODEL_CHILDREN = {"embed_tokens", "layers", "norm", "rotary_emb", "embed_positions", "embed_norm"}
LAYER_CHILDREN = {"self_attn", "linear_attn", "mlp", *LAYER_NORMS}   # linear_attn: parts/linear_attention.py


def _name(pattern: str) -> str:
    """A pattern as the dotted name it matches ("^model\\.x$" -> "model.x")."""
    return pattern.strip("^$").replace("\\.", ".")


def _plain(pattern: str) -> bool:
    return "(" not in pattern and "\\1" not in pattern


def checkpoint_renames(model_type: str, class_name: str | None = None) -> tuple[tuple[str, str], ...]:
    """transformers' renames of the checkpoint's tensor names for `model_type` (regex, replacement), in the
    order it applies them — those of the causal LM's class `class_name` where transformers keys them by class
    (GPTNeoXForCausalLM's embed_out), as it looks them up; a conversion other than a rename or the experts'
    merge (the sparse-MoE part's) is not native: the loader reads the checkpoint's names."""
    from transformers import conversion_mapping

    rules = (class_name and conversion_mapping.get_checkpoint_conversion_mapping(class_name)) or \
        conversion_mapping.get_checkpoint_conversion_mapping(model_type)
    renames = []
    for rule in rules or []:
        sources, targets = list(rule.source_patterns), list(rule.target_patterns)
        if type(rule).__name__ == "PrefixChange" and len(sources) == len(targets) == 1:
            # a prefix added or removed (one captured group): the loader's re.sub applies it as transformers does
            renames.append((sources[0], targets[0].replace("\\.", ".")))
        elif type(rule).__name__ == "WeightRenaming":
            if getattr(rule, "scope_prefix", None) or not all(map(_plain, sources + targets)):
                raise NotNative("model", f"transformers renames {sources} -> {targets} for {model_type} in a way "
                                         "the native loader does not write (a scope or a captured group)")
            renames += [(source, targets[0].replace("\\.", ".").lstrip("^")) for source in sources]
        elif type(rule).__name__ == "PrefixChange" and len(targets) == 1 \
                and all(source.endswith("(.+)") and source.count("(") == 1 for source in sources) \
                and targets[0].endswith("\\1") and "(" not in targets[0]:
            # a prefix the checkpoint stores its tensors under (apertus1p5_text: model.language_model.*): the rest
            # of the name kept as it is
            renames += [(source, targets[0].replace("\\.", ".").lstrip("^")) for source in sources]
        elif [_name(source) for source in sources] == [_name(target) for target in targets]:
            continue          # a conversion of the stored tensor that keeps its name (5.0's gpt_oss: an alignment)
        elif stored_conversion(rule):
            continue          # linear-attention tensors the linear-attention part loads as stored (its STACKED_PARAMS)
        elif fused_qkv_split(rule):
            # [q; k; v] stored as one tensor (sarvam_moe's query_key_value): the native merged_qkv_proj, whose
            # loader splits a tensor given without a shard by the config's heads as transformers' Split does
            renames.append((sources[0], "merged_qkv_proj"))
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


def fused_qkv_split(rule) -> bool:
    """A conversion that splits one checkpoint tensor into q_proj, k_proj, v_proj in that order along the output
    dim (transformers' Split: each piece the size of its projection)."""
    operations = getattr(rule, "operations", None) or []
    return (len(rule.source_patterns) == 1 and _plain(rule.source_patterns[0])
            and [_name(t) for t in rule.target_patterns] == ["q_proj", "k_proj", "v_proj"]
            and [type(op).__name__ for op in operations] == ["Split"] and getattr(operations[0], "dim", None) == 0)


def refuse_own_parameters(probe) -> None:
    """NotNative naming the parameters the base model or a decoder layer holds directly (zaya's
    input_hidden_states_scale / _bias on its embedding): no part reads them, and as built they are ones and zeros
    that a probe's measurement would not see."""
    own = sorted(name for name, param in probe.base._parameters.items() if param is not None)
    if own:
        raise NotNative("model", f"{type(probe.base).__name__} has parameters {own} of its own, which the file does "
                                 "not add")
    for index, layer in enumerate(probe.layers):
        own = sorted(name for name, param in layer._parameters.items() if param is not None)
        if own:
            raise NotNative("decoder layer", f"layer {index} has parameters {own} of its own, which the file does "
                                             "not add")


def refuse_non_causal(probe) -> None:
    """NotNative where the model's logits at a token follow a later token (xlm's default causal false, xlnet's
    attn_type "bi": attention over the whole sequence): every attention the file writes is causal, and a decode step
    cannot see the tokens after it. Read on two prompts that differ in their last token alone, the earlier tokens'
    logits held to 1e-4 of the largest (the self-check's float32 scale); a model that does not run on input_ids here
    is left to the other checks."""
    import torch

    vocab = probe.config.vocab_size
    ids = torch.tensor([[3, 5, 7, 11]]) % vocab
    later = ids.clone()
    later[0, -1] = (ids[0, -1] + 1) % vocab
    try:
        with torch.no_grad():
            logits = [probe.model(input_ids=prompt).logits for prompt in (ids, later)]
    except Exception:  # noqa: BLE001 - not callable so: the layer and attention parts read the model
        return
    # the earlier tokens' logits move by rounding alone in a causal model (an MoE's grouped matmuls over other
    # rows: 5e-7 of the largest logit, mixtral's); a non-causal one moves them by percents (xlm 2%)
    moved = (logits[0][:, :-1] - logits[1][:, :-1]).abs().max()
    if moved > 1e-4 * logits[0].abs().max():
        raise NotNative("attention", "the logits at a token follow a later token: the attention is not causal (an "
                                     "encoder's, or a masked LM's), which no part writes")


def heads_text(model, heads) -> str:
    """The refusal of a causal LM with children besides its base model and lm_head: each with its class, and the
    output embedding where it is not lm_head (modernbert-decoder's decoder, after its lm_head's dense / act / norm
    transform; xlm's pred_layer.proj)."""
    top = dict(model.named_children())
    output = model.get_output_embeddings()
    path = next((name for name, module in model.named_modules() if module is output), None)
    prefix = getattr(model, "base_model_prefix", "")
    text = "heads other than lm_head: " + ", ".join(f"{name} ({type(top[name]).__name__})"
                                                    for name in sorted(heads) if name != prefix)
    if prefix in heads:
        text += f" beside the base model under {prefix}"
    if path is not None and path != "lm_head":
        text += f"; the logits from {path}" + (f" after lm_head ({type(top['lm_head']).__name__})"
                                               if "lm_head" in top else "")
    return text


def _probe(probe, chosen):
    refuse_non_causal(probe)            # before the layout's reading: no layout of it makes it causal
    layout = probe.layout
    if layout is not None and layout.refusal:
        raise NotNative("model", layout.refusal)
    if getattr(probe.config, "apply_residual_connection_post_layernorm", False):
        raise NotNative("decoder layer", "apply_residual_connection_post_layernorm: the residual taken after the norm")
    if getattr(probe.config, "clip_qkv", None):
        # olmo's, olmoe's: q/k/v clamped to +-clip_qkv after the projection; random probe weights never reach the clamp,
        # so the self-check could not tell a file without it
        raise NotNative("attention", f"clip_qkv {probe.config.clip_qkv}: q/k/v clamped after the projection, which no "
                                     "part writes")
    refuse_recurrent_attention(probe)
    top = children(probe.model)
    # head_transform: a transform before the output head the layout read (parts/head_transform.py holds it)
    heads = set(top) - {"model", "lm_head", "head_transform"} - final_softcaps(probe)
    if heads:
        raise NotNative("model", heads_text(probe.model, heads))
    # a list of weightless rotary tables (granite_swa's rotary_embs): the position part's to read
    tables = weightless_lists(probe.base) if probe.base is not None else set()
    if probe.base is None or set(children(probe.base)) - MODEL_CHILDREN - tables:
        extra = sorted(set(children(probe.base)) - MODEL_CHILDREN - tables) if probe.base is not None else ["(no .model)"]
        raise NotNative("model", f"modules the native model does not have: {extra}")
    from agent.recipe.native.parts.moe import LAYER_SHARED_NAMES, layer_shared_renames, moe_block
    from agent.recipe.native.parts.moe_scaled_router import layer_moe

    block_names, layer_shared = set(), False
    for index, layer in enumerate(probe.layers):
        names = set(children(layer))
        block = moe_block_name(layer, names)
        if block is not None:
            names = (names - {block}) | {"mlp"}
            block_names.add(block)
        if moe_block(layer) is not None:
            # a shared MLP beside the sparse-MoE block (granitemoeshared): the block's shared experts
            layer_shared |= bool(names & set(LAYER_SHARED_NAMES))
            names -= set(LAYER_SHARED_NAMES)
        unknown = names - LAYER_CHILDREN - set(norm_roles(probe).values())
        if layer_moe(layer):
            # gemma4's enable_moe_block: a router and experts held by the layer itself beside its dense MLP, and the
            # norms around them (parts/moe_scaled_router.py and parts/block_moe_beside_mlp.py read them)
            unknown -= {"router", "experts"} | {name for name in unknown if is_norm_shaped(layer, name, probe.hidden)}
        if unknown:
            raise NotNative("decoder layer", f"layer {index} has {layer_children_text(layer, unknown)}")
        if layout is not None and layout.one_mixer:
            continue                    # one mixer per layer: parts/block_one_mixer.py reads which
        if ("self_attn" not in names and "linear_attn" not in names) or "mlp" not in names:
            raise NotNative("decoder layer", f"layer {index} has no self_attn (or linear_attn) / mlp")
    refuse_own_parameters(probe)
    renames = checkpoint_renames(probe.model_type, type(probe.model).__name__)
    # the sparse-MoE block under another name in transformers' own layer (granitemoe's block_sparse_moe): the
    # native layer's `mlp`, after transformers' renames (which name the block as the layer does)
    renames += tuple((f"\\.{re.escape(name)}\\.", ".mlp.") for name in sorted(block_names))
    if block_names or layer_shared:
        renames += layer_shared_renames(probe.full_config)
    if layout is None:
        return Match(CAUSAL_LM, options={"CHECKPOINT_RENAMES": renames})
    # the root under another name: the stored names to the skeleton's, after transformers' own renames
    return Match(CAUSAL_LM, options={"CHECKPOINT_RENAMES": renames + layout.renames,
                                     "TRANSPOSED_WEIGHTS": layout.transposed,
                                     **({"EMBED_NORM": True} if layout.embed_norm else {}),
                                     **({"EMBED_NORM_AFTER_POSITIONS": True} if layout.embed_norm == "after positions"
                                        else {})},
                 facts={"transposed": bool(layout.transposed)})


def is_norm_shaped(layer, name: str, hidden: int) -> bool:
    """Whether the layer's child `name` holds one parameter, a weight of the hidden width (a norm's shape)."""
    params = dict(getattr(layer, name).named_parameters())
    return list(params) == ["weight"] and tuple(params["weight"].shape) == (hidden,)


def layer_children_text(layer, unknown) -> str:
    """The layer's children no part writes, each with its class (a list: its length and class; one holding routed
    experts: their class), and the sublayers it holds as lists, in one line."""
    import torch

    def what(module) -> str:
        if isinstance(module, torch.nn.ModuleList):
            kinds = sorted({type(m).__name__ for m in module})
            return f"{len(module)} x {'/'.join(kinds)}"
        experts = getattr(module, "experts", None)
        inside = f" holding experts {type(experts).__name__}" if isinstance(experts, torch.nn.Module) else ""
        return type(module).__name__ + inside

    found = children(layer)
    text = ", ".join(f"{name} ({what(found[name])})" for name in sorted(unknown))
    lists = sorted(name for name in set(found) - set(unknown) if isinstance(found[name], torch.nn.ModuleList))
    if lists:
        text += "; sublayers as lists: " + ", ".join(f"{name} ({what(found[name])})" for name in lists)
    return text


def layer_mlp(layer):
    """The layer's MLP: its `mlp`, or its sparse-MoE block under another name (the native layer's `mlp`)."""
    block = moe_block_name(layer, set(children(layer)))
    return getattr(layer, block if block is not None else "mlp")


def moe_block_name(layer, names) -> str | None:
    """The layer's sparse-MoE block's attribute where it is not `mlp` and the layer has no `mlp` beside it."""
    from agent.recipe.native.parts.moe import moe_block

    found = moe_block(layer)
    return found[0] if found is not None and found[0] != "mlp" and "mlp" not in names else None


CAUSAL_LM = Part(
    slot="model", name="causal_lm", code="causal_lm.py", provides=None,
    reads=("num_hidden_layers", "hidden_size", "vocab_size", "rms_norm_eps", "max_position_embeddings", "head_dim",
           "num_attention_heads", "num_key_value_heads", "intermediate_size"),
    probe=_probe, options=("CHECKPOINT_RENAMES", "STACKED_PARAMS", "MLA", "MOE", "TRANSPOSED_WEIGHTS", "EMBED_NORM",
                           "EMBED_NORM_AFTER_POSITIONS"),
    kernels=lambda m: ((), ("Conv1D weights (stored [in, out]) transposed once at load into the parallel linears",)
                       if m.facts.get("transposed") else ()))
