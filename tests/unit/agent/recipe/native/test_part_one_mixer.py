"""The one-mixer decoder layer (agent/recipe/native/parts/block_one_mixer.py: nemotron_h's blocks, one mixer behind
one norm, config.layer_types naming each layer's: an attention, a Mamba2 mixer or an MLP) with the parts it needs:
the Mamba2 mixer under nemotron_h's config keys (parts/linear_attention_mamba2.py KEYS), attention without positions
on every layer (parts/position_none.py) and nemotron_h's relu2 MLP (parts/mlp_plain.py). The whole file is derived
from the type's config, rendered and held to transformers by the generator's own self-check (packed prefill, decode
steps, the Mamba states' blocks NaN before the prefill). The default case, nemotron_h's smallest model with each
kind once (Mamba2, attention, MLP) in float32 with the layer's norm skipped, runs beside bamba's in
test_part_mamba2_hybrids.py::test_bamba_file_matches_transformers_and_a_dropped_d_skip_fails; every case here is
slow."""

from __future__ import annotations

import pytest

from locations import REPO_ROOT
from part_selfcheck import write_with_faults

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"

# nemotron_h's smallest model: a Mamba2 layer, an attention layer, an MLP layer (its pattern "M*-")
SMALL = {"hybrid_override_pattern": "M*-", "ssm_state_size": 16, "chunk_size": 16}
# a planted fault in the rendered file: (text, replacement), each of which the self-check must catch
FAULTS = {
    # the mixer on the residual stream as it is (the layer's norm skipped)
    "norm": ("hidden_states, residual = self.norm(hidden_states, past_residual)",
             "residual = hidden_states if past_residual is None else hidden_states + past_residual\n"
             "        hidden_states = residual"),
    # relu where the MLP squares it (relu2)
    "relu2": ("self.act_fn = ACT2FN[config.mlp_hidden_act]", "self.act_fn = ACT2FN[\"relu\"]"),
    # dt clamped to config.time_step_limit, not from nemotron_h's time_step_min
    "dt_min": ("self.time_step_limit = (config.time_step_min, float(\"inf\"))",
               "self.time_step_limit = (0.0, float(\"inf\"))"),
}


def _render(tmp_path, faults, changes=None):
    """(config, the good file's path, each fault's file path) of nemotron_h's smallest model."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.decide import render_native

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    config = AutoConfig.for_model("nemotron_h", **SMALL, **(changes or {})).to_dict()
    composition = derive(config)
    assert composition.parts["block"] == "one_mixer" and composition.parts["position"] == "no_positions"
    assert composition.options["MAMBA_HEADS"] == "mamba_num_heads" and composition.options["MAMBA_EXPAND"] is None
    ctx = {"model_name": "nemotron_h", "framework_class": "NativeForCausalLM", "display_name": "nemotron_h",
           "model_class": "X"}
    text = render_native(ctx, composition)
    good, bad = write_with_faults(text, FAULTS, faults, tmp_path)
    return config, good, bad


def _job(config, path, dtype="float32"):
    return {"config": config, "file": str(path), "class_name": "NativeForCausalLM", "dtype": dtype}


@pytest.mark.slow
def test_nemotron_h_file_matches_transformers_and_a_skipped_layer_norm_fails(tmp_path):
    """nemotron_h's smallest model (Mamba2, attention and MLP layers, each one mixer behind one norm), derived and
    rendered: float32 within 1e-4 of transformers at the prefill and every decode step; the file whose layers skip
    their norm fails at the prefill. Default case covering this path (the same check, run beside bamba's):
    test_part_mamba2_hybrids.py::test_bamba_file_matches_transformers_and_a_dropped_d_skip_fails."""
    from agent.recipe.native.decide import selfcheck

    config, good, (bad,) = _render(tmp_path, ["norm"])
    good_result, bad_result = selfcheck([_job(config, good), _job(config, bad)], SNAPSHOT)
    assert good_result["ok"] and good_result["max_rel"] < 1e-4, good_result
    assert not bad_result["ok"] and "prefill" in bad_result["reason"], bad_result


@pytest.mark.slow
def test_nemotron_h_in_both_dtypes_and_its_faults_fail(tmp_path):
    """float32 and bfloat16; relu for relu2 and dt clamped from 0 for time_step_min each fail. Default case covering
    this path: test_part_mamba2_hybrids.py::test_bamba_file_matches_transformers_and_a_dropped_d_skip_fails."""
    from agent.recipe.native.decide import selfcheck

    faults = ["relu2", "dt_min"]
    config, good, bad = _render(tmp_path, faults, {"time_step_min": 0.5})
    results = selfcheck([_job(config, good), _job(config, good, "bfloat16")] + [_job(config, p) for p in bad],
                        SNAPSHOT)
    assert all(r["ok"] for r in results[:2]), results[:2]
    assert not any(r["ok"] for r in results[2:]), list(zip(faults, results[2:]))


@pytest.mark.slow
def test_the_mixer_keys_are_read_by_what_they_change():
    """The Mamba2 mixer's sizes under each architecture's keys, each found by building the mixer with the key changed:
    bamba's are the code's defaults (no option), nemotron_h's its own (heads x head_dim its inner width, dt clamped
    from time_step_min); a mixer whose head count no candidate key sets is refused naming it. Default case covering
    this path: test_part_mamba2_hybrids.py::test_bamba_file_matches_transformers_and_a_dropped_d_skip_fails."""
    from transformers import AutoConfig
    from transformers.models.nemotron_h import modeling_nemotron_h

    from transformers.models.bamba import modeling_bamba

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.linear_attention_mamba2 import DEFAULT_KEYS, mixer_keys

    bamba = AutoConfig.for_model("bamba", hidden_size=64, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2)
    assert mixer_keys(modeling_bamba.BambaMixer(bamba, layer_idx=0), bamba, 0) == DEFAULT_KEYS

    config = AutoConfig.for_model("nemotron_h", **SMALL, hidden_size=64, mamba_num_heads=8, mamba_head_dim=8,
                                  n_groups=2)
    mixer = modeling_nemotron_h.NemotronHMamba2Mixer(config, layer_idx=0)
    keys = mixer_keys(mixer, config, 0)
    assert keys == {"MAMBA_HEADS": "mamba_num_heads", "MAMBA_HEAD_DIM": "mamba_head_dim", "MAMBA_GROUPS": "n_groups",
                    "MAMBA_STATE": "ssm_state_size", "MAMBA_CONV": "conv_kernel", "MAMBA_EXPAND": None,
                    "MAMBA_CONV_BIAS": "use_conv_bias", "MAMBA_PROJ_BIAS": "use_bias",
                    "MAMBA_DT_MIN": "time_step_min"}, keys

    class FixedHeads(modeling_nemotron_h.NemotronHMamba2Mixer):
        def __init__(self, config, layer_idx):
            super().__init__(config, layer_idx)
            self.num_heads = 8                  # a head count no config key sets

    with pytest.raises(NotNative, match="sets its heads"):
        mixer_keys(FixedHeads(config, 0), config, 0)


# mamba2's smallest model: two Mamba2 layers, no attention and no MLP (parts/no_attention.py)
MAMBA2 = {"num_hidden_layers": 2, "state_size": 16, "chunk_size": 16}


@pytest.mark.slow
def test_mamba2_file_in_both_dtypes_and_a_dropped_d_skip_fails(tmp_path):
    """mamba2 (Mamba2 layers alone: no attention, no MLP, no positions) derived and rendered: its layer builds the
    mixer alone and its parallel check splits no attention heads; float32 within 1e-4 and bfloat16 within the
    precision rule at the prefill and every decode step; the recurrence without its D skip fails at the prefill.
    Default case covering this path (the one-mixer layer, the Mamba2 mixer under another architecture's keys):
    test_part_mamba2_hybrids.py::test_bamba_file_matches_transformers_and_a_dropped_d_skip_fails."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.decide import render_native, selfcheck

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    config = AutoConfig.for_model("mamba2", **MAMBA2).to_dict()
    composition = derive(config)
    assert {slot: composition.parts[slot] for slot in ("position", "attention", "mlp", "block")} == {
        "position": "no_positions", "attention": "no_attention", "mlp": "no_mlp", "block": "one_mixer"}
    text = render_native({"model_name": "mamba2", "framework_class": "NativeForCausalLM", "display_name": "mamba2",
                          "model_class": "X"}, composition)
    assert "Attention" not in text and "layer_types" not in text and "num_attention_heads" not in text
    good, bad = tmp_path / "good.py", tmp_path / "skip.py"
    good.write_text(text)
    assert text.count("+ D[:, None] * x[t]") == 1
    bad.write_text(text.replace("+ D[:, None] * x[t]", ""))
    jobs = [_job(config, good), _job(config, good, "bfloat16"), _job(config, bad)]
    fp32, bf16, skip = selfcheck(jobs, SNAPSHOT)
    assert fp32["ok"] and fp32["max_rel"] < 1e-4, fp32
    assert bf16["ok"], bf16
    assert not skip["ok"] and "prefill" in skip["reason"], skip


@pytest.mark.slow
def test_no_positions_only_where_the_model_hands_its_attention_none():
    """The no-positions part matches nemotron_h (no rotary table, none handed to its attention layers) and refuses the
    same model once its attention layers are handed a table (a planted rotary): that model's positions are another
    part's. Default case covering this path: nemotron_h's,
    test_part_mamba2_hybrids.py::test_bamba_file_matches_transformers_and_a_dropped_d_skip_fails."""
    import torch
    from transformers import AutoConfig

    from agent.recipe.native.parts.position_none import NO_POSITIONS
    from agent.recipe.native.parts.probe import Probe, children

    probe = Probe(AutoConfig.for_model("nemotron_h", **SMALL).to_dict())
    assert NO_POSITIONS.probe(probe, {}).options == {"NO_POSITIONS": True}
    table = (torch.ones(1, 4, 128), torch.zeros(1, 4, 128))
    for layer in probe.layers:
        if "self_attn" in children(layer):
            layer.self_attn.register_forward_pre_hook(
                lambda module, args, kwargs: (args, {**kwargs, "position_embeddings": table}), with_kwargs=True)
    assert NO_POSITIONS.probe(probe, {}) is None


@pytest.mark.slow
def test_nemotron_h_keeps_its_lm_head_untied_where_its_config_says_tie(tmp_path):
    """nemotron_h's class ties no weights (its _tied_weights_keys is empty): its composition serves no tied variant and
    its file keeps lm_head apart (the head part's NEVER_TIED), so a tied checkpoint (no lm_head.weight, which
    transformers would serve with a random head) is refused naming the missing tensor, where the file that ties
    anyway would run silently. Default case covering the head's path:
    test_part_mamba2_hybrids.py::test_bamba_file_matches_transformers_and_a_dropped_d_skip_fails."""
    from agent.recipe.native.decide import selfcheck

    config, good, _ = _render(tmp_path, [], {"tie_word_embeddings": True})
    text = good.read_text()
    old = "        tied = False\n"
    assert text.count(old) == 1
    bad = tmp_path / "tied.py"
    bad.write_text(text.replace(old, ""))
    refused, tied = selfcheck([_job(config, good), _job(config, bad)], SNAPSHOT)
    assert not refused["ok"] and "lm_head.weight" in refused["reason"], refused
    assert tied["reason"] is None or "lm_head.weight" not in tied["reason"], tied


# mamba's and falcon_mamba's smallest models: two Mamba1 layers alone (parts/linear_attention_mamba1.py as the
# one-mixer layer's mixer); falcon_mamba's dt / B / C take weightless RMS norms
MAMBA1 = {"num_hidden_layers": 2, "state_size": 8, "expand": 2}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba"])
def test_mamba1_model_file_in_both_dtypes_and_a_dropped_d_skip_fails(model_type, tmp_path):
    """mamba / falcon_mamba (Mamba1 layers alone: no attention, no MLP, no positions) derived and rendered as mamba2 is;
    float32 within 1e-4 and bfloat16 within the precision rule at the prefill and every decode step; the selective
    scan without its D skip fails at the prefill. Default case covering this path (the one-mixer layer; the Mamba1
    mixer, in jamba's hybrid): test_part_mamba2_hybrids.py::test_bamba_file_matches_transformers_and_a_dropped_d_skip_fails."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.decide import render_native, selfcheck

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    config = AutoConfig.for_model(model_type, **MAMBA1).to_dict()
    composition = derive(config)
    assert {slot: composition.parts[slot] for slot in ("position", "attention", "mlp", "block", "linear_attention")} == {
        "position": "no_positions", "attention": "no_attention", "mlp": "no_mlp", "block": "one_mixer",
        "linear_attention": "mamba1"}
    text = render_native({"model_name": model_type, "framework_class": "NativeForCausalLM", "display_name": model_type,
                          "model_class": "X"}, composition)
    assert "Attention" not in text and "num_attention_heads" not in text
    good, bad = tmp_path / "good.py", tmp_path / "skip.py"
    good.write_text(text)
    assert text.count(" + D * x[t]") == 1
    bad.write_text(text.replace(" + D * x[t]", ""))
    fp32, bf16, skip = selfcheck([_job(config, good), _job(config, good, "bfloat16"), _job(config, bad)], SNAPSHOT)
    assert fp32["ok"] and fp32["max_rel"] < 1e-4, fp32
    assert bf16["ok"], bf16
    assert not skip["ok"] and "prefill" in skip["reason"], skip
