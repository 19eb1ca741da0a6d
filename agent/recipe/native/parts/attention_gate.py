"""An attention output gate from a projection of its own (afmoe's and beam's gate_proj, laguna's g_proj): o_proj
takes the attention's output times act(gate(x)), act a sigmoid (afmoe) or a softplus (laguna), per channel (the
gate as wide as the heads' output) or per head (one gate per head, over its head_dim). qwen3_next's gate, held in
q_proj beside each head's query, is attention.output_gated. The fused attention part (code/attention_fused.py)
writes the gate as options of its own: GATE_PROJ (the checkpoint's name of the projection), GATE_SOFTPLUS,
GATE_PER_HEAD, GATE_BIAS (beam's gate_bias: one per head, a parameter of the attention, added to the projection's
output before the sigmoid); the projection is a column-parallel linear split by heads like the queries, the gate's
activation and product plain torch (elementwise: no fused kernel takes them)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.probe import children

GATE_NAMES = ("gate_proj", "g_proj")     # the architectures' names of the gate projection
GATE_MODULE = "output_gate"              # the generated file's (gate_proj is the MLP's stacked gate/up name there)
GATE_BIAS = "gate_bias"                  # beam's bias of the gate, one per head, a parameter of the attention


def _activations():
    import torch

    return {"sigmoid": torch.sigmoid, "softplus": torch.nn.functional.softplus}


def output_gate(attention, probe, heads: int | None = None, head_dim: int | None = None) -> dict | None:
    """The gate's options (GATE_PROJ, GATE_SOFTPLUS, GATE_PER_HEAD), or None for an attention without a separate
    gate projection; NotNative for one whose gate is not act(gate(x)) times the attention's output, act a sigmoid
    or a softplus, per channel or per head. Measured on the module: o_proj's input with the gate's weights zero
    (act(0) times the attention's output) and with them random (act(g)): their ratio is act(g) / act(0), g the
    projection's output, broadcast over each head's head_dim where the gate is one per head."""
    import torch

    a = children(attention)
    names = [name for name in GATE_NAMES if name in a]
    if not names:
        return None
    name = names[0]
    gate, o_proj = a[name], a.get("o_proj")
    # `heads`: the layer's own (laguna's per layer); `head_dim`: the width of each head's output (MLA's v_head_dim)
    heads, head_dim = heads or probe.heads, head_dim or probe.head_dim
    widths = {heads * head_dim: False, heads: True}
    if not isinstance(gate, torch.nn.Linear) or gate.out_features not in widths or not isinstance(o_proj, torch.nn.Linear):
        raise NotNative("attention", f"{type(attention).__name__}.{name} is not a linear of the heads' width "
                                     f"({heads * head_dim}) or one per head ({heads})")
    if gate.bias is not None:
        raise NotNative("attention", f"{type(attention).__name__}.{name} has a bias, which the file's gate does not add")
    per_head = widths[gate.out_features]
    rotary = getattr(probe.base, "rotary_emb", None)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(1, 6, probe.hidden, generator=gen)
    random_rows = torch.randn(gate.weight.shape, generator=gen)
    # beam's gate_bias: one per head, added to the projection's output before the activation
    bias = getattr(attention, GATE_BIAS, None)
    if bias is not None and (per_head or tuple(bias.shape) != (heads,)):
        raise NotNative("attention", f"{type(attention).__name__}.{GATE_BIAS} of shape {tuple(bias.shape)}: the file "
                                     f"adds one per head ({heads}) to a gate per channel")
    saved_bias = bias.detach().clone() if bias is not None else None
    random_bias = torch.randn((heads,), generator=gen)
    seen = {}
    hooks = [o_proj.register_forward_pre_hook(lambda m, args: seen.__setitem__("gated", args[0].detach())),
             gate.register_forward_hook(lambda m, args, out: seen.__setitem__("gate", out.detach()))]
    saved = gate.weight.detach().clone()
    outputs = []
    try:
        cos_sin = _cos_sin(rotary, x, attention, probe) if rotary is not None else None
        for rows, head_bias in ((torch.zeros_like(saved), torch.zeros(heads)), (random_rows, random_bias)):
            with torch.no_grad():
                gate.weight.copy_(rows)
                if bias is not None:
                    bias.copy_(head_bias)
                attention(hidden_states=x, position_embeddings=cos_sin, attention_mask=None)
            outputs.append((seen["gated"], seen["gate"]))
    except Exception as exc:  # noqa: BLE001 - not callable as transformers' usual attention: not measured
        raise NotNative("attention", f"{type(attention).__name__}.{name}: the output gate could not be measured "
                                     f"({type(exc).__name__})") from exc
    finally:
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            gate.weight.copy_(saved)
            if bias is not None:
                bias.copy_(saved_bias)
    (base, _), (gated, g) = outputs
    base, gated = base.reshape(1, 6, heads, -1), gated.reshape(1, 6, heads, -1)
    g = g.reshape(1, 6, heads, -1) + (random_bias.view(1, 1, heads, 1) if bias is not None else 0)
    for act_name, act in _activations().items():
        want = base * (act(g) / act(torch.zeros(())))
        if base.abs().max() > 0 and torch.allclose(gated, want, rtol=1e-4, atol=1e-6):
            return {"GATE_PROJ": name, "GATE_SOFTPLUS": act_name == "softplus", "GATE_PER_HEAD": per_head,
                    **({"GATE_BIAS": True} if bias is not None else {})}
    raise NotNative("attention", f"{type(attention).__name__}.{name}: the attention's output is not times "
                                 "sigmoid or softplus of the gate (per channel or per head)")


def _cos_sin(rotary, x, attention, probe):
    """The rotary table of the attention's layer for x's positions (laguna's rotary takes the layer's type), None
    for a layer type the config gives no rotary."""
    import torch

    positions = torch.arange(x.shape[1])[None]
    try:
        return rotary(x, positions)
    except TypeError:
        types = getattr(probe.base.config, "layer_types", None) or [None]
        layer_type = types[getattr(attention, "layer_idx", 0)]
        per_type = getattr(probe.base.config, "rope_parameters", None)
        if isinstance(per_type, dict) and layer_type in per_type and per_type[layer_type] is None:
            return None                 # a layer type without rotary (beam's NoPE full-attention layers)
        return rotary(x, positions, layer_type=layer_type)


def gate_kernel(options: dict) -> str:
    """The kernels line of a gate with `options` (GATE_SOFTPLUS, GATE_PER_HEAD)."""
    return (f"output gate: {'softplus' if options['GATE_SOFTPLUS'] else 'sigmoid'} of its own projection "
            f"{'per head' if options['GATE_PER_HEAD'] else 'per channel'} times the attention's output, plain torch "
            "(elementwise: no fused kernel takes it)")


def renames(name: str) -> tuple:
    """The checkpoint's gate tensors under the file's module name (CHECKPOINT_RENAMES rows)."""
    return ((f"\\.self_attn\\.{name}\\.", f".self_attn.{GATE_MODULE}."),)
