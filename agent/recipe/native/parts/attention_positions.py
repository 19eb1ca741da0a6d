"""An attention whose output follows the token positions beyond the rotary tables it is handed. One form is
written: ministral3's llama-4 query scaling, the rotated queries times 1 + beta log(1 + floor(position /
original_max_position_embeddings)), beta rope_parameters' llama_4_scaling_beta (the fused attention's
QUERY_POSITION_SCALE: the file reads both keys at run time, a config without the beta scales nothing). Read
numerically on transformers' attention with one input and one rotary table: at positions far past the original
context, on both sides of a floor step, its output must be the near positions' with each token's q_proj output
times the formula's ratio (the rotary is linear per token, so scaling before or after it is one); any other
position-dependent attention is refused. The self-check's prompts end long before such a position: the attention
part adds a family setting with a small original_max_position_embeddings."""

from __future__ import annotations

import inspect

from agent.recipe.native.not_native import NotNative

FAR = 1 << 20       # past any checkpoint's original context
STEPS = (3, 64)     # the far positions straddle the floor steps at these multiples of the original context


POSITION_ARGS = ("position_ids", "cache_position")     # how transformers' attentions take the positions (5.0: the
                                                      # latter, one row)


def _position_args(attention) -> tuple[str, ...]:
    """The position arguments the attention's forward takes."""
    try:
        params = inspect.signature(attention.forward).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(name for name in POSITION_ARGS if name in params)


def _output(attention, x, table, positions, hook=None):
    import torch

    given = {name: positions if name == "position_ids" else positions[0] for name in _position_args(attention)}
    handle = attention.q_proj.register_forward_hook(hook) if hook is not None else None
    try:
        with torch.no_grad():
            out = attention(hidden_states=x, position_embeddings=table, attention_mask=None, **given)
    finally:
        if handle is not None:
            handle.remove()
    return out[0] if isinstance(out, tuple) else out


def follows_positions(attention, probe) -> bool:
    """Whether `attention`'s output changes with its positions alone (position_ids / cache_position; the same
    hidden states and cos / sin); False where it takes none or cannot be called so (not this reading's to judge)."""
    import torch

    if not _position_args(attention):
        return False
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(1, 4, probe.hidden, generator=gen)
    near = torch.arange(4)[None]
    try:
        table = probe.base.rotary_emb(x, near)
        outputs = [_output(attention, x, table, positions) for positions in (near, near + FAR)]
    except Exception:  # noqa: BLE001 - no rotary_emb, per-layer-type tables, another call shape
        return False
    return not torch.allclose(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)


def llama4_settings(config) -> tuple[float, int] | None:
    """(llama_4_scaling_beta, original_max_position_embeddings) of the config's rope_parameters, or None."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return None
    beta, original = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
    if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not isinstance(original, int) or original < 1:
        return None
    return float(beta), original


def llama4_scale(positions, beta: float, original: int):
    """The formula, in float32 as transformers computes it: 1 + beta log(1 + floor(position / original))."""
    import torch

    return 1 + beta * torch.log(1 + torch.floor(positions / original))


def scales_queries_by_llama4(attention, probe) -> bool:
    """Whether the attention's output at far positions is its output at positions 0..3 (the same rotary table)
    with each token's query times llama4_scale(far) / llama4_scale(near), for the config's beta and original
    context, at positions on both sides of a floor step of each of STEPS."""
    import torch

    settings = llama4_settings(probe.config)
    if settings is None or not isinstance(getattr(attention, "q_proj", None), torch.nn.Linear):
        return False
    beta, original = settings
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(1, 4, probe.hidden, generator=gen)
    near = torch.arange(4)[None]
    try:
        table = probe.base.rotary_emb(x, near)
        for step in STEPS:
            far = step * original - 2 + near
            ratio = llama4_scale(far, beta, original) / llama4_scale(near, beta, original)
            got = _output(attention, x, table, far)
            want = _output(attention, x, table, near, hook=lambda m, args, out: out * ratio[..., None].to(out.dtype))
            if (got - want).abs().max() > 1e-5 * want.abs().max():      # float32 rounding of the output's scale
                return False
    except Exception:  # noqa: BLE001 - another call shape: not this form
        return False
    return True


def query_position_scale(probe, index: int) -> bool:
    """QUERY_POSITION_SCALE: whether layer `index`'s attention scales its queries by llama4_scale; NotNative where
    it follows the positions beyond its rotary tables otherwise."""
    attention = probe.layers[index].self_attn
    if not follows_positions(attention, probe):
        return False
    if scales_queries_by_llama4(attention, probe):
        return True
    raise NotNative("attention", f"{type(attention).__name__}'s output follows the token positions beyond its "
                                 "rotary tables, not as the llama-4 query scaling (1 + llama_4_scaling_beta log(1 + "
                                 "floor(position / original_max_position_embeddings))) the file writes: its "
                                 "attention sees positions only through cos / sin")


def refuse_position_scaling(probe, index: int) -> None:
    """NotNative where layer `index`'s attention follows the positions beyond its rotary tables in a form the file
    does not write."""
    query_position_scale(probe, index)


SMALL_ORIGINAL = 4      # the family setting's original context: the scaling steps within the self-check's prompts


def small_original_setting(config) -> dict:
    """The family setting that exercises the query scaling within the self-check's prompts: rope_parameters with
    original_max_position_embeddings SMALL_ORIGINAL."""
    return {"rope_parameters": {**config.rope_parameters, "original_max_position_embeddings": SMALL_ORIGINAL}}
