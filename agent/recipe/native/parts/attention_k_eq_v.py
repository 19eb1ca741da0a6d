"""Keys as values (gemma4's attention_k_eq_v: its full-attention layers have no v_proj; Gemma4TextAttention takes
k_proj's output, before the key's norm and rotary, as the values, then v_norm). Read numerically, not from the
attribute: on each layer without a v_proj, the model's logits stay as they were when the layer is given a v_proj
holding k_proj's weights, and change with a v_proj of other weights (the values are read, and are the keys'
projection); which layers lack it follows a config key (on the config with it flipped every layer has a v_proj) and
the layers' kinds (config.layer_types). The fused attention part writes it as the option K_EQ_V (the key, the kinds):
the file reads the key and the layer's kind at run time, and loads such a layer's k_proj into both the key and the
value rows of its fused q/k/v projection (upstream's models/gemma_4 computes the values as key_states.clone() of its
own k_proj; the fused projection computes them in the same matmul)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative

K_EQ_V_KEYS = ("attention_k_eq_v",)


def layers_without_values(probe) -> list[int]:
    """The attention layers with q_proj and k_proj but no v_proj (and no fused qkv_proj)."""
    from agent.recipe.native.parts.probe import children

    found = []
    for index, layer in enumerate(probe.layers):
        if not hasattr(layer, "self_attn"):
            continue                    # a hybrid's linear-attention layer
        held = children(layer.self_attn)
        if "qkv_proj" not in held and held.get("v_proj") is None and "q_proj" in held and "k_proj" in held:
            found.append(index)
    return found


def _logits(probe):
    import torch

    with torch.no_grad():
        ids = torch.tensor([[3, 5, 7, 11, 13]]) % probe.config.vocab_size
        return probe.model(input_ids=ids, use_cache=False).logits


def _values_are_keys(probe, index: int) -> bool:
    """Whether layer `index`'s attention takes k_proj's output as its values: the logits unchanged with a v_proj of
    k_proj's weights, changed with a v_proj of others."""
    import torch

    attention = probe.layers[index].self_attn
    k_proj = attention.k_proj
    base = _logits(probe)
    outputs = []
    gen = torch.Generator().manual_seed(11)
    try:
        for weight in (k_proj.weight.detach().clone(), torch.randn(k_proj.weight.shape, generator=gen)):
            given = torch.nn.Linear(k_proj.in_features, k_proj.out_features, bias=k_proj.bias is not None)
            with torch.no_grad():
                given.weight.copy_(weight)
                if k_proj.bias is not None:
                    given.bias.copy_(k_proj.bias)
            attention.v_proj = given
            outputs.append(_logits(probe))
    except Exception:  # noqa: BLE001 - an attention that cannot take a v_proj: not this form
        return False
    finally:
        attention.__dict__.pop("v_proj", None)
        attention._modules.pop("v_proj", None)
        attention.v_proj = None
    same, other = outputs
    return torch.allclose(same, base, rtol=1e-5, atol=1e-6) and not torch.allclose(other, base, rtol=1e-3, atol=1e-4)


def keys_as_values(probe) -> tuple | None:
    """(the config key, the layer kinds) of the layers that take their keys' projection as values, or None where every
    attention layer has its own values. NotNative for layers without a v_proj that compute anything else. Memoised."""
    if "keys_as_values" in probe.memo:
        return probe.memo["keys_as_values"]
    found = None
    missing = layers_without_values(probe)
    if missing:
        kinds = getattr(probe.config, "layer_types", None)
        if not all(_values_are_keys(probe, index) for index in missing):
            raise NotNative("attention", f"layer {missing[0]}'s attention has no v_proj and its values are not its "
                                         "k_proj's output: not written")
        key = next((k for k in K_EQ_V_KEYS if getattr(probe.config, k, None) is True), None)
        if key is None or not isinstance(kinds, list):
            raise NotNative("attention", f"layers {missing} have no v_proj and no config key ({', '.join(K_EQ_V_KEYS)}) "
                                         "with config.layer_types says which: not written")
        held = sorted({kinds[index] for index in missing})
        if [i for i in range(len(probe.layers)) if kinds[i] in held and hasattr(probe.layers[i], "self_attn")] != missing:
            raise NotNative("attention", f"layers {missing} have no v_proj: not every layer of kinds {held}")
        try:
            flipped = not layers_without_values(probe.variant({key: False}))
        except Exception:  # noqa: BLE001 - a config the architecture refuses: the key not confirmed
            flipped = False
        if not flipped:
            raise NotNative("attention", f"layers {missing} have no v_proj whatever config.{key} says: not written")
        found = (key, tuple(held))
    probe.memo["keys_as_values"] = found
    return found
