"""The input embedding: module.linear's VocabParallelEmbedding, scaled by sqrt(hidden_size) where the architecture
scales it (gemma's normaliser) — read from what reaches the first layer."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.part import Expr, Match, Part


def first_layer_input(probe):
    """(what reaches the first layer, the embedding rows of the same tokens), of equal shape."""
    import torch

    base, seen = probe.base, {}

    def keep(module, args, kwargs):
        seen.setdefault("x", (args[0] if args else kwargs["hidden_states"]).detach())

    handle = base.layers[0].register_forward_pre_hook(keep, with_kwargs=True)
    ids = torch.tensor([[3, 5, 7]])
    try:
        with torch.no_grad():
            probe.model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    table = base.embed_tokens.weight.detach()[ids[0]]
    return seen["x"].reshape(table.shape), table


# where a learned position table's row of position 0 may be (opt and biogpt keep fairseq's 2 padding rows first)
POSITION_OFFSETS = (0, 2)


def position_rows(table):
    """A position table's rows: its weight, or the fixed rows it holds as a buffer (xglm's sinusoids: `weights`)."""
    weight = getattr(table, "weight", None)
    return weight if weight is not None else getattr(table, "weights", None)


def _added_positions(probe, count: int) -> list:
    """(offset, the rows a learned position table adds to `count` tokens at positions 0..) for each row the table's
    position 0 may be at; [(None, 0)] for a model without one."""
    from agent.recipe.native.parts.probe import children

    table = children(probe.base).get("embed_positions")
    if table is None:
        return [(None, 0.0)]
    weight = position_rows(table)
    if weight is None or weight.dim() != 2 or weight.shape[1] != probe.hidden:
        raise NotNative("position", f"{type(table).__name__} is not a table of position rows of width {probe.hidden}")
    return [(offset, weight.detach()[offset:offset + count]) for offset in POSITION_OFFSETS
            if weight.shape[0] >= offset + count]


def embed_scale(probe) -> bool:
    """Whether the model multiplies the embedding lookup by sqrt(hidden_size) (in the model's dtype) before the
    first layer (a learned position table's rows added after: probe.memo["position_offset"], where its position
    0 is); anything other than that or nothing is not native."""
    import torch

    got, table = first_layer_input(probe)
    hidden = probe.hidden
    candidates = _added_positions(probe, table.shape[0])
    from agent.recipe.native.parts.probe import children

    norm = children(probe.base).get("embed_norm")         # bloom's: the embedding normalised before the first layer
    for offset, positions in candidates:
        for scaled in (False, True):
            want = table * torch.tensor(hidden ** 0.5, dtype=table.dtype) if scaled else table
            if norm is not None:
                with torch.no_grad():
                    want = norm(want + positions) - positions
            if torch.allclose(got, want + positions, rtol=1e-5, atol=1e-6):
                probe.memo["position_offset"] = offset
                return scaled
    final = children(probe.base).get("norm")
    if norm is None and final is not None and not any(True for _ in final.parameters()):
        # nanochat's: the base model's final norm, weightless, also normalises the embedding before the first layer
        for scaled in (False, True):
            want = table * torch.tensor(hidden ** 0.5, dtype=table.dtype) if scaled else table
            with torch.no_grad():
                if candidates[:1] == [(None, 0.0)] and torch.allclose(got, final(want), rtol=1e-5, atol=1e-6):
                    probe.memo["position_offset"], probe.memo["embed_final_norm"] = None, True
                    return scaled
    if candidates[:1] != [(None, 0.0)]:
        raise NotNative("position", "the first layer's input is not the embedding (times 1 or sqrt(hidden_size)) "
                                    f"plus the position table's rows from row {' or '.join(map(str, POSITION_OFFSETS))}")
    buffer = added_buffer(probe, got, table)
    if buffer is not None:
        # ctrl's pos_encoding: the position slot reads the buffer's rows (parts/position_sinusoid.py)
        probe.memo["position_offset"], probe.memo["position_buffer"] = None, buffer
        rows = getattr(probe.base, buffer)[:table.shape[0]].to(got.dtype)
        return not torch.allclose(got, table + rows, rtol=1e-5, atol=1e-6)
    raise NotNative("model", "the embedding is scaled by something other than 1 or sqrt(hidden_size)")


def added_buffer(probe, got, table) -> str | None:
    """The name of the base model's own 2-D buffer whose first rows are what the first layer's input adds to the
    embedding (times 1 or sqrt(hidden_size)): ctrl's sinusoid pos_encoding, not a module; None for none."""
    import torch

    for name, buffer in probe.base.named_buffers(recurse=False):
        if buffer.dim() != 2 or buffer.shape[1] != probe.hidden or buffer.shape[0] < table.shape[0]:
            continue
        for scale in (1.0, probe.hidden ** 0.5):
            if torch.allclose(got, table * scale + buffer[:table.shape[0]].to(got.dtype), rtol=1e-5, atol=1e-6):
                return name
    return None


SCALE_KEY = "scale_embedding"       # the config switch of the sqrt(hidden_size) scale (biogpt, xglm)


def _probe(probe, chosen):
    scaled = embed_scale(probe)
    switch = getattr(probe.config, SCALE_KEY, None)
    if isinstance(switch, bool) and switch == scaled:
        try:
            toggled = embed_scale(probe.variant({SCALE_KEY: not switch}))
        except NotNative:
            toggled = scaled
        if toggled != scaled:
            return Match(EMBEDDING, options={"EMBED_SCALE": Expr(f"self.config.{SCALE_KEY}")}, facts={"switch": True})
    return Match(EMBEDDING, options={"EMBED_SCALE": scaled,
                                     **({"EMBED_FINAL_NORM": True} if probe.memo.get("embed_final_norm") else {})})


def _variants(match, probe):
    """The file serves the other setting of the config's scale switch."""
    if not match.facts.get("switch"):
        return []
    return [(SCALE_KEY, {SCALE_KEY: not getattr(probe.config, SCALE_KEY)})]


EMBEDDING = Part(
    slot="embedding", name="embedding", code=None, provides=None, reads=("vocab_size", "hidden_size", "pad_token_id"),
    probe=_probe, options=("EMBED_SCALE", "EMBED_FINAL_NORM"), variants=_variants,
    kernels=lambda m: ((), ("embedding scale sqrt(hidden_size): plain torch multiply",) if m.options["EMBED_SCALE"] else ()))
