"""A transform before the output head (code/head_transform.py; modernbert-decoder's prediction head `lm_head`:
dense, activation, LayerNorm, before its `decoder` Linear, the real output projection): read by parts/layout.py as
the causal LM's `head_transform`, held here numerically — norm(act(dense(x))) with the activation a config key names
(told from another key of equal value by moving it), the dense's bias a literal or the config key that sets it, the
norm of the model's own kind (the norm part's class: its arithmetic and epsilon those of the final norm) — and the
output head read as parts/head.py reads it."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts import head
from agent.recipe.native.parts.part import Expr, Match, Part
from agent.recipe.native.parts.probe import children

NAME = "head_transform"         # parts/layout.py's name of it (HEAD_TRANSFORM)
OTHER_ACTIVATION = {"gelu": "relu", "relu": "gelu"}     # what a key is moved to, to see the transform follow it


def transform_parts(transform, hidden: int) -> tuple:
    """(dense, activation, norm) of the transform: one Linear hidden -> hidden, one norm of width hidden, one other
    child or callable attribute (the activation); NotNative for another shape."""
    import torch

    from agent.recipe.native.parts.layout import _is_norm

    held = children(transform)
    linears = [c for c in held.values() if isinstance(c, torch.nn.Linear)]
    norms = [c for c in held.values() if _is_norm(c)]
    others = [c for c in held.values() if not isinstance(c, torch.nn.Linear) and not _is_norm(c)]
    if len(linears) != 1 or len(norms) != 1 or len(others) != 1 \
            or (linears[0].in_features, linears[0].out_features) != (hidden, hidden):
        raise NotNative("model", f"the transform before the output head ({type(transform).__name__}: "
                                 f"{', '.join(f'{n} ({type(c).__name__})' for n, c in held.items())}) is not one "
                                 "dense of the hidden width, an activation and a norm")
    return linears[0], others[0], norms[0]


def computes(transform, hidden: int, activation: str) -> bool:
    """Whether the transform is norm(ACT2FN[activation](dense(x))) (by value, on a spread input)."""
    import torch
    from transformers.activations import ACT2FN

    dense, _, norm = transform_parts(transform, hidden)
    x = 3 * torch.randn(2, 3, hidden, generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        return torch.allclose(transform(x), norm(ACT2FN[activation](dense(x))), rtol=1e-4, atol=1e-5)


def activation_key(probe, transform) -> str:
    """The config key naming the transform's activation: of the string keys whose ACT2FN the transform computes, the
    one it follows when moved (modernbert-decoder's classifier_activation beside hidden_activation, both gelu)."""
    from transformers.activations import ACT2FN

    config = probe.config.to_dict()
    keys = [k for k, v in config.items() if isinstance(v, str) and v in ACT2FN and computes(transform, probe.hidden, v)]
    for key in keys:
        other = OTHER_ACTIVATION.get(config[key], "gelu")
        try:
            moved = children(probe.variant({key: other}).model).get(NAME)
        except NotNative:
            continue
        if moved is not None and computes(moved, probe.hidden, other):
            return key
    raise NotNative("model", "the activation of the transform before the output head follows no config key")


def norm_of_model_kind(probe, norm) -> bool:
    """Whether the transform's norm computes what the final norm computes with its weights (the file builds it as
    the norm part's class), at the same epsilon (read on copies: their weights moved off ones and zeros)."""
    import copy

    import torch

    norm = copy.deepcopy(norm)
    final = getattr(probe.base, "norm", None)
    if final is None or type(final) is not type(norm):
        return False
    eps = [getattr(n, "eps", getattr(n, "variance_epsilon", None)) for n in (norm, final)]
    like = copy.deepcopy(final)
    try:
        like.load_state_dict(norm.state_dict())
    except RuntimeError:        # a bias in one, not the other
        return False
    gen = torch.Generator().manual_seed(14)
    x = 3.0 + torch.randn(2, probe.hidden, generator=gen)
    with torch.no_grad():
        for param in norm.parameters():
            param.add_(torch.randn(param.shape, generator=gen))     # away from ones and zeros: a bias that counts
        like.load_state_dict(norm.state_dict())
        return eps[0] == eps[1] and torch.allclose(norm(x), like(x), rtol=1e-5, atol=1e-6)


def dense_bias(probe, present: bool):
    """The dense's bias: Expr(config.<key>) of the bool key with "bias" in its name that gives or takes it, else the
    literal."""
    for key, value in probe.config.to_dict().items():
        if "bias" not in key or not isinstance(value, bool) or value != present:
            continue
        try:
            moved = children(probe.variant({key: not value}).model).get(NAME)
        except NotNative:
            continue
        if moved is not None and (transform_parts(moved, probe.hidden)[0].bias is not None) != present:
            return Expr(f"config.{key}")
    return present


def _probe(probe, chosen):
    transform = children(probe.model).get(NAME)
    if transform is None:
        return None
    dense, _, norm = transform_parts(transform, probe.hidden)
    key = activation_key(probe, transform)
    if not norm_of_model_kind(probe, norm):
        raise NotNative("norm", f"the norm of the transform before the output head ({type(norm).__name__}) is not "
                                "the model's own kind (the final norm's arithmetic and epsilon)")
    bias = dense_bias(probe, dense.bias is not None)
    lm_head = head.read_head(probe)
    return Match(HEAD_TRANSFORM, options={**lm_head.options, "HEAD_TRANSFORM": True, "HEAD_ACT": key,
                                          "HEAD_DENSE_BIAS": bias},
                 facts={**lm_head.facts, "activation": getattr(probe.config, key)})


def _variants(match, probe):
    """The output head's (the other tie), and the other setting of the config key of the dense's bias."""
    found = head.LM_HEAD.variants(match, probe)
    bias = match.options["HEAD_DENSE_BIAS"]
    if isinstance(bias, Expr):
        key = bias.code.split(".", 1)[1]
        found.append((f"bias {key}", {key: not getattr(probe.config, key)}))
    return found


def _kernels(match):
    fused, unfused = head.LM_HEAD.kernels(match)
    return fused, (*unfused, f"the transform before lm_head: a replicated dense, {match.facts['activation']} and the "
                             "model's norm in plain torch")


HEAD_TRANSFORM = Part(
    slot="head", name="lm_head_transform", code=None, provides=None,
    reads=(*head.LM_HEAD.reads, "classifier_activation", "classifier_bias"), probe=_probe,
    options=(*head.LM_HEAD.options, "HEAD_TRANSFORM", "HEAD_ACT", "HEAD_DENSE_BIAS"), variants=_variants,
    kernels=_kernels)
