"""Absolute positions, learned (gpt2's wpe, opt's and biogpt's tables whose position 0 is row 2) or fixed (xglm's
fairseq sinusoids, computed by the file): a table of position rows added to the input embedding before the first
layer (code/position_learned.py), no rotary in the attention — read numerically from what reaches the first layer
(agent.recipe.native.parts.embedding)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.embedding import embed_scale, position_rows
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children


def _probe(probe, chosen):
    import torch

    table = children(probe.base).get("embed_positions")
    if table is None:
        return None
    if "rotary_emb" in children(probe.base):
        raise NotNative("position", "a position table and a rotary embedding in one model")
    if "position_offset" not in probe.memo:
        embed_scale(probe)
    offset = probe.memo["position_offset"]
    weight = position_rows(table)
    rows = weight.shape[0] - offset
    learned = any(weight is p for p in table.parameters())
    if not learned and not torch.allclose(weight[offset:].float(), sinusoids(weight.shape[0], weight.shape[1])[offset:],
                                          atol=1e-5):
        raise NotNative("position", f"{type(table).__name__}'s fixed rows are not fairseq's sinusoids "
                                    "(sin | cos of position x 10000^(-i / (d/2 - 1)))")
    if rows != probe.config.max_position_embeddings:
        raise NotNative("position", f"a position table of {rows} positions past row {offset}, not the config's "
                                    f"max_position_embeddings ({probe.config.max_position_embeddings})")
    return Match(ABSOLUTE_POSITIONS, options={"ABSOLUTE_POSITIONS": True, "POSITION_OFFSET": offset,
                                             "SINUSOIDAL": not learned},
                 facts={"offset": offset, "sinusoidal": not learned})


def sinusoids(rows: int, width: int):
    """fairseq's sinusoidal rows (xglm's get_embedding; the code file's sinusoid_table): [sin | cos] of
    position x 10000^(-i / (width/2 - 1))."""
    import math

    import torch

    half = width // 2
    freqs = torch.exp(torch.arange(half).float() * -(math.log(10000) / (half - 1)))
    angles = torch.arange(rows).float()[:, None] * freqs[None]
    table = torch.cat([angles.sin(), angles.cos()], dim=1)
    return torch.cat([table, torch.zeros(rows, 1)], dim=1) if width % 2 else table


ABSOLUTE_POSITIONS = Part(
    slot="position", name="absolute_positions", code="position_absolute.py",
    provides="ModelAbsolutePositionEmbedding", reads=("max_position_embeddings", "hidden_size"), probe=_probe,
    options=("ABSOLUTE_POSITIONS", "POSITION_OFFSET", "SINUSOIDAL"),
    kernels=lambda m: ((), (("sinusoidal" if m.facts["sinusoidal"] else "learned") + " position rows: a plain torch "
                            "lookup added to the embedding",)))
