"""beam (transformers' models/beam): its NoPE full-attention layers are the layer types rope_parameters gives None
(parts/rotary_nope.py's "typed_rope": the model hands those layers no rotary table), their queries scaled by
position (parts/attention_ssmax.py, QUERY_SSMAX: (1 + (position + 1) / 2048) ** 0.1 in float32, read at far
positions: at the self-check's it is about 1.001), and its sandwich layer's depth-scaled residual
(parts/block.py DEPTH_SCALED_RESIDUAL: x sqrt((i - 1) / i) + out / sqrt(i), i = 2 (layer + 1), one more for the
MLP). Its output gate with a per-head bias: test_part_attention_params.py. The readings in-process by default; the
whole file against transformers, every family setting and its faults (the query scale dropped, the residual's scales
swapped, no layer rotated): slow."""

from __future__ import annotations

import pytest

# beam at a probe's size: a sliding (rotary) and a full (NoPE) layer, a dense and a sparse one
SMALL = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
         "mlp_layer_types": ["dense", "sparse"]}
FAULTS = {"beam": [
    # the NoPE layers' query scale dropped: 1.0009 at the self-check's decode steps, which its float32 tolerance sees
    # (measured: 0.000589 against 0.000583 at the first decode step; the far positions: the readings above)
    ("query = (query.float() * ssmax_scale(positions[:q_len])[:, None, None]).to(query.dtype)", "query = query"),
    # the attention's sum with the MLP's scales (one count off)
    ("for i in (2 * (layer_idx + 1), 2 * (layer_idx + 1) + 1)]", "for i in (2 * (layer_idx + 1) + 1, 2 * (layer_idx + 1))]"),
    # the sliding layers' rotary dropped too (every layer read as NoPE)
    ("return isinstance(config.rope_parameters.get(config.layer_types[layer_idx]), dict)", "return False"),
]}


def _probe(**changes):
    from transformers import AutoConfig

    from agent.recipe.native.parts.probe import Probe

    return Probe(AutoConfig.for_model("beam", **{**SMALL, **changes}).to_dict())


def test_the_nope_layers_are_the_kinds_without_rope_settings_and_swapping_them_swaps_the_layers():
    """typed_rope, confirmed on the config with the kinds' settings swapped (the file reads them at run time): there
    global_nope (exaone4's full-attention layers NoPE), which gives the same layers on the config, does not hold."""
    from agent.recipe.native.parts.rotary_nope import (ROTARY_NOPE, _rule_holds, nope_rule, rotating_layers,
                                                       swapped_rope_kinds)

    probe = _probe()
    assert rotating_layers(probe) == (True, False)
    match = ROTARY_NOPE.probe(probe, {})
    assert match.options["NOPE_LAYERS"] == "typed_rope" and match.options["ROPE_TYPED_LAYERS"]
    swapped = probe.variant(swapped_rope_kinds(probe.config))
    assert rotating_layers(swapped) == (False, True) and nope_rule(swapped) == "typed_rope"
    assert _rule_holds("global_nope", probe) and not _rule_holds("global_nope", swapped)


def test_the_files_query_scale_is_transformers_at_positions_in_the_thousands():
    import torch
    from transformers.models.beam.modeling_beam import compute_attention_scaling

    from agent.recipe.native.parts.code.attention_ssmax import ssmax_scale

    positions = torch.tensor([0, 1, 17, 2047, 2048, 5000, 65535, 10 ** 6])
    want = compute_attention_scaling(positions[None]).view(-1)
    assert torch.equal(ssmax_scale(positions), want)
    assert want[-1] > 1.5 and want[0] < 1.001          # what the self-check's short prompts barely see


def test_the_query_scale_is_read_and_another_form_refused(monkeypatch):
    """Read on the whole model at far positions; transformers' scale with another exponent is refused, and a
    model that scales nothing reads False (its file then scales nothing)."""
    import torch
    import transformers.models.beam.modeling_beam as beam

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.attention_ssmax import ssmax_query_scale

    assert ssmax_query_scale(_probe()) is True
    original = beam.compute_attention_scaling
    monkeypatch.setattr(beam, "compute_attention_scaling", lambda positions: original(positions) ** 2)
    with pytest.raises(NotNative, match=r"not as the NoPE layers' query scale"):
        ssmax_query_scale(_probe())
    monkeypatch.setattr(beam, "compute_attention_scaling", lambda positions: torch.ones_like(original(positions)))
    assert ssmax_query_scale(_probe()) is False


def test_the_depth_scaled_residual_is_the_sandwich_layers_option():
    from agent.recipe.native.parts.block import SANDWICH

    match = SANDWICH.probe(_probe(), {})
    assert match.options["DEPTH_SCALED_RESIDUAL"] is True and match.options["MLP_NORM"] == "pre_feedforward_layernorm"


@pytest.mark.slow
def test_beam_file_matches_transformers_and_faults_fail(tmp_path):
    """Slow (beam's derive and its file's self-check, every family setting but the rope types'); the default cases
    of its paths: the readings above."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from part_selfcheck import selfcheck_with_faults

    config = AutoConfig.for_model("beam").to_dict()
    composition = derive(config)
    options = composition.options
    assert options["NOPE_LAYERS"] == "typed_rope" and options["QUERY_SSMAX"] and options["DEPTH_SCALED_RESIDUAL"]
    assert options["GATE_BIAS"] and options["FINAL_SOFTCAP"] and composition.parts["moe"] == "sparse_moe"
    selfcheck_with_faults({"beam": (config, composition)}, FAULTS, "BeamForCausalLM", tmp_path)
