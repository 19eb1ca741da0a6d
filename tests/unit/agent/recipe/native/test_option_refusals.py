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


@pytest.mark.parametrize("after_rope, refused", [(True, True), (False, False)])
def test_beams_query_scale_with_a_query_norm_after_the_rotary_is_refused(monkeypatch, after_rope, refused):
    """The scale is read on the query norm's output; a norm placed after the rotary would normalise away the scale the
    file applies before it."""
    from agent.recipe.native.parts import attention
    from agent.recipe.native.parts.part import Match

    facts = {"QUERY_SSMAX": True, "Q_NORM": True, "K_NORM": True, "QK_NORM_AFTER_ROPE": after_rope}
    monkeypatch.setattr(attention, "dense_attention", lambda probe: dict(facts))
    nope = {"position": Match(attention.FUSED_PAGED, options={"NOPE_LAYERS": "typed_rope"})}
    if refused:
        with pytest.raises(NotNative, match="query scale with a query norm after the rotary"):
            attention._dense_match(attention.FUSED_PAGED, SimpleNamespace(), nope)
    else:
        assert attention._dense_match(attention.FUSED_PAGED, SimpleNamespace(), nope).options["QUERY_SSMAX"]
