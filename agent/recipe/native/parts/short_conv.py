"""A gated short convolution in the attention's place (a hybrid's conv layers: lfm2's Lfm2ShortConv), written as
code/short_conv.py: in_proj to B, C and x, B * x through a causal depthwise conv1d (config.conv_L_cache taps, its
conv state one Mamba-cache block per request as the Gated DeltaNet's is), C times its output, out_proj. Read from
the architecture: which layers hold it (the layout reads the layer's one other mixer as linear_attn; they must be
config.layer_types' conv ones, held to the built model) and its arithmetic, checked numerically against the formula
the file computes."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.layout import SHORT_CONV_CHILDREN as CHILDREN
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

KIND = "linear attention"
LAYER_TYPE = "conv"          # config.layer_types' name of the conv layers


def formula(module, x):
    """The file's arithmetic in plain float32 torch on transformers' module's weights: x [T, hidden] -> [T, hidden]."""
    import torch.nn.functional as F

    tokens, kernel = x.shape[0], module.conv.weight.shape[-1]
    b, c, h = module.in_proj(x).chunk(3, dim=-1)
    mixed = (b * h).t()[None]
    conv = F.conv1d(mixed, module.conv.weight, module.conv.bias, padding=kernel - 1, groups=mixed.shape[1])
    return module.out_proj(c * conv[0, :, :tokens].t())


def _probe(probe, chosen):
    import torch

    mixers = [getattr(layer, "linear_attn", None) for layer in probe.layers]
    if not any(m is not None and set(children(m)) == CHILDREN for m in mixers):
        return None
    conv = [m is not None for m in mixers]
    types = getattr(probe.config, "layer_types", None) or []
    if [t == LAYER_TYPE for t in types[:len(conv)]] != conv:
        raise NotNative(KIND, f"short-convolution layers {[i for i, x in enumerate(conv) if x]} are not "
                              f"config.layer_types' {LAYER_TYPE} ones")
    for module in (m for m in mixers if m is not None):
        name = type(module).__name__
        if set(children(module)) != CHILDREN or not isinstance(module.conv, torch.nn.Conv1d) \
                or module.conv.groups != module.conv.in_channels or module.conv.weight.shape[1] != 1:
            raise NotNative(KIND, f"{name} has {sorted(children(module))}: not a gated short convolution the file writes")
        if module.conv.kernel_size[0] != probe.config.conv_L_cache:
            raise NotNative(KIND, f"{name}'s conv has {module.conv.kernel_size[0]} taps, not config.conv_L_cache")
        biases = {p.bias is not None for p in (module.in_proj, module.conv, module.out_proj)}
        if biases != {bool(getattr(probe.config, "conv_bias", False))}:
            raise NotNative(KIND, f"{name}: biases that config.conv_bias does not set")
        x = torch.randn(9, probe.hidden, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            got = module(x[None])
            want = formula(module, x)
        got = got[0] if isinstance(got, tuple) else got
        if not torch.allclose(got[0], want, rtol=1e-4, atol=1e-5 * float(want.abs().max())):
            raise NotNative(KIND, f"{name} is not the gated short convolution the file computes (largest difference "
                                  f"{float((got[0] - want).abs().max()):.3g})")
    return Match(SHORT_CONV, options={"LINEAR_ATTENTION": True, "LINEAR_LAYER_TYPE": LAYER_TYPE})


def _kernels(match):
    return (), ("the gated short convolution's causal depthwise conv1d: plain torch (its decode step from the "
                "request's conv state)",)


SHORT_CONV = Part(
    slot="linear_attention", name="short_conv", code="short_conv.py", provides="ModelShortConv",
    reads=("layer_types", "conv_L_cache", "conv_bias", "hidden_size"),
    probe=_probe, kernels=_kernels, options=("LINEAR_ATTENTION", "LINEAR_LAYER_TYPE"))
