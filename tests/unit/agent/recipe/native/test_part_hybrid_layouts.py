"""The hybrids whose checkpoints store the Gated DeltaNet's tensors otherwise than transformers builds them
(agent/recipe/native/parts/linear_attention.py: stored_conversion), and the hybrid layer kinds beside them:
lara_mini (one stored in_proj [q|k|v|z|b|a], the file's one projection split at run time; NoPE on its
full-attention layers; fused 3-D experts), olmo_hybrid (separate q/k/v/g/b/a projections, q/k/v and the conv's
kernels stored apart and loaded by shard; beta doubled by linear_allow_neg_eigval; a fixed gated-norm epsilon;
pre-norm linear layers beside post-norm attention layers), and the Kimi Delta Attention of kimi_linear /
bailing_hybrid derived beside their MLA layers. The default case that covers the layer's path is
test_part_gated_delta_net.py::test_the_layer_matches_transformers_across_prefill_and_decode_and_lost_state_fails
(olmo_hybrid's layer and its swapped-shard fault); the whole files' self-checks are slow."""

from __future__ import annotations

import pytest

from locations import REPO_ROOT

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"


def run(jobs):
    import gdn_layer_check

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    return gdn_layer_check.run(jobs, SNAPSHOT)


def _rules(model_type):
    from transformers import conversion_mapping

    return [rule for rule in conversion_mapping.get_checkpoint_conversion_mapping(model_type) or []
            if type(rule).__name__ != "WeightRenaming"]


def test_stored_conversions_are_read_as_the_checkpoints_store_them():
    """transformers' own rules: the conv kernels stored apart (olmo_hybrid, kimi_linear, bailing_hybrid), lara_mini's
    stored in_proj; the experts' merge is not this part's. The same rules with their pieces in another order (the
    file would load q's rows as k's, or b as a) are not recognised: the model part then refuses them."""
    from transformers.core_model_loading import Concatenate, Split, WeightConverter

    from agent.recipe.native.parts.linear_attention import stored_conversion

    found = {t: [stored_conversion(rule) for rule in _rules(t)]
             for t in ("olmo_hybrid", "kimi_linear", "bailing_hybrid", "lara_mini", "qwen3_next")}
    assert found["olmo_hybrid"] == ["conv_q_k_v"] and found["lara_mini"] == ["in_proj"]
    assert "conv_q_k_v" in found["kimi_linear"] and "conv_q_k_v" in found["bailing_hybrid"]
    assert not any(found["qwen3_next"])
    swapped = WeightConverter(source_patterns=[f"linear_attn.{x}_conv1d.weight" for x in "kqv"],
                              target_patterns="linear_attn.conv1d.weight", operations=[Concatenate(dim=0)])
    reordered = WeightConverter(source_patterns="linear_attn.in_proj",
                                target_patterns=[f"linear_attn.in_proj_{x}" for x in ("qkv", "z", "a", "b")],
                                operations=[Split(dim=0)])
    other_dim = WeightConverter(source_patterns=[f"linear_attn.{x}_conv1d.weight" for x in "qkv"],
                                target_patterns="linear_attn.conv1d.weight", operations=[Concatenate(dim=1)])
    assert [stored_conversion(rule) for rule in (swapped, reordered, other_dim)] == [None, None, None]


@pytest.mark.slow
def test_the_layers_in_both_dtypes_and_their_load_faults():
    """lara_mini's and olmo_hybrid's layers in float32 and bfloat16; lara_mini's stored in_proj read with b and a
    the other way round fails at the prefill, as do olmo_hybrid's q and k rows swapped in bfloat16."""
    goods = [{"model_type": t, "dtype": d} for t in ("lara_mini", "olmo_hybrid") for d in ("float32", "bfloat16")]
    faults = [{"model_type": "lara_mini", "fault": "in_proj"},
              {"model_type": "olmo_hybrid", "dtype": "bfloat16", "fault": "shards"}]
    results = run(goods + faults)
    assert all(r["ok"] for r in results[:len(goods)]), list(zip(goods, results))
    assert [r["step"] for r in results[len(goods):]] == ["prefill", "prefill"] and \
        not any(r["ok"] for r in results[len(goods):]), list(zip(faults, results[len(goods):]))


CASES = {
    # type: (the composition's options, a planted fault in the rendered file that the self-check must catch)
    "olmo_hybrid": ({"GDN_PROJECTIONS": "q_k_v_g_b_a", "CONV_SHARDS": True, "NEG_EIGVAL_KEY": "linear_allow_neg_eigval",
                     "GATED_NORM_EPS": 1e-5, "WIDE_HEADS": True},
                    ("hidden_states = hidden_states + self.linear_attn(self.input_layernorm(hidden_states), ",
                     "hidden_states = hidden_states + self.linear_attn(hidden_states, ")),
    "lara_mini": ({"GDN_PROJECTIONS": "in_proj", "CONV_SHARDS": False, "NEG_EIGVAL_KEY": None, "GATED_NORM_EPS": None,
                   "NOPE_LAYERS": "global_nope"},
                  ("mixed, z, b, a = self.in_proj(", "mixed, z, a, b = self.in_proj(")),
}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(CASES))
def test_the_file_matches_transformers_in_both_dtypes_and_its_fault_fails(model_type, tmp_path):
    """Derived from the type's config, rendered, held to transformers in float32 and bfloat16 (packed prefill, decode
    steps, Mamba state blocks NaN before the prefill); the planted fault fails. olmo_hybrid: its linear layer's input
    norm dropped; lara_mini: its stored in_proj's b and a read the other way round."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.decide import render_native, selfcheck, selfcheck_jobs

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    options, fault = CASES[model_type]
    config = AutoConfig.for_model(model_type).to_dict()
    composition = derive(config)
    assert {k: composition.options.get(k) for k in options} == options
    ctx = {"model_name": model_type, "framework_class": "NativeForCausalLM", "display_name": model_type,
           "model_class": "X"}
    text = render_native(ctx, composition)
    assert text.count(fault[0]) == 1
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text(text)
    bad.write_text(text.replace(*fault))
    labelled = selfcheck_jobs(config, composition.checked_variants, str(good), ctx["framework_class"])[:2]
    jobs = [job for _, job in labelled] + [{"config": config, "file": str(bad), "class_name": ctx["framework_class"]}]
    results = selfcheck(jobs, SNAPSHOT)
    assert labelled[1][1]["dtype"] == "bfloat16", labelled
    assert all(r["ok"] for r in results[:2]), [(label, r["reason"]) for (label, _), r in zip(labelled, results)]
    assert results[0]["max_rel"] < 1e-4
    assert not results[2]["ok"] and "prefill" in results[2]["reason"], results[2]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["kimi_linear", "bailing_hybrid"])
def test_kimi_delta_attention_types_derive_with_their_mla_layers(model_type):
    """The recurrent layer in self_attn's place is the Kimi Delta Attention part's, the attention layers the MLA
    part's (kimi_linear's without positions, bailing_hybrid's gated). Covered by default by
    test_part_kimi_delta_attention.py and test_part_mla_nope_gate.py's probe tests."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    composition = derive(AutoConfig.for_model(model_type).to_dict())
    assert (composition.parts["linear_attention"], composition.parts["attention"]) == ("kimi_delta_attention", "mla")
    assert composition.options["MLA_NOPE"] is (model_type == "kimi_linear")
    assert composition.options.get("GATE_PROJ") == (None if model_type == "kimi_linear" else "g_proj")
