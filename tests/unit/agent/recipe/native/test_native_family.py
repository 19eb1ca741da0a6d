"""One file per family (issue 42 item 2): a native file generated from one checkpoint serves the family's other
checkpoints, what they differ in read from the config when the model is built. Generated from a plain tiny
llama (default rope, untied, no biases), the file is held to transformers (agent.recipe.native.selfcheck, one
stand-in process) on configs with each other rope type transformers' ROPE_INIT_FUNCTIONS knows (linear, dynamic
and longrope past their original context within the decode steps, yarn, llama3), tied embeddings and attention /
MLP biases; the same for qwen2_moe across its MoE layout switches (decoder_sparse_step, mlp_only_layers,
norm_topk_prob, no shared expert) and deepseek_v3 (first_k_dense_replace, grouped routing). Each switch has a
fault that ignores it — the file then fails exactly that switch's check."""

from __future__ import annotations

import pytest

from locations import REPO_ROOT

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
CTX = {"model_name": "family", "framework_class": "FamForCausalLM", "display_name": "family",
       "model_class": "ForCausalLM"}
# (family, switch labels the test runs, (fault, text of the correct file, its faulty replacement, the labels it fails))
FAMILIES = {
    "llama": (None, [
        ("rope type ignored", 'if rope_type == "default":', "if True:",
         {"rope linear", "rope dynamic", "rope yarn", "rope longrope", "rope llama3"}),
        ("tied head never loaded", 'if tied and target == "model.embed_tokens.weight":', "if False:",
         {"tie_word_embeddings"}),
        ("biases written as the checkpoint's", "bias=config.attention_bias", "bias=False", {"bias attention_bias"}),
        ("mlp biases written as the checkpoint's", "bias=config.mlp_bias", "bias=False", {"bias mlp_bias"}),
    ]),
    "qwen2_moe": ({"decoder_sparse_step 2", "mlp_only_layers [0]", "norm_topk_prob", "no shared experts"}, [
        ("every layer sparse", "return layer_idx not in (config.mlp_only_layers or [])", "return True or layer_idx not in (config.mlp_only_layers or [])",
         {"decoder_sparse_step 2", "mlp_only_layers [0]"}),
        ("norm_topk_prob as the checkpoint's", "self.renormalize = config.norm_topk_prob", "self.renormalize = False",
         {"norm_topk_prob"}),
    ]),
    "deepseek_v3": ({"first_k_dense_replace 0 / 1", "grouped routing"}, [
        ("groups ignored", "keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)", "keep.fill_(True)",
         {"grouped routing"}),
    ]),
}


def family_config(family: str) -> dict:
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **(TINY_LLAMA if family == "llama" else {})).to_dict()


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    from agent.recipe.native.compose import derive
    from agent.recipe.native.decide import render_native, selfcheck

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    folder = tmp_path_factory.mktemp("native_family")
    jobs, labels, variants = [], [], {}
    for family, (only, faults) in FAMILIES.items():
        config = family_config(family)
        composition = derive(config)
        variants[family] = dict(composition.checked_variants)
        text = render_native(CTX, composition)
        chosen = {label: changes for label, changes in variants[family].items() if only is None or label in only}
        assert all(correct in text for _, correct, _, _ in faults), [w for w, c, _, _ in faults if c not in text]
        files = [("file", text)] + [(what, text.replace(correct, faulty)) for what, correct, faulty, _ in faults]
        for what, source in files:
            path = folder / f"{family}_{len(jobs)}.py"
            path.write_text(source)
            runs = chosen if what == "file" else {label: chosen[label] for label in
                                                   next(f[3] for f in faults if f[0] == what)}
            for label, changes in runs.items():
                jobs.append({"config": config, "changes": changes, "file": str(path), "class_name": "FamForCausalLM"})
                labels.append((family, what, label))
    return {"variants": variants, "results": dict(zip(labels, selfcheck(jobs, SNAPSHOT, timeout=1800)))}


def test_a_tiny_llama_file_reads_every_rope_type_the_tie_and_the_biases(checked):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from agent.recipe.native.parts.position import ROPE_TYPES

    labels = set(checked["variants"]["llama"])
    # every rope initialisation the checkout's transformers (5.0.0) knows, and the default the file computes
    assert set(ROPE_TYPES) - {"default"} <= set(ROPE_INIT_FUNCTIONS)
    assert {f"rope {t}" for t in ROPE_TYPES if t != "default"} | {"tie_word_embeddings", "bias attention_bias",
                                                                   "bias mlp_bias"} <= labels


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_family_file_serves_each_switch_and_a_fault_fails_its_switch(checked, family):
    results = {(what, label): r for (f, what, label), r in checked["results"].items() if f == family}
    served = {label: r for (what, label), r in results.items() if what == "file"}
    assert served and all(r["ok"] for r in served.values()), {k: r["reason"] for k, r in served.items() if not r["ok"]}
    only, faults = FAMILIES[family]
    if only is not None:
        assert set(served) == only
    for what, _, _, fails in faults:
        outcome = {label: results[(what, label)] for label in fails}
        assert not any(r["ok"] for r in outcome.values()), (what, outcome)
    print(f"{family}: {len(served)} settings served: " + ", ".join(f"{k} {r['max_rel']:.1e}" for k, r in served.items()))


def test_rope_variants_replace_a_hub_configs_legacy_rope_scaling():
    """A published config.json states its rope twice (rope_parameters and the legacy rope_scaling, as
    agent.measure.reference's tiny checkpoints do): each rope variant the self-check runs is the type it names,
    not the legacy copy (which transformers would read with the variant's other settings)."""
    from agent.recipe.native.compose import derive
    from agent.recipe.native.parts.probe import shrunk_config

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "beta_fast": 32.0, "beta_slow": 1.0}
    config = {**family_config("llama"), "rope_parameters": yarn, "rope_scaling": {**yarn, "type": "yarn"}}
    variants = [(label, changes) for label, changes in derive(config).checked_variants if label.startswith("rope ")]
    assert {label for label, _ in variants} == {"rope default", "rope linear", "rope dynamic", "rope longrope", "rope llama3"}
    for label, changes in variants:
        assert shrunk_config(config, changes).rope_parameters["rope_type"] == label.split()[1], label
