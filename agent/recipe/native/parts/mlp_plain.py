"""The plain (non-gated) MLP: down(act(up(x))), with or without biases (arcee's ReLU², nemotron's; its linears read
by their role, agent.recipe.native.parts.layout.mlp_roles — starcoder2's and gpt2's c_fc / c_proj, gptj's fc_in /
fc_out, gpt_neox's dense_h_to_4h / dense_4h_to_h, phi's fc1 / fc2 — their checkpoint tensors renamed at load;
apertus' xIELU, its learned alpha_p / alpha_n loaded), read from the layers whose MLP is not a sparse-MoE block."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.attention import out_features
from agent.recipe.native.parts.layout import MLP_ROLES, call_mlp, mlp_roles
from agent.recipe.native.parts.mlp import FIXED_ACTIVATIONS, act_key, bias_option, bias_variants, dense_mlps
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

# the MLP's children by role (agent.recipe.native.parts.layout.mlp_roles), in the order the MLP calls them
PLAIN_CHILDREN = MLP_ROLES


def _probe_formula(mlp, up, down, hidden: int, activation) -> None:
    """The MLP is down(act(up(x))), nothing else."""
    import torch

    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = down(activation(up(x)))
        got = call_mlp(mlp, x)
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        raise NotNative("mlp", f"{type(mlp).__name__} is not down(act(up(x)))")


# config keys that hold a plain MLP's width, as the architectures name it (gpt2's n_inner: 4 x hidden_size where None); falcon: ffn_hidden_size; ctrl: dff; trocr: decoder_ffn_dim
WIDTH_KEYS = ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "dff", "decoder_ffn_dim")




def fixed_activation(module, hidden: int) -> str:
    """The ACT2FN entry computing `module` (an activation no config key names), or NotNative."""
    import torch
    from transformers.activations import ACT2FN

    x = 3 * torch.randn(4, hidden, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for name in FIXED_ACTIVATIONS:
            if torch.allclose(module(x), ACT2FN[name](x), rtol=1e-5, atol=1e-6):
                return name
    raise NotNative("mlp", f"no hidden_act / hidden_activation in the config, and {type(module).__name__} is none of "
                           f"{', '.join(FIXED_ACTIVATIONS)}")


def _width(probe, widths: set, up_name: str) -> dict:
    """The MLP's width as the config holds it: {} for config.intermediate_size; else MLP_WIDTH, the key (and
    WIDTH_DEFAULT_4X where it is None and the width 4 x hidden_size), checked on a config with that key changed;
    WIDTH_FIXED_4X where no key holds a width of 4 x hidden_size."""
    if not widths:
        return {}
    config, (width,) = probe.config, widths if len(widths) == 1 else (None,)
    key = next((k for k in WIDTH_KEYS if getattr(config, k, None) == width), None)
    if key is None and width == 4 * probe.hidden:
        # a key of None meaning 4 x hidden_size (gpt2's n_inner, gpt_neo's intermediate_size)
        key = next((k for k in WIDTH_KEYS if k in config.to_dict() and getattr(config, k) is None), None)
    default = key is not None and getattr(config, key) is None or key == "n_inner"
    if key is None and width == 4 * probe.hidden and _fixed_4x(probe, up_name):
        return {"WIDTH_FIXED_4X": True}             # 4 x hidden_size in the architecture's code (openai-gpt's, mpt's)
    if key is None:
        raise NotNative("mlp", f"plain MLP of width {sorted(widths)}: no config key of {', '.join(WIDTH_KEYS)} holds it")
    other = probe.variant({key: 2 * probe.hidden + 8})
    up = children(_first_mlp(other))[up_name]
    if out_features(up) != 2 * probe.hidden + 8:
        raise NotNative("mlp", f"the plain MLP's width does not follow config.{key}")
    return {"MLP_WIDTH": key, "WIDTH_DEFAULT_4X": default}


def _first_mlp(probe):
    """The first layer's MLP (a one-mixer model's first MLP layer: nemotron_h's)."""
    return next(children(layer)["mlp"] for layer in probe.layers if "mlp" in children(layer))


def _fixed_4x(probe, up_name: str) -> bool:
    """The architecture hard-codes a width of 4 x hidden_size (mpt, whose expansion_ratio transformers does not
    read): a config of half the hidden_size keeps 4 x it."""
    other = probe.variant({"hidden_size": probe.hidden // 2})
    return out_features(children(_first_mlp(other))[up_name]) == 2 * probe.hidden


def _plain(probe, chosen):
    import torch
    from transformers.activations import ACT2FN
    from transformers.pytorch_utils import Conv1D

    found = dense_mlps(probe, chosen)
    if not found:
        return None
    source, mlps = found
    roles = [mlp_roles(mlp) for mlp in mlps]
    if roles[0] is None or any(r != roles[0] for r in roles):
        return None
    up_name, act_name, down_name = (roles[0][role] for role in PLAIN_CHILDREN)
    try:
        key, fixed = act_key(source.config), None
    except NotNative:
        # no config key names it: the architecture's own activation, as the ACT2FN entry that computes it (mpt's GELU)
        key, fixed = None, fixed_activation(children(mlps[0])[act_name], source.hidden)
    act_names = activation_names(source, mlps[0], act_name, key) if key else ()
    biases, widths, learned = set(), set(), set()
    for mlp in mlps:
        up, down = children(mlp)[up_name], children(mlp)[down_name]
        if not all(isinstance(linear, (torch.nn.Linear, Conv1D)) for linear in (up, down)):
            return None
        if out_features(up) != getattr(source.config, "intermediate_size", None):
            widths.add(out_features(up))
        biases.add((up.bias is not None, down.bias is not None))
        own = children(mlp).get(act_name, getattr(mlp, act_name, None))
        activation = ACT2FN[fixed or dict(act_names).get(getattr(source.config, key), getattr(source.config, key))]
        if type(own) is type(activation) and any(True for _ in own.parameters()):
            activation = own       # an activation with learned parameters (xIELU's alpha_p / alpha_n): the layer's
            learned.add(True)
        _probe_formula(mlp, up, down, source.hidden, activation)
    if len(biases) != 1 or len(set(next(iter(biases)))) != 1:
        raise NotNative("mlp", "plain MLPs with a bias on one projection only, or on some layers only")
    width = _width(source, widths, up_name)
    # the linears' stored names to the file's (the activation holds no tensor unless learned)
    renames = tuple((f"\\.mlp\\.{old}\\.", f".mlp.{new}.") for old, new in ((up_name, "up_proj"), (down_name, "down_proj"))
                    if old != new)
    if learned and act_name != "act_fn":
        raise NotNative("mlp", f"an activation with learned parameters under another name ({act_name})")
    act = {"ACT_FIXED": fixed} if fixed else {"ACT": key}
    return Match(PLAIN_MLP, options={**act, "MLP_BIAS": bias_option(source, next(iter(biases))[0]),
                                     "CHECKPOINT_RENAMES": renames, **width, **({"ACT_PARAMS": True} if learned else {}),
                                     **({"ACT_NAMES": act_names} if act_names else {})},
                 facts={"activation": fixed or dict(act_names).get(getattr(source.config, key), getattr(source.config, key))})


def _same_function(f, g) -> bool:
    import torch

    x = torch.linspace(-6.0, 6.0, 241)
    try:
        with torch.no_grad():
            return torch.allclose(f(x), g(x), rtol=1e-5, atol=1e-6)
    except Exception:  # noqa: BLE001 - an activation that needs another input: not this one
        return False


def activation_names(probe, mlp, act_name: str, key: str) -> tuple:
    """((config value, ACT2FN name), ...) where the architecture names activations its own way (openai-gpt's ACT_FNS:
    afn "gelu" runs gelu_new): read from the dict of its modeling module that holds the MLP's activation under the
    config's value, each entry matched numerically to an ACT2FN activation; () where ACT2FN's name of the config's
    value computes the MLP's activation (or the activation has learned parameters: the code loads them)."""
    import torch
    from transformers.activations import ACT2FN

    value, own = getattr(probe.config, key), children(mlp).get(act_name, getattr(mlp, act_name, None))
    if own is None or (isinstance(own, torch.nn.Module) and any(True for _ in own.parameters())):
        return ()
    if value in ACT2FN and _same_function(ACT2FN[value], own):
        return ()
    tables = [t for t in vars(probe.modeling).values() if isinstance(t, dict) and t.get(value) is own]
    if len(tables) != 1:
        raise NotNative("mlp", f"the MLP's activation is not ACT2FN[{value!r}] and no table of the architecture's "
                               "code names it")
    names = []
    for their, function in tables[0].items():
        # its own name, else one of the same class (gelu_new's NewGELUActivation, not a close tanh form): ACT2FN's
        # classes read without building the others (some print on construction)
        same_class = [name for name, entry in dict.items(ACT2FN)
                      if (entry[0] if isinstance(entry, tuple) else entry) is type(function)]
        candidates = [name for name in dict.fromkeys([their, *same_class]) if name in ACT2FN]
        ours = next((name for name in candidates if _same_function(ACT2FN[name], function)), None)
        if ours is None:
            raise NotNative("mlp", f"the architecture's activation {their!r} is none of transformers' ACT2FN")
        if ours != their:
            names.append((their, ours))
    return tuple(names)



PLAIN_MLP = Part(
    slot="mlp", name="plain_mlp", code="mlp_plain.py", provides="ModelPlainMLP",
    reads=("hidden_size", "intermediate_size", "hidden_act", "mlp_bias"), probe=_plain,
    kernels=lambda m: ((), (f"MLP activation {m.facts['activation']}: plain torch between the parallel linears "
                            "(no gate: npu_swiglu does not apply)",)),
    options=("ACT", "MLP_BIAS", "CHECKPOINT_RENAMES", "MLP_WIDTH", "WIDTH_DEFAULT_4X", "WIDTH_FIXED_4X", "ACT_PARAMS",
             "ACT_FIXED", "ACT_NAMES"),
    variants=bias_variants)
