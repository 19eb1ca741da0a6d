"""llama4's q/k norm (Llama4TextL2Norm, config.use_qk_norm): one RMSNorm without a weight, shared by the queries
and the keys, per head, on the rotated queries and keys, in the layers that rotate only (not on its NoPE layers).
Read from transformers' modules: which layers hold it (against the layers whose attention follows its rotary,
parts/rotary_nope.py), its epsilon measured (parts/norm_weightless_rms.py) against the config's rms_norm_eps, that it
takes the rotated queries, and that use_qk_norm switches it; the file (parts/code/attention_fused.py QK_L2_NORM)
norms with npu_rms_norm on a weight of ones."""

from __future__ import annotations

import math

from agent.recipe.native.not_native import NotNative

QK_L2_NAME = "qk_norm"
QK_L2_KEY = "use_qk_norm"


def _holders(probe, layers) -> list[int]:
    return [i for i in layers if getattr(probe.layers[i].self_attn, QK_L2_NAME, None) is not None]


def _after_rope(probe, index: int) -> bool:
    """Whether layer `index`'s qk_norm takes the queries rotated (positions past 0 rotate), not as projected:
    the attention called alone on its rotary table, as parts/rotary_nope.py calls it."""
    import torch

    attention = probe.layers[index].self_attn
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(1, 4, probe.hidden, generator=gen)
    seen = {}
    # hooks returning None (a value would replace the module's output: the keys' norm is the queries' module)
    hooks = [attention.q_proj.register_forward_hook(lambda m, args, out: (seen.setdefault("projected", out), None)[1]),
             getattr(attention, QK_L2_NAME).register_forward_hook(
                 lambda m, args, out: (seen.setdefault("normed", args[0]), None)[1])]
    try:
        with torch.no_grad():
            attention(hidden_states=x, position_embeddings=probe.base.rotary_emb(x, torch.arange(4)[None]),
                      attention_mask=None)
    except Exception as exc:  # noqa: BLE001 - another call shape: not the form read here
        raise NotNative("attention", f"{type(attention).__name__} with {QK_L2_NAME} does not run alone") from exc
    finally:
        for hook in hooks:
            hook.remove()
    if "projected" not in seen or "normed" not in seen:
        raise NotNative("attention", f"{type(attention).__name__}'s {QK_L2_NAME} does not take the q projection's heads")
    return not bool(torch.isin(seen["normed"], seen["projected"]).all())


def qk_l2_norm(probe, layers) -> bool:
    """QK_L2_NORM: whether the attention layers `layers` norm their rotated queries and keys as llama4's qk_norm
    (memoised on the probe); NotNative for a `qk_norm` of another form."""
    if "qk_l2_norm" in probe.memo:
        return probe.memo["qk_l2_norm"]
    holders = _holders(probe, layers)
    found = bool(holders)
    if found:
        from agent.recipe.native.parts.norm_weightless_rms import weightless_rms_eps
        from agent.recipe.native.parts.rotary_nope import rotating_layers

        norm = getattr(probe.layers[holders[0]].self_attn, QK_L2_NAME)
        eps = weightless_rms_eps(norm, probe.head_dim)
        want = getattr(probe.config, "rms_norm_eps", None)
        if not isinstance(want, float) or not math.isclose(eps, want, rel_tol=1e-2):
            raise NotNative("attention", f"a q/k {QK_L2_NAME} of epsilon {eps:.3g}, not the config's rms_norm_eps")
        rotating = rotating_layers(probe)
        rotates = [i for i in layers if rotating is None or rotating[i]]
        if holders != rotates:
            raise NotNative("attention", f"{QK_L2_NAME} on layers {holders}, not on the layers that rotate {rotates}")
        if not _after_rope(probe, holders[0]):
            raise NotNative("attention", f"{QK_L2_NAME} before the rotary: the file norms the rotated queries")
        if not isinstance(getattr(probe.config, QK_L2_KEY, None), bool) or \
                _holders(probe.variant({QK_L2_KEY: False}), layers):
            raise NotNative("attention", f"{QK_L2_NAME} not switched by config.{QK_L2_KEY}")
    probe.memo["qk_l2_norm"] = found
    return found
