"""The native generator's library of layer parts (vLLM's model_executor/layers, as a registry): one row per part,
each slot's parts most specific first. agent.recipe.native.compose picks one part per slot from the
architecture's own code and config; agent.recipe.native.assemble writes their code as one file."""

from agent.recipe.native.parts import (attention, block, block_parallel, block_post_ln, block_post_norm, embedding, head, mla, mlp, mlp_clamped, mlp_plain, model, moe,
                                       linear_attention, linear_attention_mamba2, mtp, norm, norm_layer, norm_weightless,
                                       norm_weightless_rms, position, position_absolute, position_sinusoid,
                                       position_alibi, rotary_interleaved, rotary_layer_theta, rotary_nope,
                                       scalar_multipliers, short_conv)
from agent.recipe.native.parts import attention_diff, linear_attention_lightning
from agent.recipe.native.parts import position_nope
from agent.recipe.native.parts import block_one_mixer, linear_attention_mamba1, no_attention, position_none
from agent.recipe.native.parts import block_normed_residual
from agent.recipe.native.parts import mla_layer_shapes
from agent.recipe.native.parts import linear_attention_kda
from agent.recipe.native.parts import block_parallel_hybrid
from agent.recipe.native.parts import block_first_unnormed, head_transform
from agent.recipe.native.parts import block_moe_beside_mlp, moe_scaled_router
from agent.recipe.native.parts.part import ROLES, SLOTS, Composition, Match, Part

__all__ = ["PARTS", "OPTION_NAMES", "TABLES", "ROLES", "SLOTS", "Composition", "Match", "Part"]

PARTS = (
    model.CAUSAL_LM,
    scalar_multipliers.EMBEDDING_MULTIPLIER,
    embedding.EMBEDDING,
    norm.OFFSET_RMS_NORM,
    norm.RMS_NORM,
    norm_layer.LAYER_NORM,
    norm_weightless.WEIGHTLESS_LAYER_NORM,
    norm_weightless_rms.WEIGHTLESS_RMS_NORM,
    position_absolute.ABSOLUTE_POSITIONS,
    position_sinusoid.SINUSOID_BUFFER_POSITIONS,
    position_alibi.ALIBI,
    position_nope.NOPE_ALL,
    position_none.NO_POSITIONS,         # after NOPE_ALL: a config that switches rope on is that part's
    rotary_layer_theta.ROTARY_LAYER_THETA,
    rotary_nope.ROTARY_NOPE,
    rotary_interleaved.ROTARY_INTERLEAVED,
    position.ROTARY,
    no_attention.NO_ATTENTION,
    mla_layer_shapes.MLA_LAYER_SHAPES,   # before MLA: a config that sets MLA widths per layer is this part's
    mla.MLA,
    attention_diff.DIFF_PAGED,
    attention.ALIBI_PAGED,
    attention.SOFTCAP_PAGED,
    attention.FUSED_PAGED_SINKS,
    attention.FUSED_PAGED,
    linear_attention_lightning.LIGHTNING,
    linear_attention_mamba2.MAMBA2,
    linear_attention_mamba1.MAMBA1,
    linear_attention_kda.KIMI_DELTA_ATTENTION,
    linear_attention.GATED_DELTA_NET,
    short_conv.SHORT_CONV,
    no_attention.NO_MLP,
    moe.SPARSE_MOE,
    moe.SPARSE_MOE_OUTPUT_NORM,
    moe_scaled_router.SCALED_ROUTER_MOE,     # a layer's own router and experts beside its dense MLP (gemma4)
    mlp_clamped.CLAMPED_MLP,
    mlp.GATED_MLP,
    mlp_plain.PLAIN_MLP,
    block_moe_beside_mlp.MOE_BESIDE_MLP,     # before the others: its layers hold a router and experts beside the MLP
    block_parallel_hybrid.PARALLEL_HYBRID,   # before the others: its layers hold a mixer and an attention
    block_one_mixer.ONE_MIXER,
    block_parallel.PARALLEL,
    block_parallel.PARALLEL_TWO_NORMS,
    scalar_multipliers.RESIDUAL_MULTIPLIER,
    scalar_multipliers.SANDWICH_RESIDUAL_MULTIPLIER,
    block_normed_residual.NORMED_RESIDUAL,   # before PRE_NORM: its norms' names are pre-norm's
    block.SANDWICH,
    block_first_unnormed.FIRST_UNNORMED,     # before PRE_NORM: its layers are pre-norm's but the first
    block.PRE_NORM,
    block_post_norm.POST_NORM,
    block_post_ln.POST_LN,
    scalar_multipliers.LOGITS_SCALING,
    head_transform.HEAD_TRANSFORM,          # before LM_HEAD, which leaves a model with a transform before its head to it
    head.LM_HEAD,
    mtp.MTP,
)
# options every code file may hold: the assembler folds them (a part's own, and the skeleton's the others set)
OPTION_NAMES = frozenset(name for part in PARTS for name in part.options)
# options that stay tables of the file (module constants read in a loop), not folded into the code
TABLES = frozenset({"STACKED_PARAMS", "CHECKPOINT_RENAMES", "TRANSPOSED_WEIGHTS", "ACT_NAMES"})
