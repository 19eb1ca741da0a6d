"""CTRL's fixed sinusoid positions (parts/position_sinusoid.py, code/position_sinusoid.py): the rows the embedding
found added from the base model's buffer are read as CTRL's table when they are, and refused when they are other
rows; the file's table is transformers' own. In-process, on small tables; ctrl's file against transformers is
test_part_layouts_46.py's default self-check, its faults slow there."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def _probe(buffer, max_positions: int):
    import torch

    base = torch.nn.Module()
    base.register_buffer("pos_encoding", buffer, persistent=False)
    return SimpleNamespace(base=base, memo={"position_offset": None, "position_buffer": "pos_encoding"},
                           config=SimpleNamespace(max_position_embeddings=max_positions))


@pytest.mark.parametrize("rows, width", [(256, 1280), (64, 66), (32, 9)])
def test_the_files_table_is_transformers_ctrl_positional_encoding(rows, width):
    import torch
    from transformers.models.ctrl.modeling_ctrl import positional_encoding

    from agent.recipe.native.parts.code.position_sinusoid import ctrl_sinusoid_table
    from agent.recipe.native.parts.position_sinusoid import ctrl_sinusoids

    want = positional_encoding(rows, width, torch.float)
    assert torch.equal(ctrl_sinusoid_table(rows, width), want)
    assert torch.equal(ctrl_sinusoids(rows, width), want)


def test_a_buffer_of_ctrls_rows_is_read_and_other_rows_are_refused():
    import torch
    from transformers.models.ctrl.modeling_ctrl import positional_encoding

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.position_absolute import sinusoids
    from agent.recipe.native.parts.position_sinusoid import SINUSOID_BUFFER_POSITIONS

    table = positional_encoding(64, 32, torch.float)
    match = SINUSOID_BUFFER_POSITIONS.probe(_probe(table, 64), {})
    assert match.options == {"ABSOLUTE_POSITIONS": True} and match.facts == {"buffer": "pos_encoding"}
    # the faults: fairseq's sinusoids (xglm's rates), CTRL's halves swapped, a table of other length than the config's
    for rows in (sinusoids(64, 32), torch.cat([table[:, 16:], table[:, :16]], dim=-1)):
        with pytest.raises(NotNative, match="not CTRL's sinusoids"):
            SINUSOID_BUFFER_POSITIONS.probe(_probe(rows, 64), {})
    with pytest.raises(NotNative, match="holds 64 positions, not the config's max_position_embeddings"):
        SINUSOID_BUFFER_POSITIONS.probe(_probe(table, 128), {})
    # a model without such a buffer: not this part's
    assert SINUSOID_BUFFER_POSITIONS.probe(SimpleNamespace(memo={"position_offset": None}), {}) is None
