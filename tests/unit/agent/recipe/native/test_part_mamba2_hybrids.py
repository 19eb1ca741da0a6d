"""The Mamba2 hybrids as whole generated files (agent/recipe/native/parts/linear_attention_mamba2.py: the mixer read
under the layer's `mamba` name, its feed_forward MLP, pre_ff_layernorm and final_layernorm by their roles; the conv
and ssm states as Mamba cache entries), derived from the type's config, rendered and held to transformers by the
generator's own self-check (packed prefill, decode steps, state blocks NaN before the prefill). The default case is
bamba's smallest hybrid (a Mamba2 layer, then an attention layer) in float32 with the D skip dropped; the layer alone
in both dtypes and its state faults: test_part_mamba2.py."""

from __future__ import annotations

import pytest

from locations import REPO_ROOT
from part_selfcheck import write_with_faults

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"

# a planted fault in the rendered file: (text, replacement), each of which the self-check must catch
FAULTS = {
    "skip": ("+ D[:, None] * x[t]", ""),
    "scan_skip": (" + D * x[t]", ""),          # the Mamba1 scan's (parts/code/linear_attention_mamba1.py)
    "conv_state": ("self.conv_state.index_select(0, blocks), weight",
                   "torch.zeros_like(self.conv_state.index_select(0, blocks)), weight"),
    "ssm_state": ("state = self.ssm_state.index_select(0, blocks).float()",
                  "state = torch.zeros_like(self.ssm_state.index_select(0, blocks)).float()"),
    # the mixer's input norm skipped (the layer's norm order read with the mixer in the attention's place)
    "input_norm": ("hidden_states = self.linear_attn(hidden_states, forward_metadata)",
                   "hidden_states = self.linear_attn(hidden_states + residual, forward_metadata)"),
    # a one-mixer layer's mixer on the residual stream as it is, its norm skipped (nemotron_h)
    "one_mixer_norm": ("hidden_states, residual = self.norm(hidden_states, past_residual)",
                       "residual = hidden_states if past_residual is None else hidden_states + past_residual\n"
                       "        hidden_states = residual"),
}
# type: (its smallest hybrid config's changes from transformers' defaults, the options the composition must take)
SMALL = {
    "bamba": ({"num_hidden_layers": 2, "attn_layer_indices": [1], "mamba_d_state": 16, "mamba_chunk_size": 16,
               "num_attention_heads": 64},
              {"LINEAR_ATTENTION": True, "MAMBA_NORM_GROUPED": True}),
    # its rotary variant (its default, NoPE: test_part_position_nope.py); the MoE block and shared MLP beside the
    # mixer, granite's multipliers
    "granitemoehybrid": ({"num_hidden_layers": 2, "layer_types": ["mamba", "attention"], "mamba_d_state": 16,
                          "position_embedding_type": "rope"},
                         {"LINEAR_ATTENTION": True, "MAMBA_NORM_GROUPED": True, "RESIDUAL_MULTIPLIER": True}),
    # a Mamba2, an attention and an MLP layer, each one mixer behind one norm (parts/block_one_mixer.py), NoPE
    # attention, the mixer under nemotron_h's config keys; its slow cases: test_part_one_mixer.py
    "nemotron_h": ({"hybrid_override_pattern": "M*-", "ssm_state_size": 16, "chunk_size": 16},
                   {"LINEAR_ATTENTION": True, "ONE_MIXER": True, "NO_POSITIONS": True, "MAMBA_HEADS": "mamba_num_heads"}),
    # a Mamba1 layer with the dense MLP, then an attention layer (no positions) with the MoE block, as jamba's
    # checkpoints alternate them
    "jamba": ({"num_hidden_layers": 2, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
               "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2},
              {"LINEAR_ATTENTION": True, "MAMBA1_DT_BC_NORM": "weighted", "MOE_LAYERS": "expert_layer_period",
               "NO_POSITIONS": True}),
}
# the types whose layers hold an attention or mixer and an MLP (the slow table's faults are in their layers)
TWO_BRANCH = ("bamba", "granitemoehybrid", "jamba")
MIXER = {"jamba": "mamba1"}     # the linear-attention part of each type (mamba2 unless named)


def _render(model_type, tmp_path, faults, changes=None):
    """(config, the good file's path, each fault's file path) of the type's smallest hybrid."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.decide import render_native

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    keys, options = SMALL[model_type]
    config = AutoConfig.for_model(model_type, **keys, **(changes or {})).to_dict()
    composition = derive(config)
    assert composition.matches["linear_attention"].name == MIXER.get(model_type, "mamba2")
    assert {k: composition.options.get(k) for k in options} == options
    ctx = {"model_name": model_type, "framework_class": "NativeForCausalLM", "display_name": model_type,
           "model_class": "X"}
    text = render_native(ctx, composition)
    good, bad = write_with_faults(text, FAULTS, faults, tmp_path)
    return config, good, bad


def _job(config, path, dtype="float32"):
    return {"config": config, "file": str(path), "class_name": "NativeForCausalLM", "dtype": dtype}


def test_bamba_file_matches_transformers_and_a_dropped_d_skip_fails(tmp_path):
    """bamba's smallest hybrid, derived and rendered: float32 within 1e-4 of transformers at the prefill and every
    decode step; the file with the recurrence's D x skip dropped fails at the prefill. In the same self-check,
    jamba's (its Mamba1 mixer, parts/linear_attention_mamba1.py; no positions; the MoE block by expert_layer_period)
    within 1e-4 too (its faults: the slow table below, and test_part_mamba1.py's for the mixer). The 1e-4 also holds the
    self-check's stateful reference (agent.recipe.native.selfcheck.Incremental): with transformers 5.24's own cached
    bamba decode as the reference (it drifts), the right file's largest difference was 0.95 of the largest logit.
    In the same self-check run, nemotron_h's smallest model (one mixer behind one norm per layer) within 1e-4, and
    its file whose layers skip their norm failing at the prefill."""
    from agent.recipe.native.decide import selfcheck

    config, good, (bad,) = _render("bamba", tmp_path, ["skip"])
    (tmp_path / "one").mkdir()
    one_config, one_good, (one_bad,) = _render("nemotron_h", tmp_path / "one", ["one_mixer_norm"])
    jamba_config, jamba_good, _ = _render("jamba", tmp_path / "jamba", [])
    good_result, bad_result, one_result, one_bad_result, jamba_result = selfcheck(
        [_job(config, good), _job(config, bad), _job(one_config, one_good), _job(one_config, one_bad),
         _job(jamba_config, jamba_good)], SNAPSHOT)
    assert good_result["ok"] and good_result["max_rel"] < 1e-4, good_result
    assert not bad_result["ok"] and "prefill" in bad_result["reason"], bad_result
    assert one_result["ok"] and one_result["max_rel"] < 1e-4, one_result
    assert not one_bad_result["ok"] and "prefill" in one_bad_result["reason"], one_bad_result
    assert jamba_result["ok"] and jamba_result["max_rel"] < 1e-4, jamba_result


@pytest.mark.slow
@pytest.mark.parametrize("model_type", TWO_BRANCH)
def test_the_file_in_both_dtypes_and_its_state_and_norm_faults_fail(model_type, tmp_path):
    """float32 and bfloat16; a decode that forgets the conv or the ssm state fails at its decode, the mixer's input
    norm skipped fails at the prefill. Default case covering this path:
    test_bamba_file_matches_transformers_and_a_dropped_d_skip_fails."""
    from agent.recipe.native.decide import selfcheck

    faults = ["conv_state", "ssm_state", "input_norm"] + (["scan_skip"] if MIXER.get(model_type) == "mamba1" else [])
    config, good, bad = _render(model_type, tmp_path, faults)
    results = selfcheck([_job(config, good), _job(config, good, "bfloat16")] + [_job(config, p) for p in bad],
                        SNAPSHOT)
    assert all(r["ok"] for r in results[:2]), results[:2]
    failed = results[2:]
    assert not any(r["ok"] for r in failed), list(zip(faults, failed))
    assert ["decode" in r["reason"] for r in failed] == [True, True, False, False][:len(faults)], \
        list(zip(faults, failed))


@pytest.mark.slow
def test_bamba_with_two_groups_norms_each_group(tmp_path):
    """Two groups (mamba_n_groups 2: the gated norm per group as transformers after 5.0 computes it) in float32.
    Default case covering this path: test_bamba_file_matches_transformers_and_a_dropped_d_skip_fails."""
    from agent.recipe.native.decide import selfcheck

    config, good, _ = _render("bamba", tmp_path, [], {"mamba_n_groups": 2})
    (result,) = selfcheck([_job(config, good)], SNAPSHOT)
    assert result["ok"], result


REFUSED = {
    # type: (changes from its defaults, the fall-back's kind, words its one-line reason must hold)
    # the Mamba2 mixer's norm before its gate (its parallel hybrid layer is written: test_part_parallel_hybrid.py)
    "falcon_h1": ({"mamba_rms_norm": True, "mamba_norm_before_gate": True}, "linear attention",
                  "norm before its gate"),
    # its default config's moe layer (the one-mixer Mamba2, attention and MLP layers are written: test_part_one_mixer.py)
    "nemotron_h": ({}, "model", "a sparse-MoE block (NemotronHMoE) as a layer's one mixer"),
    "zamba2": ({}, "model", "layers of Zamba2HybridLayer (linear, mamba_decoder, shared_transformer)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_the_hybrids_no_part_writes_fall_back_naming_their_first_blocker(model_type):
    """falcon_h1's Mamba2 norm before its gate, nemotron_h's default moe layer as a one-mixer
    block (its shrunk config's B / C groups cut to divide the heads, so that transformers runs it), zamba2's hybrid
    layers (a transformer block shared across layers; its attention width and mixer heads shrunk with the hidden
    width) each fall back in one line naming it.
    Default case covering the derivation's path: test_bamba_file_matches_transformers_and_a_dropped_d_skip_fails."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.not_native import NotNative

    changes, kind, words = REFUSED[model_type]
    with pytest.raises(NotNative) as refused:
        derive(AutoConfig.for_model(model_type, **changes).to_dict())
    assert refused.value.kind == kind and words in refused.value.reason, (refused.value.kind, refused.value.reason)
    assert "\n" not in refused.value.reason


@pytest.mark.slow
def test_granitemoehybrid_of_mamba2_layers_alone_writes_no_attention():
    """granitemoehybrid's default layer_types (Mamba2 layers alone, each with its MoE block and shared MLP, two norms):
    derived with no attention (parts/no_attention.py), the file builds none and refuses in one line a layer its config
    makes an attention layer. (transformers 5.24 cannot run this config with its cache — get_seq_length on a cache
    of linear-attention layers alone — so the self-check does not hold it.)
    Default case covering the hybrid block's path: test_bamba_file_matches_transformers_and_a_dropped_d_skip_fails."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.decide import render_native

    composition = derive(AutoConfig.for_model("granitemoehybrid", num_hidden_layers=2, mamba_d_state=16).to_dict())
    assert composition.matches["attention"].name == "no_attention"
    assert composition.matches["linear_attention"].name == "mamba2"
    assert composition.options.get("NO_ATTENTION") and composition.options.get("LINEAR_ATTENTION")
    text = render_native({"model_name": "granitemoehybrid", "framework_class": "NativeForCausalLM",
                          "display_name": "granitemoehybrid", "model_class": "X"}, composition)
    assert "class NativeAttention(" not in text and "this file writes no " in text
