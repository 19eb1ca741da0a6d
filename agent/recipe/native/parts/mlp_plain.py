"""The plain (non-gated) MLP: down(act(up(x))), with or without biases (arcee's ReLU², nemotron's, starcoder2's
c_fc / c_proj: its checkpoint's tensors renamed at load; apertus' xIELU, its learned alpha_p / alpha_n loaded), read from the layers whose MLP is not a sparse-MoE block."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.attention import out_features
from agent.recipe.native.parts.mlp import act_key, bias_option, bias_variants, dense_mlps
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

PLAIN_CHILDREN = {"up_proj", "down_proj", "act_fn"}
# the same MLP under the GPT-2-era names (starcoder2's c_fc / act / c_proj): the loader renames its tensors
GPT_CHILDREN = {"c_fc": "up_proj", "c_proj": "down_proj", "act": "act_fn"}


def _probe_formula(mlp, hidden: int, activation) -> None:
    """The MLP is down(act(up(x))), nothing else."""
    import torch

    up, down = (getattr(mlp, name) for name in (("up_proj", "down_proj") if hasattr(mlp, "up_proj") else ("c_fc", "c_proj")))
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = down(activation(up(x)))
        got = mlp(x)
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        raise NotNative("mlp", f"{type(mlp).__name__} is not down(act(up(x)))")


# config keys that hold a plain MLP's width, as the architectures name it (gpt2's n_inner: 4 x hidden_size where None)
WIDTH_KEYS = ("intermediate_size", "ffn_dim", "n_inner")


def _width(probe, widths: set) -> dict:
    """The MLP's width as the config holds it: {} for config.intermediate_size; else MLP_WIDTH, the key (and
    WIDTH_DEFAULT_4X where it is None and the width 4 x hidden_size), checked on a config with that key changed."""
    if not widths:
        return {}
    config, (width,) = probe.config, widths if len(widths) == 1 else (None,)
    key = next((k for k in WIDTH_KEYS if getattr(config, k, None) == width), None)
    if key is None and width == 4 * probe.hidden:
        # a key of None meaning 4 x hidden_size (gpt2's n_inner, gpt_neo's intermediate_size)
        key = next((k for k in WIDTH_KEYS if k in config.to_dict() and getattr(config, k) is None), None)
    default = key is not None and getattr(config, key) is None or key == "n_inner"
    if key is None:
        raise NotNative("mlp", f"plain MLP of width {sorted(widths)}: no config key of {', '.join(WIDTH_KEYS)} holds it")
    other = probe.variant({key: 2 * probe.hidden + 8})
    up = next(iter(m for m in children(children(other.layers[0])["mlp"]).values() if out_features(m)))
    if out_features(up) != 2 * probe.hidden + 8:
        raise NotNative("mlp", f"the plain MLP's width does not follow config.{key}")
    return {"MLP_WIDTH": key, "WIDTH_DEFAULT_4X": default}


def _plain(probe, chosen):
    import torch
    from transformers.activations import ACT2FN
    from transformers.pytorch_utils import Conv1D

    found = dense_mlps(probe, chosen)
    if not found:
        return None
    source, mlps = found
    names = {frozenset(children(mlp)) for mlp in mlps}
    if names not in ({frozenset(PLAIN_CHILDREN)}, {frozenset(GPT_CHILDREN)}):
        return None
    gpt = names == {frozenset(GPT_CHILDREN)}
    up_name, down_name = ("c_fc", "c_proj") if gpt else ("up_proj", "down_proj")
    key = act_key(source.config)
    biases, widths, learned = set(), set(), set()
    for mlp in mlps:
        up, down = children(mlp)[up_name], children(mlp)[down_name]
        if not all(isinstance(linear, (torch.nn.Linear, Conv1D)) for linear in (up, down)):
            return None
        if out_features(up) != getattr(source.config, "intermediate_size", None):
            widths.add(out_features(up))
        biases.add((up.bias is not None, down.bias is not None))
        activation = ACT2FN[getattr(source.config, key)]
        own = getattr(mlp, "act_fn", getattr(mlp, "act", None))
        if type(own) is type(activation) and any(True for _ in own.parameters()):
            activation = own       # an activation with learned parameters (xIELU's alpha_p / alpha_n): the layer's
            learned.add(True)
        _probe_formula(mlp, source.hidden, activation)
    if len(biases) != 1 or len(set(next(iter(biases)))) != 1:
        raise NotNative("mlp", "plain MLPs with a bias on one projection only, or on some layers only")
    width = _width(source, widths)
    renames = tuple((f"\\.mlp\\.{old}\\.", f".mlp.{new}.") for old, new in GPT_CHILDREN.items() if old != "act") if gpt else ()
    if learned and gpt:
        raise NotNative("mlp", "an activation with learned parameters under GPT-2-era names")
    return Match(PLAIN_MLP, options={"ACT": key, "MLP_BIAS": bias_option(source, next(iter(biases))[0]),
                                     "CHECKPOINT_RENAMES": renames, **width,
                                     **({"ACT_PARAMS": True} if learned else {})},
                 facts={"activation": getattr(source.config, key)})


PLAIN_MLP = Part(
    slot="mlp", name="plain_mlp", code="mlp_plain.py", provides="ModelPlainMLP",
    reads=("hidden_size", "intermediate_size", "hidden_act", "mlp_bias"), probe=_plain,
    kernels=lambda m: ((), (f"MLP activation {m.facts['activation']}: plain torch between the parallel linears "
                            "(no gate: npu_swiglu does not apply)",)),
    options=("ACT", "MLP_BIAS", "CHECKPOINT_RENAMES", "MLP_WIDTH", "WIDTH_DEFAULT_4X", "ACT_PARAMS"),
    variants=bias_variants)
