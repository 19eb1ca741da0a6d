"""MLA layers of unequal shapes (dots3_note_text: its sliding layers' kv_lora_rank 1024, 64 heads and
qk_nope_head_dim 192 beside the indexed layers' 512, 128 and 128), set through transformers' heterogeneous config
(`per_layer_config`). The MLA part's code (code/attention_mla.py) with MLA_PER_LAYER builds each layer's attention
from `config.per_layer_config[layer_idx]`, read at run time, so one file serves the family; each layer's latent and
rope caches are its own CacheEntry of its own widths (the executor allocates entries per layer).

Read from the layers, not from a table: each attention's widths — heads, kv_lora_rank, qk_nope / qk_rope / v head
widths, q_lora_rank — are solved from its modules' shapes (q_b_proj rows heads x (nope + rope), kv_b_proj rows heads
x (nope + v), o_proj columns heads x v, kv_a_proj_with_mqa rows kv_lora_rank + rope) and must equal what the
config's own layer gives; any other attribute set per layer (gemma4's head_dim) is not this part's."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.mla import is_mla_model, mla_kernels, mla_match
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import layer_config, per_layer_refusal, sets_mla_shapes_per_layer

# the widths a layer's modules show (head_dim and num_key_value_heads: MLA's modules are not built from them)
SHAPE_KEYS = ("num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim")


def module_shapes(attention) -> dict:
    """An MLA attention's widths as its modules hold them (solved from the projections' shapes)."""
    kv_a, kv_b, o_proj = attention.kv_a_proj_with_mqa, attention.kv_b_proj, attention.o_proj
    q_up = getattr(attention, "q_b_proj", None) or attention.q_proj
    rank = kv_b.in_features
    rope = kv_a.out_features - rank
    # q rows - kv_b rows + o columns = heads x rope
    heads_x_rope = q_up.out_features - kv_b.out_features + o_proj.in_features
    if rope <= 0 or heads_x_rope <= 0 or heads_x_rope % rope:
        raise NotNative("attention", f"{type(attention).__name__}'s projections are not MLA's widths "
                                     f"(kv_a {kv_a.out_features}, kv_b {tuple(kv_b.weight.shape)}, q "
                                     f"{q_up.out_features}, o {o_proj.in_features})")
    heads = heads_x_rope // rope
    q_a = getattr(attention, "q_a_proj", None)
    return {"num_attention_heads": heads, "kv_lora_rank": rank, "q_lora_rank": q_a.out_features if q_a else None,
            "qk_nope_head_dim": q_up.out_features // heads - rope, "qk_rope_head_dim": rope,
            "v_head_dim": o_proj.in_features // heads}


def config_shapes(config, index: int) -> dict:
    view = layer_config(config, index)
    return {key: getattr(view, key, None) for key in SHAPE_KEYS}


def layer_shapes(probe) -> list[dict] | None:
    """Each decoder layer's MLA widths, held to its layer's config; None for a config that sets nothing per
    layer (the MLA part's one shape). NotNative: a layer built otherwise than its config says."""
    if not sets_mla_shapes_per_layer(probe.config):
        return None
    shapes = []
    for index, layer in enumerate(probe.layers):
        got, want = module_shapes(layer.self_attn), config_shapes(probe.config, index)
        if got != want:
            differ = ", ".join(f"{key} {got[key]} (config {want[key]})" for key in SHAPE_KEYS if got[key] != want[key])
            raise NotNative("attention", f"layer {index}'s MLA is not built from its per_layer_config: {differ}")
        shapes.append(got)
    return shapes


def _probe(probe, chosen):
    if not sets_mla_shapes_per_layer(probe.config):
        return None
    if not is_mla_model(probe):
        # the other attention parts read each width once, globally: a config that sets them per layer is no one's
        raise NotNative("attention", per_layer_refusal(probe.config))
    shapes = layer_shapes(probe)
    match = mla_match(MLA_LAYER_SHAPES, probe, MLA_PER_LAYER=True)
    return Match(MLA_LAYER_SHAPES, facts={**match.facts, "layer_shapes": shapes}, options=match.options)


MLA_LAYER_SHAPES = Part(
    slot="attention", name="mla_layer_shapes", code="attention_mla.py", provides="ModelMlaAttention",
    reads=("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_attention_heads",
           "rope_parameters", "per_layer_config"),
    probe=_probe, kernels=mla_kernels, options=("MLA_PER_LAYER",))
