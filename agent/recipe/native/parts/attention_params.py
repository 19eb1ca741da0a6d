"""Parameters an attention module holds directly (not in a child linear), each read by what it does, not by its name
alone: beam's gate_bias (one per head, added to the output gate's projection before its sigmoid: GATE_BIAS, read
with the gate by parts/attention_gate.py) and gpt_neox_japanese's dense_bias (on the last layer only, added to the
attention's output before the residual: o_proj's bias on that layer, O_BIAS the file's test of the layer index). Both are zero as
transformers builds them, so each is measured with the parameter set to random values; the self-check's weights
are random too (selfcheck.randomise), so a file that drops one differs from transformers. Sinks are the attention
part's own (parts/attention.py)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.part import Expr
from agent.recipe.native.parts.probe import children

GATE_BIAS = "gate_bias"        # beam's: read by attention_gate.output_gate
DENSE_BIAS = "dense_bias"      # gpt_neox_japanese's: o_proj's bias of the last layer
KNOWN = (GATE_BIAS, DENSE_BIAS, "sinks")
LAST_LAYER = Expr("layer_idx == config.num_hidden_layers - 1")      # o_proj's bias where the layer is the last


def own_parameters(attention) -> list[str]:
    """The names of the parameters `attention` holds directly (sinks included)."""
    return sorted(name for name, param in attention._parameters.items() if param is not None)


def refuse_unknown(attention) -> None:
    """NotNative naming the parameters of its own that no part reads."""
    unknown = [name for name in own_parameters(attention) if name not in KNOWN]
    if unknown:
        raise NotNative("attention", f"{type(attention).__name__} has parameters {unknown} of its own, which the file "
                                     "does not add")


def last_layer_output_bias(probe, attention_layers: list[int]) -> dict:
    """{"O_BIAS": the file's test of its last layer} where the last layer alone holds a dense_bias that transformers adds to the
    attention's output before the residual (what o_proj's bias does), else {}; NotNative for a dense_bias on
    other layers, or one that does not act so. Measured: with the bias set to b, the input of the norm before the
    MLP moves by b."""
    import torch

    holders = [index for index in attention_layers
               if getattr(probe.layers[index].self_attn, DENSE_BIAS, None) is not None]
    if not holders:
        return {}
    last = len(probe.layers) - 1
    if holders != [last] or last != probe.config.num_hidden_layers - 1:
        raise NotNative("attention", f"{DENSE_BIAS} on layers {holders}: the file adds it on the last layer only")
    layer = probe.layers[last]
    bias, norm = layer.self_attn.dense_bias, children(layer).get("post_attention_layernorm")
    if norm is None or tuple(bias.shape) != (probe.hidden,):
        raise NotNative("attention", f"{DENSE_BIAS} of shape {tuple(bias.shape)} without a norm before the MLP to "
                                     "read it by")
    seen = []
    hook = norm.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    saved = bias.detach().clone()
    b = torch.randn(bias.shape, generator=torch.Generator().manual_seed(12))
    ids = torch.tensor([[3, 5, 7]]) % probe.config.vocab_size
    try:
        for value in (torch.zeros_like(saved), b):
            with torch.no_grad():
                bias.copy_(value)
                probe.model(input_ids=ids, use_cache=False)
    finally:
        hook.remove()
        with torch.no_grad():
            bias.copy_(saved)
    if len(seen) != 2 or not torch.allclose(seen[1] - seen[0], b.expand_as(seen[0]), rtol=1e-4, atol=1e-5):
        raise NotNative("attention", f"{DENSE_BIAS} is not added to the attention's output before the residual")
    return {"O_BIAS": LAST_LAYER}


# the checkpoint's names of these parameters under the file's (CHECKPOINT_RENAMES rows, after the layout's)
DENSE_BIAS_RENAMES = ((f"\\.self_attn\\.{DENSE_BIAS}$", ".self_attn.o_proj.bias"),)
GATE_BIAS_RENAMES = ((f"\\.self_attn\\.{GATE_BIAS}$", ".self_attn.output_gate_bias"),)
