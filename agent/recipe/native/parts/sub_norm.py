"""BitNet's sub-norms: an RMSNorm of the attention's output before o_proj (attn_sub_norm, over all heads' width) and
of the gated MLP's act(gate) * up before down_proj (ffn_sub_norm, over the intermediate width). Options of the fused
attention (ATTN_SUB_NORM, code/attention_fused.py: code/norm_qk_full.py's norm over all heads' width) and of the gated
MLP (FFN_SUB_NORM, code/mlp_gated.py: code/norm_sub.py's); both norm a width tensor parallel splits over the ranks
(the ranks' sums of squares all-reduced over attn_tp_group), in plain torch: npu_rms_norm normalises one rank's
slice."""

from __future__ import annotations

import math

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.probe import children, probe_norm

ATTN_SUB_NORM = "attn_sub_norm"
FFN_SUB_NORM = "ffn_sub_norm"


def checked_sub_norm(owner, name: str, width: int, config) -> bool:
    """Whether `owner` has the sub-norm `name`: an RMSNorm (w * x / rms(x)) of `width` whose epsilon is
    config.rms_norm_eps (the file's); NotNative for another norm there."""
    norm = children(owner).get(name)
    if norm is None:
        return False
    kind = f"{type(owner).__name__}.{name}"
    if probe_norm(norm, width) != 0:
        raise NotNative("norm", f"{kind} is x * (1 + w) over the RMS: the sub-norm is written as x * w")
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    want = getattr(config, "rms_norm_eps", None)
    if not isinstance(eps, float) or not isinstance(want, float) or not math.isclose(eps, want, rel_tol=1e-9):
        raise NotNative("norm", f"{kind}'s epsilon {eps} is not config.rms_norm_eps ({want})")
    return True


def attention_sub_norm(probe, index: int) -> bool:
    """Whether layer `index`'s attention norms its output before o_proj (attn_sub_norm): o_proj takes that norm of
    what the norm takes, over all heads' width."""
    import torch

    attention = probe.layers[index].self_attn
    if not checked_sub_norm(attention, ATTN_SUB_NORM, probe.heads * probe.head_dim, probe.config):
        return False
    norm, o_proj = children(attention)[ATTN_SUB_NORM], children(attention)["o_proj"]
    seen = {}
    hooks = [norm.register_forward_pre_hook(lambda m, args: seen.setdefault("normed", args[0].detach())),
             o_proj.register_forward_pre_hook(lambda m, args: seen.setdefault("o_in", args[0].detach()))]
    try:
        with torch.no_grad():
            probe.model(input_ids=torch.tensor([[3, 5, 7]]), use_cache=False)
            want = norm(seen["normed"]) if "normed" in seen else None
    finally:
        for hook in hooks:
            hook.remove()
    if want is None or "o_in" not in seen or not torch.allclose(seen["o_in"], want, rtol=1e-5, atol=1e-6):
        raise NotNative("attention", f"{type(attention).__name__}.{ATTN_SUB_NORM} does not norm the attention's "
                                     "output o_proj takes")
    return True
