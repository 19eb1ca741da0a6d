"""The model root under another name (gpt2's transformer.h.N, opt's model.decoder.layers): transformers' modules of
such a layout read under the skeleton's names (model.embed_tokens, model.layers.N.self_attn, ...), found by what
they are, not by a table of names: the base model (transformers' base_model_prefix; a lone `decoder` inside it), its
input embedding (get_input_embeddings), its one ModuleList of layers, a second embedding (learned positions), its
final norm; in a layer, the attention (its class) and the MLP, the norms by where the layer calls them (before the
attention: input_layernorm; before the MLP: post_attention_layernorm); in the attention, the q/k/v and output
projections by their widths. The parts then read them by the skeleton's names (probe.children), and the
checkpoint's tensors, named as transformers stores them (with or without the base model's prefix), are renamed to
them at load (`renames`); a Conv1D's weight, stored [in, out], is transposed (`transposed`: its stored names). The
GPT-J / NeoX-era roots read the same way (gpt_neox.*, transformer.h.N.attn, a layer's one norm before both branches:
its input_layernorm); a plain MLP's linears by their role (`mlp_roles`: the one its forward calls first is up_proj),
renamed by the MLP part, the one part that reads them."""

from __future__ import annotations

import re
from dataclasses import dataclass

CHILDREN = "_native_children"     # a module's children under the skeleton's names, read by probe.children
SHORT_CONV_CHILDREN = {"in_proj", "conv", "out_proj"}     # lfm2's Lfm2ShortConv (parts/short_conv.py)
SKELETON_MODEL = {"embed_tokens", "layers", "norm", "rotary_emb"}
# minimax's MiniMaxLightningAttention, held as self_attn (parts/linear_attention_lightning.py)
LIGHTNING_CHILDREN = {"qkv_proj", "output_gate", "out_proj", "norm", "act_fn"}


@dataclass
class Layout:
    base: object                                  # the module whose children are the skeleton's model.*
    renames: tuple = ()                           # (pattern, replacement) on the checkpoint's names, in order
    transposed: tuple = ()                        # patterns of the stored names of Conv1D weights
    refusal: str | None = None                    # a layer shape no part writes (the model part raises it)
    embed_norm: bool | str = False                # a norm of the embedding before the first layer (bloom's); "after
                                                  # positions": of the embedding plus its positions (trocr's)
    one_mixer: tuple = ()                         # (norm, mixer): layers of one mixer behind one norm (nemotron_h's)


def present(parent, roles: dict, hide: tuple = ()) -> None:
    """`parent`'s children read under the skeleton's names (`roles`: its child's name -> the skeleton's, or
    skeleton name -> a module standing for several children), attributes of those names too where it has none."""
    import torch

    named = {name: child for name, child in parent.named_children() if not isinstance(child, torch.nn.Dropout)}
    shown, hidden = {}, set(hide)
    for name, role in roles.items():
        if isinstance(role, str):
            shown[role] = named[name]
            hidden.add(name)
        else:
            shown[name] = role
            hidden |= {n for n, child in named.items() if any(child is c for c in role.children())}
    shown.update({name: child for name, child in named.items() if name not in hidden})
    parent.__dict__[CHILDREN] = shown
    for name, child in shown.items():
        if not hasattr(parent, name):
            object.__setattr__(parent, name, child)


def mlp_view(up, act, down):
    """A layer's MLP made of the layer's own children (opt's fc1 / activation_fn / fc2): down(act(up(x)))."""
    import torch

    class LayerMLP(torch.nn.Module):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.up_proj(x)))

    view = LayerMLP()
    view.up_proj, view.act_fn, view.down_proj = up, act, down
    return view


def _named(module) -> dict:
    import torch

    return {name: child for name, child in module.named_children() if not isinstance(child, torch.nn.Dropout)}


def weightless_lists(module) -> set:
    """The names of `module`'s ModuleLists that hold no weights (granite_swa's rotary_embs, one rotary table per
    rope base): tables the position part computes, not a list of decoder layers."""
    import torch

    return {name for name, child in _named(module).items()
            if isinstance(child, torch.nn.ModuleList) and len(child) and not any(True for _ in child.parameters())}


def is_mamba2_mixer(module) -> bool:
    """A Mamba2 mixer by what it holds (A_log, D, dt_bias; in_proj, conv1d, out_proj), whatever its class's name."""
    own = {name for name, _ in module.named_parameters(recurse=False)}
    names = {name for name, _ in module.named_children()}
    return {"A_log", "D", "dt_bias"} <= own and {"in_proj", "conv1d", "out_proj"} <= names


def is_mamba1_mixer(module) -> bool:
    """A Mamba1 mixer (jamba's, mamba's: x_proj and dt_proj, A_log of a state per channel), which
    parts/linear_attention_mamba1.py writes."""
    own = {name for name, _ in module.named_parameters(recurse=False)}
    names = {name for name, _ in module.named_children()}
    return {"A_log", "D"} <= own and {"x_proj", "dt_proj", "conv1d"} <= names


def is_mamba_mixer(module) -> bool:
    """A Mamba2 or a Mamba1 mixer: the file's linear_attn."""
    return is_mamba2_mixer(module) or is_mamba1_mixer(module)


def is_kda(module) -> bool:
    """A Kimi Delta Attention (kimi_linear's, bailing_hybrid's) by what it holds: q/k/v projections, a depthwise
    conv1d, a forget_gate with A_log and dt_bias, b_proj and a gated o_norm."""
    named = _named(module) if module is not None else {}
    gate = named.get("forget_gate")
    return ({"q_proj", "k_proj", "v_proj", "conv1d", "b_proj", "o_norm", "o_proj"} <= set(named)
            and gate is not None and hasattr(gate, "A_log") and hasattr(gate, "dt_bias"))


def move_to_linear_attn(layer) -> None:
    """A layer's Kimi Delta Attention, held as self_attn, read as its linear_attn (the parts that read self_attn see
    the full-attention layers alone); transformers' forward still finds it under self_attn."""
    module = layer._modules.pop("self_attn")
    layer._modules["linear_attn"] = module
    original = type(layer).forward

    def forward(*args, **kwargs):
        layer._modules["self_attn"] = module
        try:
            return original(layer, *args, **kwargs)
        finally:
            del layer._modules["self_attn"]

    layer.forward = forward


def mixer_name(layers) -> str | None:
    """The one child name under which `layers` hold a Mamba mixer (bamba's and jamba's `mamba`), or None."""
    names = {name for layer in layers for name, child in layer.named_children() if is_mamba_mixer(child)}
    return names.pop() if len(names) == 1 else None


def _is_norm(module) -> bool:
    return "norm" in type(module).__name__.lower() and not list(module.children())


def projection_widths(module):
    """(in, out) of a Linear or a Conv1D (weight [in, out]); None for anything else."""
    import torch
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):
        return module.nx, module.nf
    return None


def call_order(model, layer) -> list:
    """The names of `layer`'s children in the order its forward calls them (one forward of the model)."""
    order, handles = [], []
    for name, child in _named(layer).items():
        handles.append(child.register_forward_pre_hook(lambda *args, name=name: order.append(name)))
    _forward_hooked(model, handles)
    return list(dict.fromkeys(order))


def _forward_hooked(model, handles: list) -> None:
    """One forward of the model on three tokens, the hooks of `handles` removed after it whatever it raises."""
    import torch

    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 5, 7]]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()


def _prefixed(path: str) -> str:
    """The pattern of a stored name's start: the base model's prefix optional (a hub checkpoint of the base model
    stores `h.0...`, save_pretrained of the causal LM `transformer.h.0...`)."""
    head, _, rest = path.partition(".")
    return f"^(?:{re.escape(head)}\\.)?{re.escape(rest)}\\." if rest else f"^{re.escape(head)}\\."


def read_layout(model, hidden: int) -> Layout | None:
    """The layout of `model` where its root is not the skeleton's `model.layers` (its modules presented under the
    skeleton's names), else None."""
    import torch

    top = _named(model)
    prefix = getattr(model, "base_model_prefix", "")
    root, head = top.get(prefix), model.get_output_embeddings()
    head_name = next((name for name, child in top.items() if child is head), None)
    transform = head_transform_name(model, top, prefix, head_name) if root is not None and head_name else None
    if root is None or head_name is None or set(top) - {prefix, head_name, transform}:
        return None
    path, base = prefix, root
    inner = _named(root)
    if set(inner) == {"decoder"}:
        path, base = f"{prefix}.decoder", inner["decoder"]
    elif prefix == "model" and head_name == "lm_head" and set(inner) - weightless_lists(root) <= SKELETON_MODEL:
        _lift_attention_rotary(root)
        unwrapped = _unwrap_linears(root)
        layout = _mixer_layout(root) or _lightning_layout(root)      # the skeleton's own layout
        if unwrapped:
            layout = layout or Layout(root)
            layout.renames += unwrapped
        return layout
    present(model, {prefix: "model", head_name: "lm_head", **({transform: HEAD_TRANSFORM} if transform else {})})
    # the transform's rename first: its stored name may be lm_head (modernbert-decoder's), the head's new one
    renames = [(f"^{re.escape(transform)}\\.", f"{HEAD_TRANSFORM}.")] if transform else []
    renames += [(f"^{re.escape(head_name)}\\.", "lm_head.")] if head_name != "lm_head" else []
    children = _named(base)
    lists = [name for name, child in children.items() if isinstance(child, torch.nn.ModuleList)
             and name not in weightless_lists(base)]
    embedding = input_embedding(model, root)
    wrapper = embedding_wrapper(children, embedding)
    roles = {}
    for name, child in children.items():
        if child is embedding:
            roles[name] = "embed_tokens"
        elif name in lists and len(lists) == 1:
            roles[name] = "layers"
        elif isinstance(child, torch.nn.Embedding) or "position" in type(child).__name__.lower():
            roles[name] = "embed_positions"
        elif _is_norm(child) and getattr(getattr(child, "weight", None), "shape", None) == (hidden,):
            roles[name] = "norm"
    norms = [name for name, role in roles.items() if role == "norm"]
    if len(norms) == 2 and len(lists) == 1:
        # bloom's word_embeddings_layernorm: the norm the base model calls before its layers normalises the embedding
        # (the layers' list is never called itself: the norm called right after the embedding is the first)
        order = call_order(model, base)
        embed = next((n for n, role in roles.items() if role == "embed_tokens"), None)
        if embed in order and all(n in order for n in norms):
            first = min(norms, key=order.index)
            if order.index(first) == order.index(embed) + 1:
                roles[first] = "embed_norm"
    elif len(norms) == 1 and len(lists) == 1 and _runs_before_layers(model, children[norms[0]], children[lists[0]]):
        # trocr's layernorm_embedding, of the embedding plus its positions: its post-LN layers leave no final norm
        roles[norms[0]] = "embed_norm"
    if len(set(roles.values())) != len(roles) or (wrapper and "embed_norm" in roles.values()):
        return Layout(base, refusal=duplicate_roles_text(children, roles))
    if wrapper:
        # modernbert-decoder's embeddings: its tok_embeddings and norm read as the skeleton's embedding and its norm
        name, inner = wrapper
        held = _named(children[name])
        present(base, {**roles, "embed_tokens": held[inner["embed_tokens"]], "embed_norm": held[inner["embed_norm"]]},
                hide=(name,))
        renames += [(_prefixed(f"{path}.{name}.{stored}"), f"model.{role}.") for role, stored in inner.items()]
    else:
        present(base, roles)
    for name in children:
        if not wrapper or name != wrapper[0]:
            renames.append((_prefixed(f"{path}.{name}"), f"model.{roles.get(name, name)}."))
    if "layers" not in roles.values():
        return Layout(base, tuple(renames), refusal=f"no one list of decoder layers in the base model (module "
                                                    f"lists: {', '.join(lists) or 'none'})")
    embed_norm = "embed_norm" in roles.values() or bool(wrapper)
    if embed_norm and "embed_positions" in roles.values():
        # whether the norm takes the embedding plus its positions: the position table called before it
        order = call_order(model, base)
        positions, norm = (next(n for n, role in roles.items() if role == r) for r in ("embed_positions", "embed_norm"))
        if positions in order and norm in order and order.index(positions) < order.index(norm):
            embed_norm = "after positions"
    layout = Layout(base, tuple(renames), embed_norm=embed_norm)
    _layer_roles(model, list(base.layers), hidden, layout)
    return layout


HEAD_TRANSFORM = "head_transform"       # the skeleton's name of a transform before the output head


def head_transform_name(model, top: dict, prefix: str, head_name: str) -> str | None:
    """The causal LM's one child beside its base model and output head that takes the base model's output and hands
    the head its own (modernbert-decoder's lm_head: dense, activation, LayerNorm before its `decoder` Linear), read
    from one forward; parts/head_transform.py holds what it computes. None where there is no such child."""
    import torch

    others = [name for name in top if name not in (prefix, head_name)]
    if len(others) != 1 or not any(True for _ in top[others[0]].parameters()):
        return None
    seen, handles = {}, []
    for name in (prefix, others[0], head_name):
        def keep(module, args, kwargs, out, name=name):
            first = args[0] if args else next(iter(kwargs.values()), None)
            seen.setdefault(name, (first, out[0] if isinstance(out, tuple) else getattr(out, "last_hidden_state", out)))
        handles.append(top[name].register_forward_hook(keep, with_kwargs=True))
    try:
        _forward_hooked(model, handles)
    except Exception:  # noqa: BLE001 - a model this forward cannot run: not read so
        return None
    if len(seen) != 3:
        return None
    (_, base_out), (transform_in, transform_out), (head_in, _) = (seen[n] for n in (prefix, others[0], head_name))
    same = all(isinstance(t, torch.Tensor) for t in (base_out, transform_in, transform_out, head_in)) \
        and torch.equal(transform_in, base_out) and torch.equal(head_in, transform_out)
    return others[0] if same else None


def embedding_wrapper(children: dict, embedding) -> tuple | None:
    """(child name, {embed_tokens: its name, embed_norm: its name}) for the base model's child that holds the input
    embedding and one norm alone (modernbert-decoder's embeddings: norm(tok_embeddings(ids))); the embedding part
    holds what reaches the first layer numerically. None where the embedding is the base model's own child."""
    for name, child in children.items():
        held = _named(child)
        found = [n for n, c in held.items() if c is embedding]
        norms = [n for n, c in held.items() if _is_norm(c)]
        if found and len(held) == 2 and len(norms) == 1:
            return name, {"embed_tokens": found[0], "embed_norm": norms[0]}
    return None


def duplicate_roles_text(children: dict, roles: dict) -> str:
    """The refusal of a base model with two children read in one role (cpmant's segment_embedding and its relative
    position_bias, both read as position embeddings), naming them with their classes."""
    taken = [role for role in dict.fromkeys(roles.values()) if list(roles.values()).count(role) > 1]
    text = "; ".join(f"{role}: " + ", ".join(f"{name} ({type(children[name]).__name__})"
                                           for name, r in roles.items() if r == role) for role in taken)
    return f"more than one position embedding or final norm in the base model ({text}): no part writes both"


def _runs_before_layers(model, norm, layers) -> bool:
    """Whether the base model's one norm runs before its first layer (one forward of the model)."""
    order, handles = [], []
    if not len(layers):
        return False
    handles.append(norm.register_forward_pre_hook(lambda *args: order.append("norm")))
    handles.append(layers[0].register_forward_pre_hook(lambda *args: order.append("layer")))
    try:
        _forward_hooked(model, handles)
    except Exception:  # noqa: BLE001 - a model this forward cannot run: not read so
        return False
    return order[:2] == ["norm", "layer"]


def input_embedding(model, root):
    """The base model's input embedding: its own get_input_embeddings, or the causal LM's where a wrapper of the
    decoder cannot say (trocr's TrOCRDecoderWrapper: NotImplementedError, "not auto-handled")."""
    try:
        return root.get_input_embeddings()
    except NotImplementedError:
        return model.get_input_embeddings()


def _lift_attention_rotary(root) -> None:
    """moshi's rotary held by each attention (`self_attn.rotary_emb`, none in the base model): read as the base
    model's table where every attention holds one of one class and the same frequencies (weightless: no checkpoint
    name moves); the position part then probes its arithmetic as any model's. Else left for the attention's check."""
    import torch

    if "rotary_emb" in _named(root) or not isinstance(getattr(root, "layers", None), torch.nn.ModuleList):
        return
    attentions = [getattr(layer, "self_attn", None) for layer in root.layers]
    tables = [getattr(a, "rotary_emb", None) for a in attentions]
    if not tables or any(not isinstance(t, torch.nn.Module) for t in tables):
        return
    first = tables[0]
    freqs = getattr(first, "inv_freq", None)
    if freqs is None or any(type(t) is not type(first) or getattr(t, "attention_scaling", None)
                            != getattr(first, "attention_scaling", None) or not torch.equal(t.inv_freq, freqs)
                            for t in tables):
        return
    for attention in attentions:
        present(attention, {}, hide=("rotary_emb",))
        _take_handed_table(attention)
    present(root, {})
    root.__dict__[CHILDREN]["rotary_emb"] = first
    object.__setattr__(root, "rotary_emb", first)


def wrapped_linear(module):
    """The one Linear a wrapper module holds and forwards to unchanged (moshi's MoshiLinear: `q_proj.linear`), read
    from what it holds (one Linear, no parameter of its own) and held numerically (wrapper(x) == linear(x)); None for
    anything else."""
    import torch

    named = _named(module)
    if isinstance(module, torch.nn.Linear) or len(named) != 1 or any(True for _ in module.parameters(recurse=False)):
        return None
    (name, inner), = named.items()
    if type(inner) is not torch.nn.Linear:
        return None
    x = torch.randn(2, 3, inner.in_features, generator=torch.Generator().manual_seed(5))
    try:
        with torch.no_grad():
            same = torch.equal(module(x), inner(x))
    except Exception:  # noqa: BLE001 - a wrapper that takes other inputs: not a plain linear
        return None
    return (name, inner) if same else None


def _unwrap_linears(root) -> tuple:
    """The projections in the decoder layers held inside a wrapper of one Linear (moshi's attention's
    `q_proj.linear`, MoshiLinear with use_flexible_linear off) read as that Linear under the wrapper's name, and the
    stored names renamed to it at load (`self_attn.q_proj.linear.weight` -> `self_attn.q_proj.weight`)."""
    import torch

    layers = getattr(root, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        return ()
    renames = {}
    for layer in layers:
        for path, module in layer.named_modules():
            # as probe.children shows them (the children under the skeleton's names where read so before)
            shown = dict(module.__dict__.get(CHILDREN) or _named(module))
            found = {name: wrapped_linear(child) for name, child in shown.items()}
            found = {name: inner for name, inner in found.items() if inner is not None}
            if not found:
                continue
            for name, (inner_name, linear) in found.items():
                shown[name] = linear
                stored = f"{path}.{name}" if path else name
                renames[(f"^(model\\.layers\\.\\d+\\.{re.escape(stored)})\\.{re.escape(inner_name)}\\.", "\\1.")] = None
            module.__dict__[CHILDREN] = shown
    return tuple(renames)


def _take_handed_table(attention) -> None:
    """An attention that computes its cos / sin from its own rotary (moshi's) made to take the table a probe hands
    it (`position_embeddings`), as the skeleton's attention does; transformers' own forward hands none and runs as
    built. Its own table is the base model's (_lift_attention_rotary checks), so the two agree wherever the model
    runs; without this, a probe holding the table fixed and moving the positions would see them move the output."""
    import functools

    import torch

    original = attention.forward

    class Handed(torch.nn.Module):
        def __init__(self, table):
            super().__init__()
            self.table = table

        def forward(self, *args, **kwargs):
            return self.table

    @functools.wraps(original)
    def forward(*args, position_embeddings=None, **kwargs):
        if position_embeddings is None:
            return original(*args, **kwargs)
        own = attention._modules["rotary_emb"]
        attention._modules["rotary_emb"] = Handed(position_embeddings)
        try:
            return original(*args, **kwargs)
        finally:
            attention._modules["rotary_emb"] = own

    attention.forward = forward


def _mixer_layout(root) -> Layout | None:
    """In the skeleton's own layout, its layers' Mamba2 mixer under another name (granitemoehybrid's mamba) read as
    the file's linear_attn; None where there is none."""
    layers = list(getattr(root, "layers", None) or [])
    mixer = mixer_name(layers)
    if mixer is None and any(is_kda(getattr(layer, "self_attn", None)) for layer in layers):
        for layer in layers:
            if is_kda(getattr(layer, "self_attn", None)):
                move_to_linear_attn(layer)
        return Layout(root)     # the file keeps the checkpoint's self_attn (parts/linear_attention_kda.py)
    if mixer is None or mixer == "linear_attn":
        return None
    for layer in layers:
        if mixer in _named(layer) and is_mamba_mixer(_named(layer)[mixer]):
            present(layer, {mixer: "linear_attn"})
            if "self_attn" in layer.__dict__ and layer.self_attn is None:
                del layer.self_attn          # no attention beside the mixer (granitemoehybrid sets it None)
    return Layout(root, ((f"^model\\.layers\\.(\\d+)\\.{re.escape(mixer)}\\.", "model.layers.\\1.linear_attn."),))


def is_lightning(module) -> bool:
    """minimax's lightning attention by what it holds (qkv_proj, output_gate, out_proj, norm, act_fn), whatever its
    class's name; parts/linear_attention_lightning.py checks its arithmetic."""
    return set(_named(module)) == LIGHTNING_CHILDREN


def _lightning_layout(root) -> Layout | None:
    """In the skeleton's own layout, a linear attention held as self_attn (minimax's lightning attention layers, beside
    its softmax ones) read as the file's linear_attn, its stored names renamed to it; None where there is none."""
    found = [layer for layer in getattr(root, "layers", None) or []
             if "self_attn" in _named(layer) and is_lightning(_named(layer)["self_attn"])]
    if not found:
        return None
    for layer in found:
        _read_as_linear_attn(layer)
    names = "|".join(sorted(LIGHTNING_CHILDREN - {"act_fn"}))
    return Layout(root, ((f"^model\\.layers\\.(\\d+)\\.self_attn\\.({names})\\.", "model.layers.\\1.linear_attn.\\2."),))


def _read_as_linear_attn(layer) -> None:
    """`layer`'s self_attn moved to linear_attn (the parts read a layer with self_attn as a softmax attention's); the
    layer's own forward, which calls self_attn, finds it there while it runs."""
    module = layer._modules.pop("self_attn")
    layer._modules["linear_attn"] = module
    forward = layer.forward

    def run(*args, **kwargs):
        layer._modules["self_attn"] = module
        try:
            return forward(*args, **kwargs)
        finally:
            del layer._modules["self_attn"]

    layer.forward = run


def _mlp_of_linears(named: dict, order: list, hidden: int):
    """(up, activation, down) names where the layer holds its MLP's linears itself (opt's fc1 / fc2), called in
    that order after the attention; None otherwise."""
    linears = [n for n in order if projection_widths(named[n]) is not None]
    if len(linears) != 2:
        return None
    up, down = linears
    (up_in, inner), (down_in, down_out) = projection_widths(named[up]), projection_widths(named[down])
    if (up_in, down_in, down_out) != (hidden, inner, hidden):
        return None
    between = order[order.index(up) + 1:order.index(down)]
    if len(between) != 1:
        return None
    return up, between[0], down


def _layer_roles(model, layers, hidden: int, layout: Layout) -> None:
    """A layer's attention, MLP and norms under the skeleton's names; the renames and transposed weights they need."""
    import torch
    from transformers.pytorch_utils import Conv1D

    if one_mixer_names(layers) is not None:
        _one_mixer_roles(layers, layout)
        return
    # the roles read on the first layer with an attention where the first layers hold a short convolution instead
    # (lfm2's conv layers)
    reference = layers[0]
    if not _attentions(reference) and any(set(_named(c)) == SHORT_CONV_CHILDREN for c in _named(reference).values()):
        reference = next((layer for layer in layers if len(_attentions(layer)) == 1), reference)
    if first_unnormed(layers):
        reference = layers[1]           # its norms read where the first layer holds an identity in one's place
    named = _named(reference)
    order = call_order(model, reference)
    # a cross-attention and its norm the causal LM never calls (trocr's encoder_attn: no encoder states): not read,
    # its stored tensors skipped at load
    unused = tuple(n for n, c in named.items() if n not in order)
    if unused and all(n in _attentions(reference) or _is_norm(c) for n, c in named.items() if n in unused):
        named = {n: c for n, c in named.items() if n not in unused}
    else:
        unused = ()
    attentions = [n for n in _attentions(reference) if n in named]
    norms = [n for n, c in named.items() if _is_norm(c)]
    roles, mlp = {}, None
    if len(attentions) == 1:
        roles[attentions[0]] = "self_attn"
    # a hybrid's Mamba2 mixer (bamba's mamba): the file's linear_attn, the attention's place in its layers' norm order
    mixer = mixer_name(layers)
    if mixer is not None:
        roles[mixer] = "linear_attn"
    branch = attentions if len(attentions) == 1 else [name for name in (mixer,) if name in named]
    mlps = [n for n, c in named.items() if n == "mlp" or "mlp" in type(c).__name__.lower()]
    if not mlps:
        # an MLP as a Sequential of its linears and activation (ctrl's ffn): read by mlp_roles as any plain MLP
        mlps = [n for n, c in named.items() if isinstance(c, torch.nn.Sequential) and mlp_roles(c) is not None]
    if len(mlps) == 1:
        roles[mlps[0]] = "mlp"
        mlp_calls = mlps[0]
    else:
        rest = [n for n in order if n not in (*attentions, *norms)]
        mlp = _mlp_of_linears(named, rest, hidden)
        mlp_calls = mlp[0] if mlp else None
        if mlp is None and len(attentions) == 1:
            kinds = ", ".join(f"{n} ({type(named[n]).__name__})" for n in rest)
            layout.refusal = (f"the layer's MLP, {kinds}, is neither a module named mlp nor the layer's own up / down "
                              "linears: no part reads it")
    if mixer is not None and not mlp_calls and layout.refusal is None:
        # one-mixer Mamba2 layers beside layers of another shape (zamba2's hybrid layers: a transformer block shared
        # across layers, over the hidden state and the embedding, with a linear back)
        others = {type(layer).__name__: ", ".join(_named(layer)) for layer in layers
                  if mixer not in _named(layer) or len(_named(layer)) != 2}
        shapes = "; ".join(f"{cls} ({names})" for cls, names in others.items())
        layout.refusal = (f"layers of {shapes or 'another shape'} beside its Mamba2 layers (the mixer {mixer!r} behind "
                          "one norm): no part writes them (zamba2's hybrid layers: a transformer block shared across layers)")
    if len(branch) == 1 and mlp_calls and len(norms) == 2:
        calls = [n for n in order if n in (*norms, branch[0], mlp_calls)]
        if len(calls) == 4 and calls[0] in norms and calls[1] == branch[0] and calls[2] in norms \
                and calls[3] == mlp_calls:
            roles[calls[0]], roles[calls[2]] = "input_layernorm", "post_attention_layernorm"
        elif len(calls) == 4 and calls[0] == branch[0] and calls[2] == mlp_calls and calls[1] in norms \
                and calls[3] in norms:
            # post-LN (openai-gpt's norm(h + attn(h))): each norm after its branch, held numerically by
            # parts/block_post_ln.py
            roles[calls[1]], roles[calls[3]] = "post_attention_layernorm", "post_feedforward_layernorm"
        elif len(calls) == 4 and calls[0] in norms and calls[1] in norms and calls[2:] == [branch[0], mlp_calls]:
            # both norms before the attention (falcon's new architecture: ln_attn, ln_mlp): the parallel layer on
            # two norms, each branch's held numerically by parts/block_parallel.py
            roles[calls[0]], roles[calls[1]] = "input_layernorm", "post_attention_layernorm"
        elif calls[:1] == branch[:1]:
            layout.refusal = ("its norms after the attention in an order no part writes (neither pre-LN nor "
                              "post-LN norm(h + attn(h)))")
    elif len(attentions) == 1 and mlp_calls and len(norms) == 4:
        # a sandwich layer (lfm3's operator_norm, post_operator_norm, ffn_norm, post_ffn_norm): each branch's input
        # and output norm by where the layer calls them, held numerically by parts/block.py's SANDWICH
        calls = [n for n in order if n in (*norms, attentions[0], mlp_calls)]
        if len(calls) == 6 and calls[1] == attentions[0] and calls[4] == mlp_calls \
                and all(calls[i] in norms for i in (0, 2, 3, 5)):
            roles.update(zip((calls[i] for i in (0, 2, 3, 5)), ("input_layernorm", "post_attention_layernorm",
                                                                 "pre_feedforward_layernorm",
                                                                 "post_feedforward_layernorm")))
    elif len(attentions) == 1 and mlp_calls and len(norms) == 1:
        # one norm before both branches (gptj's ln_1: the parallel layer's input norm)
        calls = [n for n in order if n in (*norms, attentions[0], mlp_calls)]
        if calls[:2] == [norms[0], attentions[0]]:
            roles[norms[0]] = "input_layernorm"
    layer = r"^model\.layers\.(\d+)\."
    for name, skeleton in roles.items():
        if name != skeleton:
            layout.renames += ((f"{layer}{re.escape(name)}\\.", f"model.layers.\\1.{skeleton}."),)
    if mlp:
        for name, skeleton in zip(mlp[::2], ("up_proj", "down_proj")):
            layout.renames += ((f"{layer}{re.escape(name)}\\.", f"model.layers.\\1.mlp.{skeleton}."),)
    attention_roles, inner = {}, None
    if len(attentions) == 1 and list(_named(named[attentions[0]])) == ["attention"]:
        # the attention inside a wrapper (gpt_neo's attn.attention): read and loaded as the layer's self_attn
        inner = _named(named[attentions[0]])["attention"]
        layout.renames = tuple(r for r in layout.renames if r[1] != "model.layers.\\1.self_attn.") + (
            (f"{layer}{re.escape(attentions[0])}\\.attention\\.", "model.layers.\\1.self_attn."),)
    if len(attentions) == 1:
        attention_module = inner if inner is not None else named[attentions[0]]
        projections = {n: w for n, c in _named(attention_module).items() if (w := projection_widths(c))}
        separate = {"q_proj", "k_proj", "v_proj"}
        if len(projections) == 2 and not separate & set(projections):
            (a, wa), (b, wb) = projections.items()
            qkv, out = (a, b) if wa[1] > wb[1] else (b, a)
            if projections[qkv][0] == hidden and projections[out][1] == hidden:
                attention_roles = {qkv: "qkv_proj", out: "o_proj"}
        elif separate <= set(projections) and len(projections) == 4:
            attention_roles = {next(n for n in projections if n not in separate): "o_proj"}
        elif len(projections) == 4 and not separate & set(projections):
            # ctrl's Wq / Wk / Wv / dense: three named by their last letter, the fourth the output (the self-check
            # holds which is which)
            by_letter = {n[-1].lower(): n for n in projections if n[-1].lower() in "qkv"}
            if len(by_letter) == 3:
                attention_roles = {by_letter[letter]: f"{letter}_proj" for letter in "qkv"}
                attention_roles[next(n for n in projections if n not in by_letter.values())] = "o_proj"
    for name, skeleton in attention_roles.items():
        if name != skeleton:
            layout.renames += ((f"{layer}self_attn\\.{re.escape(name)}\\.", f"model.layers.\\1.self_attn.{skeleton}."),)
    mixers = _other_mixers(layers, roles, attentions)
    for name in sorted(set(mixers.values())):
        layout.renames += ((f"{layer}{re.escape(name)}\\.", "model.layers.\\1.linear_attn."),)
    for index, module in enumerate(layers):
        children = _named(module)
        shown = {name: role for name, role in roles.items()
                 if name in children and (name != mixer or is_mamba_mixer(children[name]))}
        if index in mixers:
            shown[mixers[index]] = "linear_attn"
        if mlp:
            shown["mlp"] = mlp_view(*(children[n] for n in mlp))
        if inner is not None:
            shown = {k: v for k, v in shown.items() if k != attentions[0]}
            shown["self_attn"] = _named(children[attentions[0]])["attention"]
        present(module, shown, hide=((attentions[0],) if inner is not None else ()) + unused)
        if attention_roles and index not in mixers and attentions[0] in children:
            present(shown["self_attn"] if inner is not None else children[attentions[0]], attention_roles)
    # Conv1D weights as stored ([in, out]), by their stored names
    stored = next((pattern for pattern, target in layout.renames if target == "model.layers."), None)
    for path, module in layers[0].named_modules():
        if isinstance(module, Conv1D) and stored is not None:
            layout.transposed += (f"{stored}\\d+\\.{re.escape(path)}\\.weight$",)


def first_unnormed(layers) -> bool:
    """Whether the first layer holds an identity (nn.Identity) under a name where the second holds a norm, and is
    otherwise named as it (modernbert-decoder's layer 0 attn_norm); parts/block_first_unnormed.py writes it."""
    import torch

    if len(layers) < 2:
        return False
    first, second = _named(layers[0]), _named(layers[1])
    swapped = [n for n, c in first.items() if isinstance(c, torch.nn.Identity)]
    return set(first) == set(second) and bool(swapped) and all(_is_norm(second[n]) for n in swapped)


def one_mixer_names(layers) -> tuple | None:
    """(norm, mixer): the child names where every layer holds one norm and one other module, a mixer (nemotron_h's
    blocks: an attention, a Mamba2 mixer, an MLP or a sparse-MoE block behind one norm; mamba2's layers); None
    otherwise."""
    shapes = set()
    for layer in layers:
        named = _named(layer)
        norms = [name for name, child in named.items() if _is_norm(child)]
        if len(named) != 2 or len(norms) != 1:
            return None
        shapes.add((norms[0], next(name for name in named if name != norms[0])))
    return shapes.pop() if len(shapes) == 1 else None


def mixer_role(module) -> str:
    """The skeleton's name of a one-mixer layer's mixer: linear_attn (a Mamba2 or Mamba1 mixer), self_attn (an
    attention by its class), else mlp (an MLP or a sparse-MoE block)."""
    if is_mamba_mixer(module):
        return "linear_attn"
    return "self_attn" if "attention" in type(module).__name__.lower() else "mlp"


def _one_mixer_roles(layers, layout: Layout) -> None:
    """Each layer's norm and mixer read under the skeleton's names (input_layernorm; self_attn, linear_attn or mlp by
    what the mixer is); the file keeps the checkpoint's names (parts/block_one_mixer.py), so no renames."""
    norm, mixer = one_mixer_names(layers)
    moe = sorted({type(_named(layer)[mixer]).__name__ for layer in layers if "experts" in _named(_named(layer)[mixer])})
    if moe:
        layout.refusal = (f"a sparse-MoE block ({', '.join(moe)}) as a layer's one mixer behind one norm (nemotron_h's moe "
                          "layers): no part writes a one-mixer MoE layer")
    layout.one_mixer = (norm, mixer)
    for layer in layers:
        present(layer, {norm: "input_layernorm", mixer: mixer_role(_named(layer)[mixer])})


def _attentions(layer) -> list:
    return [n for n, c in _named(layer).items() if "attention" in type(c).__name__.lower()]


def _other_mixers(layers, roles: dict, attentions: list) -> dict:
    """layer index -> the one child a layer without the attention holds in its place where it is a gated short
    convolution (lfm2's conv), read as the skeleton's linear_attn (parts/short_conv.py reads it); {} where every
    layer has the attention."""
    if len(attentions) != 1:
        return {}
    found = {}
    for index, module in enumerate(layers):
        named = _named(module)
        if attentions[0] in named:
            continue
        rest = [n for n in named if n not in roles and n != "linear_attn"]
        # only a mixer the linear-attention slot reads (a gated short convolution): another (a Mamba mixer) keeps
        # its name, and the model part names it
        if len(rest) == 1 and set(_named(named[rest[0]])) == SHORT_CONV_CHILDREN:
            found[index] = rest[0]
    return found


# a plain MLP's roles, in the order its forward calls them: down(act(up(x)))
MLP_ROLES = ("up_proj", "act_fn", "down_proj")


def call_mlp(mlp, x):
    """mlp(x); an MLP whose forward adds the layer's residual itself (mpt's ffn(x, residual)) given a zero one: its
    own output."""
    import inspect

    import torch

    if "residual" in inspect.signature(mlp.forward).parameters:
        return mlp(x, torch.zeros_like(x))
    return mlp(x)


def mlp_roles(mlp) -> dict | None:
    """A plain MLP's children by role, whatever the architecture names them (starcoder2's and gpt2's c_fc / act /
    c_proj, gptj's fc_in / fc_out, gpt_neox's dense_h_to_4h / dense_4h_to_h, phi's fc1 / activation_fn / fc2):
    {role of MLP_ROLES: child name} for two linears and one other child, the linears in the order one
    forward calls them; None for another MLP."""
    import torch

    named = _named(mlp)
    linears = [name for name, child in named.items() if projection_widths(child) is not None]
    others = [name for name in named if name not in linears]
    if not others:
        # an activation held as a plain function (openai-gpt's act = gelu_new), not a child module
        others = [name for name, value in vars(mlp).items() if not name.startswith("_") and callable(value)
                  and not isinstance(value, torch.nn.Module)]
    if len(linears) != 2 or len(others) != 1:
        return None
    (a_in, a_out), (b_in, b_out) = (projection_widths(named[n]) for n in linears)
    order, handles = [], [named[n].register_forward_pre_hook(lambda *args, n=n: order.append(n)) for n in linears]
    try:
        # the hidden width: the input of the one linear, the output of the other
        for width in dict.fromkeys(w for w, back in ((a_in, b_out), (b_in, a_out)) if w == back):
            order.clear()
            try:
                with torch.no_grad():
                    call_mlp(mlp, torch.zeros(1, width))
                break
            except Exception:  # noqa: BLE001 - not callable on this width: the other, or not this MLP
                order.clear()
    finally:
        for handle in handles:
            handle.remove()
    if sorted(order) != sorted(linears):
        return None
    return dict(zip(MLP_ROLES, (order[0], others[0], order[1])))
