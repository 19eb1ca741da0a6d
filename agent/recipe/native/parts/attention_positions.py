"""An attention whose output follows the token positions beyond the rotary tables it is handed (ministral3's llama-4
query scaling: q x (1 + beta log(1 + floor(position / original_max_position_embeddings))), from rope_parameters'
llama_4_scaling_beta), which the generated file does not compute: its attention sees positions only through cos /
sin. Read numerically on transformers' attention: one input and one rotary table, at positions 0.. and far past any
original context. The self-check could not show it: its prompts end long before such a position."""

from __future__ import annotations

import inspect

from agent.recipe.native.not_native import NotNative

FAR = 1 << 20       # past any checkpoint's original context


def follows_positions(attention, probe) -> bool:
    """Whether `attention`'s output changes with its position_ids alone (the same hidden states and cos / sin);
    False where it takes none or cannot be called so (not this reading's to judge)."""
    import torch

    try:
        if "position_ids" not in inspect.signature(attention.forward).parameters:
            return False
    except (TypeError, ValueError):
        return False
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(1, 4, probe.hidden, generator=gen)
    near = torch.arange(4)[None]
    outputs = []
    try:
        table = probe.base.rotary_emb(x, near)
        for positions in (near, near + FAR):
            with torch.no_grad():
                out = attention(hidden_states=x, position_embeddings=table, attention_mask=None, position_ids=positions)
            outputs.append(out[0] if isinstance(out, tuple) else out)
    except Exception:  # noqa: BLE001 - no rotary_emb, per-layer-type tables, another call shape
        return False
    return not torch.allclose(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)


def refuse_position_scaling(probe, index: int) -> None:
    """NotNative where layer `index`'s attention follows the positions beyond its rotary tables."""
    attention = probe.layers[index].self_attn
    if follows_positions(attention, probe):
        raise NotNative("attention", f"{type(attention).__name__}'s output follows the token positions beyond its "
                                     "rotary tables (ministral3's llama-4 query scaling past rope_parameters' "
                                     "original_max_position_embeddings): the file's attention sees positions only "
                                     "through cos / sin")
