"""The norms of a decoder layer by their role in its forward, whatever the architecture names them: the attention's
input norm, its output norm, the MLP's input norm, its output norm (glm4's post_self_attn_layernorm is the
attention's output norm, its post_attention_layernorm the MLP's input norm; apertus' attention_layernorm the
attention's input norm). Read by running the layer with the attention and the MLP replaced by recorders and
every other child hooked: a child whose output the attention takes is its input norm, a child that takes the
attention's output is its output norm."""

from __future__ import annotations

from agent.recipe.native.parts.probe import children

ROLES = ("attention_in", "attention_out", "mlp_in", "mlp_out")


def probe_roles(layer, hidden: int) -> dict:
    """role -> the layer's child name for `layer` ({} where the layer is not callable as a pre-norm layer is,
    another call shape, no self_attn / mlp, or where two children play one role). One child may play two roles
    (cohere's one norm before both the attention and the MLP): the block parts tell the layouts apart."""
    import torch

    names = children(layer)
    attention, mlp = names.get("self_attn"), names.get("mlp")
    if attention is None or mlp is None:
        return {}
    gen = torch.Generator().manual_seed(11)
    a, m = (torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5 for _ in range(2))
    seen: dict = {"calls": {}}

    def attend(hidden_states, *args, **kwargs):
        seen["attention_in"] = hidden_states
        seen["attention_out"] = hidden_states @ a
        return seen["attention_out"], None

    def feed(hidden_states, *args, **kwargs):
        seen["mlp_in"] = hidden_states
        seen["mlp_out"] = hidden_states @ m
        return seen["mlp_out"]

    def hook(name):
        def keep(module, args, kwargs, out):
            first = args[0] if args else next(iter(kwargs.values()), None)
            seen["calls"].setdefault(name, []).append((first, out[0] if isinstance(out, tuple) else out))
        return keep

    others = {name: child for name, child in names.items() if name not in ("self_attn", "mlp")}
    handles = [child.register_forward_hook(hook(name), with_kwargs=True) for name, child in others.items()]
    saved = attention.forward, mlp.forward
    x = torch.randn(1, 3, hidden, generator=gen)
    try:
        attention.forward, mlp.forward = attend, feed
        with torch.no_grad():
            layer(x, attention_mask=None, position_ids=None, position_embeddings=None)
    except Exception:  # noqa: BLE001 - another call shape: not a layer the block parts write
        return {}
    finally:
        attention.forward, mlp.forward = saved
        for handle in handles:
            handle.remove()
    if "attention_in" not in seen or "mlp_in" not in seen:
        return {}
    roles: dict = {}
    for name, calls in seen["calls"].items():
        for first, out in calls:
            for role in ROLES:
                # an input norm's output is what the attention (MLP) takes; an output norm takes what it returns
                tensor = out if role.endswith("_in") else first
                if tensor is seen[role]:
                    if roles.get(role, name) != name:
                        return {}
                    roles[role] = name
    return roles


def norm_roles(probe) -> dict:
    """role -> child name, one mapping for every layer ({} where a layer's roles cannot be read); memoised."""
    if "norm_roles" not in probe.memo:
        found = [probe_roles(layer, probe.hidden) for layer in probe.layers]
        probe.memo["norm_roles"] = found[0] if found and all(f == found[0] for f in found) else {}
    return probe.memo["norm_roles"]


def layer_norm_names(probe, layer, by_name: tuple) -> tuple:
    """The names of `layer`'s norms: those read by role, and those of `by_name` it has."""
    names = children(layer)
    return tuple(dict.fromkeys([*norm_roles(probe).values(), *(n for n in by_name if n in names)]))
