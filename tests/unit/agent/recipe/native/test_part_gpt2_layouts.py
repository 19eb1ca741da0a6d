"""GPT-2-style layouts (agent/recipe/native/parts/layout.py, parts/position_absolute.py and its code
parts/code/position_absolute.py): the model root under another name (gpt2's transformer.h.N, opt's
model.decoder.layers, biogpt's biogpt.layers with its output_projection head) read from transformers' own modules,
absolute positions learned (gpt2's wpe; opt's table whose position 0 is row 2) or fairseq's sinusoids (xglm) added
to the embedding, GPT-2's Conv1D weights transposed at load into the fused q/k/v linear, the layer's own fc1 / fc2
as the plain MLP, a LayerNorm epsilon torch fixes (opt), and gpt_neo's attention inside its wrapper
(attn.attention), unscaled, its local layers (config.attention_layers, window_size) as sliding windows. Each type's
file is held to transformers in float32 and bfloat16 and on the family settings it reads; a file with the part's
arithmetic broken (positions not added, the table's row offset moved, sin and cos swapped, the local window
dropped, q . k scaled) fails the same check. gpt2's check runs by default; opt's, xglm's, biogpt's and gpt_neo's
are slow (the default case of their path: gpt2's)."""

from __future__ import annotations

import re

import pytest

from part_selfcheck import ctx as render_ctx
from part_selfcheck import selfcheck_with_faults

POSITIONS_ADDED = "hidden_states = hidden_states + self.embed_positions(position_ids).to(hidden_states.dtype)"
# type: (position options the probe reads, [(text of the correct file, its faulty replacement), ...])
TYPES = {
    "gpt2": ({"POSITION_OFFSET": 0, "SINUSOIDAL": False}, [(POSITIONS_ADDED, "hidden_states = hidden_states")]),
    "opt": ({"POSITION_OFFSET": 2, "SINUSOIDAL": False},
            [("position_ids = position_ids + 2", "position_ids = position_ids + 1")]),
    "xglm": ({"POSITION_OFFSET": 2, "SINUSOIDAL": True},
             [("torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)",
               "torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)")]),
    "biogpt": ({"POSITION_OFFSET": 2, "SINUSOIDAL": False},
               [("position_ids = position_ids + 2", "position_ids = position_ids + 0")]),
    # gpt_neo: its local layers' window dropped; its unscaled q . k scaled
    "gpt_neo": ({"POSITION_OFFSET": 0, "SINUSOIDAL": False, "UNSCALED": True, "LOCAL_LAYERS": True},
                [('config.window_size if kind == "local" else None', "None"),
                 ("self.scaling = 1.0", "self.scaling = self.head_dim ** -0.5")]),
}


def ctx(model_type: str) -> dict:
    return render_ctx(model_type, "GptForCausalLM")


@pytest.fixture(scope="module")
def derived():
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    found = {}

    def get(model_type):
        if model_type not in found:
            config = AutoConfig.for_model(model_type).to_dict()
            found[model_type] = (config, derive(config))
        return found[model_type]
    return get


def stored_to_skeleton(options: dict, name: str) -> str:
    """A stored tensor name as the generated loader renames it (its CHECKPOINT_RENAMES, in order, once each)."""
    for pattern, replacement in options["CHECKPOINT_RENAMES"]:
        name = re.sub(pattern, replacement, name, count=1)
    return name


@pytest.mark.parametrize("model_type", sorted(TYPES))
def test_the_layout_and_positions_are_read_from_the_architecture(derived, model_type):
    from agent.recipe.native.decide import render_native

    _, composition = derived(model_type)
    want, _ = TYPES[model_type]
    assert composition.parts["position"] == "absolute_positions"
    assert {k: composition.options[k] for k in want} == want
    assert composition.options["ROTARY"] is False and composition.parts["norm"] == "layer_norm"
    assert composition.options["UNSCALED"] is (model_type == "gpt_neo")
    text = render_native(ctx(model_type), composition)
    assert "npu_apply_rotary_pos_emb" not in text and "rotary_emb" not in text
    assert text.count(POSITIONS_ADDED) == 1 and "GptAbsolutePositionEmbedding(config)" in text


@pytest.mark.parametrize("model_type, stored, skeleton", [
    # save_pretrained's names and a hub checkpoint's without the base model's prefix
    ("gpt2", "transformer.h.1.attn.c_attn.weight", "model.layers.1.self_attn.qkv_proj.weight"),
    ("gpt2", "h.0.attn.c_proj.bias", "model.layers.0.self_attn.o_proj.bias"),
    ("gpt2", "h.11.mlp.c_fc.weight", "model.layers.11.mlp.up_proj.weight"),
    ("gpt2", "wpe.weight", "model.embed_positions.weight"),
    ("gpt2", "transformer.ln_f.bias", "model.norm.bias"),
    ("gpt2", "h.2.ln_2.weight", "model.layers.2.post_attention_layernorm.weight"),
    ("opt", "model.decoder.layers.3.fc2.bias", "model.layers.3.mlp.down_proj.bias"),
    ("opt", "decoder.layers.0.self_attn_layer_norm.weight", "model.layers.0.input_layernorm.weight"),
    ("opt", "model.decoder.layers.0.self_attn.out_proj.weight", "model.layers.0.self_attn.o_proj.weight"),
    ("opt", "model.decoder.final_layer_norm.bias", "model.norm.bias"),
    ("biogpt", "output_projection.weight", "lm_head.weight"),
    ("biogpt", "biogpt.layers.0.final_layer_norm.bias", "model.layers.0.post_attention_layernorm.bias"),
    ("gpt_neo", "transformer.h.0.attn.attention.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("gpt_neo", "h.1.attn.attention.out_proj.bias", "model.layers.1.self_attn.o_proj.bias"),
])
def test_stored_names_load_under_the_skeletons(derived, model_type, stored, skeleton):
    _, composition = derived(model_type)
    assert stored_to_skeleton(composition.options, stored) == skeleton


def test_only_gpt2s_conv1d_weights_are_transposed(derived):
    transposed = derived("gpt2")[1].options["TRANSPOSED_WEIGHTS"]
    for name in ("transformer.h.0.attn.c_attn.weight", "h.5.mlp.c_proj.weight"):
        assert any(re.search(p, name) for p in transposed), name
    for name in ("h.0.attn.c_attn.bias", "transformer.wte.weight", "h.0.ln_1.weight"):
        assert not any(re.search(p, name) for p in transposed), name
    assert not derived("opt")[1].options.get("TRANSPOSED_WEIGHTS")      # opt's linears are stored [out, in]


def test_the_skeletons_own_layout_is_read_as_before():
    from transformers import AutoConfig

    from agent.recipe.native.parts.probe import Probe

    probe = Probe(AutoConfig.for_model("llama").to_dict())
    assert probe.layout is None and probe.base is probe.model.model


@pytest.mark.parametrize("model_type, reason", [
    # attention over the whole sequence (xlm's causal false, xlnet's attn_type bi, cpmant's context of ones): before
    # any layout reading
    ("xlm", "the logits at a token follow a later token: the attention is not causal"),
    ("xlnet", "the logits at a token follow a later token: the attention is not causal"),
    ("cpmant", "the logits at a token follow a later token: the attention is not causal"),
])
def test_a_layout_no_part_writes_falls_back_naming_why(model_type, reason):
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.not_native import NotNative

    with pytest.raises(NotNative, match=re.escape(reason)):
        derive(AutoConfig.for_model(model_type).to_dict())


@pytest.mark.parametrize("model_type, reason", [
    ("xlnet", "the layer's MLP, ff (XLNetFeedForward), is neither"),    # an MLP no part reads
    # two children of the base model read as position embeddings, each named
    ("cpmant", "(embed_positions: segment_embedding (Embedding), position_bias (CpmAntSegmentPositionEmbedding))"),
])
def test_the_layouts_of_non_causal_types_name_what_no_part_reads(model_type, reason):
    """Their layouts' refusals (the non-causal attention refuses each type first)."""
    from transformers import AutoConfig

    from agent.recipe.native.parts.probe import Probe

    refusal = Probe(AutoConfig.for_model(model_type).to_dict()).layout.refusal
    assert reason in refusal, refusal


def _check(derived, model_type, tmp_path):
    rows = selfcheck_with_faults({model_type: derived(model_type)}, {model_type: TYPES[model_type][1]},
                                 ctx(model_type)["framework_class"], tmp_path)
    assert any("bfloat16" in label for _, label, ok, _ in rows if ok)
    assert all("differ from transformers" in result["reason"] for _, _, ok, result in rows if not ok)


def test_the_gpt2_file_matches_transformers_and_a_fault_fails(derived, tmp_path):
    _check(derived, "gpt2", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["opt", "xglm", "biogpt", "gpt_neo"])
def test_the_other_layouts_files_match_transformers_and_faults_fail(derived, model_type, tmp_path):
    """Slow: the default case of their path is gpt2's (test_the_gpt2_file_matches_transformers_and_a_fault_fails)."""
    _check(derived, model_type, tmp_path)
