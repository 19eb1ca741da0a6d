"""Parameters an attention holds directly (agent/recipe/native/parts/attention_params.py): gpt_neox_japanese's
dense_bias, on the last layer only, added to the attention's output before the residual (the file's o_proj bias on
that layer: O_BIAS the test of the layer's index), and beam's gate_bias, one per head inside the output gate's
sigmoid (GATE_BIAS, read with the gate by parts/attention_gate.py). Both are zero as transformers builds them: the
probes set them to random values, and a parameter of that name that does not act so is refused.
gpt_neox_japanese's file is held to transformers, and a file without the last layer's bias fails the same check, in
test_part_gates_sub_norms.py (its float32 case beside afmoe's in the default suite; bfloat16 and the family's
settings slow); beam's depth-scaled residual, written by the sandwich layer (DEPTH_SCALED_RESIDUAL), is read here
(beam's file: test_part_beam.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def _probe(model_type: str, **changes):
    """A probe of `model_type` at a tiny size (its own layers, config and model)."""
    from agent.recipe.native.parts.probe import Probe
    from transformers import AutoConfig

    return Probe({**AutoConfig.for_model(model_type).to_dict(), **changes})


@pytest.mark.slow
def test_a_dense_bias_that_is_not_the_last_layers_output_bias_is_refused(monkeypatch):
    """A dense_bias on another layer than the last, and one transformers' layer does not add (the attention returns
    no bias): not the file's o_proj bias. Default-suite coverage of the same path (the bias read and held to
    transformers): test_part_gates_sub_norms.py::test_the_files_match_transformers_and_a_dropped_gate_sigmoid_fails."""
    import torch

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.attention import attention_layers
    from agent.recipe.native.parts.attention_params import LAST_LAYER, last_layer_output_bias

    probe = _probe("gpt_neox_japanese", num_hidden_layers=2)
    assert last_layer_output_bias(probe, attention_layers(probe)) == {"O_BIAS": LAST_LAYER}
    last = probe.layers[-1].self_attn
    forward = last.forward
    monkeypatch.setattr(last, "forward", lambda *a, **k: (*forward(*a, **k)[:2], None))
    with pytest.raises(NotNative, match="dense_bias is not added to the attention's output"):
        last_layer_output_bias(probe, attention_layers(probe))
    monkeypatch.undo()
    probe.layers[0].self_attn.dense_bias = torch.nn.Parameter(torch.zeros(probe.hidden))
    with pytest.raises(NotNative, match=r"dense_bias on layers \[0, 1\]"):
        last_layer_output_bias(probe, attention_layers(probe))


def _attention_of(model_type: str, **changes):
    """(a layer's attention of `model_type` built by transformers at a tiny size, a probe-like record of its
    widths)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=8, num_hidden_layers=1, intermediate_size=16, moe_intermediate_size=16,
                                  num_experts=4, vocab_size=64, **changes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    return model.model.layers[0].self_attn, SimpleNamespace(heads=4, head_dim=8, hidden=32, base=model.model)


def test_beams_gate_bias_is_read_and_one_the_gate_does_not_add_is_refused():
    """beam's gate_bias enters the sigmoid per head (GATE_BIAS); a gate_bias on afmoe's attention, whose forward
    never reads it, is refused by the same measurement."""
    import torch

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.attention_gate import output_gate

    beam = _attention_of("beam", layer_types=["sliding_attention"], mlp_layer_types=["dense"])
    assert output_gate(*beam) == {"GATE_PROJ": "gate_proj", "GATE_SOFTPLUS": False, "GATE_PER_HEAD": False,
                                  "GATE_BIAS": True}
    attention, probe = _attention_of("afmoe")
    attention.gate_bias = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(NotNative, match="not times sigmoid or softplus of the gate"):
        output_gate(attention, probe)


@pytest.mark.parametrize("where, reason", [
    ("base", r"LlamaModel has parameters \['input_scale'\] of its own"),
    ("layer", r"layer 1 has parameters \['input_scale'\] of its own"),
])
def test_a_base_model_or_layer_with_parameters_of_its_own_is_refused(where, reason):
    """zaya's input_hidden_states_scale / _bias sit on its base model (ones and zeros as built): no part reads such a
    parameter, so the model part names it; planted on llama's base model and on its second layer."""
    import torch

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.model import refuse_own_parameters

    probe = SimpleNamespace(base=torch.nn.Module(), layers=[torch.nn.Module(), torch.nn.Module()])
    probe.base.__class__ = type("LlamaModel", (torch.nn.Module,), {})
    refuse_own_parameters(probe)
    owner = probe.base if where == "base" else probe.layers[1]
    owner.input_scale = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(NotNative, match=reason):
        refuse_own_parameters(probe)


def test_beams_depth_scaled_residual_is_read_and_another_scaling_is_not():
    """beam's layer i adds x * sqrt((i - 1) / i) + out / sqrt(i) (block.residual_scaled with its depth: the sandwich
    layer's DEPTH_SCALED_RESIDUAL, test_part_beam.py); the same layer read at another depth, or with its
    attention's sum shifted by one, is not that form (the generic reason stays)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from agent.recipe.native.parts.block import residual_scaled

    config = AutoConfig.for_model("beam", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  num_hidden_layers=2, intermediate_size=16, vocab_size=64,
                                  layer_types=["sliding_attention"] * 2, mlp_layer_types=["dense"] * 2)
    layers = AutoModelForCausalLM.from_config(config).eval().model.layers
    roles = {"attention_in": "input_layernorm", "attention_out": "post_attention_layernorm",
             "mlp_in": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm"}
    assert residual_scaled(layers[0], 32, 1.0, roles, depth=0) and residual_scaled(layers[1], 32, 1.0, roles, depth=1)
    assert not residual_scaled(layers[0], 32, 1.0, roles)
    assert not residual_scaled(layers[1], 32, 1.0, roles, depth=0)
    layers[0].attn_residual_add_idx += 1
    assert not residual_scaled(layers[0], 32, 1.0, roles, depth=0)
