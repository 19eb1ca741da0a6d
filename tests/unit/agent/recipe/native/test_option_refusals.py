"""Options whose code paths do not compose are refused together, in one line, before a file is written."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agent.recipe.native.not_native import NotNative


def test_an_mtp_draft_with_chunked_attention_is_refused():
    from agent.recipe.native.parts import mtp
    from agent.recipe.native.parts.part import Match

    probe = SimpleNamespace(full_config=SimpleNamespace(num_nextn_predict_layers=1), model_type="deepseek_v3")
    assert mtp._probe(probe, {}) is not None                     # the draft alone is written
    chunked = {"attention": Match(mtp.MTP, options={"CHUNKED": True})}
    with pytest.raises(NotNative, match="MTP draft with chunked local attention"):
        mtp._probe(probe, chunked)


@pytest.mark.parametrize("read", ["_by_roles", "_by_fused_roles"])
def test_mlp_multipliers_on_an_mlp_read_by_role_are_refused(read):
    """falcon_h1's mlp_multipliers are written for the gated MLP under its own names; an MLP read by role would
    otherwise drop them (at [1, 1]) or fall back with the wrong reason."""
    from agent.recipe.native.parts import mlp

    source = SimpleNamespace(config=SimpleNamespace(mlp_multipliers=[1.0, 1.0]))
    with pytest.raises(NotNative, match="mlp_multipliers on object, an MLP read by role"):
        getattr(mlp, read)(source, [object()], "hidden_act", ("silu",), {}, "silu")
