"""The NPU-native multi-head latent attention (agent/recipe/native/parts/mla.py, its code
parts/code/attention_mla.py) of DeepSeek-V3-shaped models, every layer dense (first_k_dense_replace >= num_hidden_layers: the
MoE block is tests/unit/agent/recipe/native/test_moe_features.py's).

Default suite, in-process (the stand-in's reference kernels as torch_npu, upstream's module/ and executor/
imported from the snapshot): the MLA facts read from transformers' attention module for each variant (q LoRA
or one q_proj, interleaved or rotate-half rope, yarn's mscale in the softmax scale, biases); the written file
held to transformers per step in float32 by agent.recipe.native.selfcheck (a packed prefill of two prompts
of unequal length, then decode steps on a paged cache of 4-token blocks); faults written into the correct
file (absorb with the wrong half of kv_b_proj, rope on the nope dims, ...) that must fail the same check;
the tensor-parallel refusal.

`-m slow`: the recipe through upstream's launcher under the stand-in (`migrator run RECIPE --standin`, its
YAML's npugraph_ex), two prompts of unequal length packed, at 1 and 2 ranks, per-step precision against
transformers; the decode graph compiled once per rank; npu_mla_prolog_v3 behind enable_mla_prolog.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import native_moe_harness as harness
from agent.recipe.native.compose import derive
from agent.recipe.native.not_native import NotNative

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
# deepseek_v3 with every layer dense, and the variants the MLA code paths depend on
CASES = {"deepseek_v3": {}, "rope_half": {"rope_interleave": False}, "no_q_lora": {"q_lora_rank": None},
         "yarn": {"rope_parameters": YARN}, "biases": {"attention_bias": True},
         # the whole architecture: MLA on every layer, its sparse-MoE block (routed + shared experts) from layer 1
         "with_moe": {"first_k_dense_replace": 1}}
CTX = {"model_name": "tiny_mla", "framework_class": "TinyForCausalLM", "display_name": "deepseek_v3",
       "model_class": "DeepseekV3ForCausalLM", "transformers_version": "5.0.0"}


def mla_config(case: str) -> dict:
    from transformers import AutoConfig

    # a checkpoint without the MTP layer transformers' default config announces (the draft: test_mtp.py)
    return {**AutoConfig.for_model("deepseek_v3").to_dict(), "first_k_dense_replace": 1000,
            "num_nextn_predict_layers": 0, **CASES[case]}


@pytest.fixture(scope="module")
def features():
    return {case: derive(mla_config(case)) for case in CASES}


# ---- what the attention is, read from transformers' module ----------------------------------------
EXPECTED = {
    "deepseek_v3": dict(q_lora=True, rope="interleave", q_a_bias=False, kv_a_bias=False, o_bias=False),
    "rope_half": dict(q_lora=True, rope="half"),
    "no_q_lora": dict(q_lora=False, rope="interleave"),
    "yarn": dict(q_lora=True, scale="yarn_mscale"),
    "biases": dict(q_a_bias=True, kv_a_bias=True, o_bias=True),
    "with_moe": dict(q_lora=True, rope="interleave"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mla_facts_are_read_from_the_attention_module(features, case):
    assert features[case].parts["attention"] == "mla", case
    got = features[case]["attention"].facts
    assert {k: got[k] for k in EXPECTED[case]} == EXPECTED[case]
    fused = " ".join(features[case].fused)
    for op in ("npu_kv_rmsnorm_rope_cache_v2", "npu_interleave_rope", "npu_fused_infer_attention_score_v2",
               "npu_transpose_batchmatmul", "npu_add_rms_norm"):
        assert op in fused, (case, op)
    assert "npu_scatter_nd_update_" not in fused and "npu_apply_rotary_pos_emb" not in fused
    # the prolog computes the q LoRA and has no biases: used where both hold
    assert ("npu_mla_prolog_v3 (" in fused) is (got["q_lora"] and not got["q_a_bias"])
    # the MoE layers' kernel chain only where the model has them
    assert ("npu_moe_init_routing_v2" in fused) is ("moe" in features[case].parts) is (case == "with_moe")


def test_the_probe_tells_the_candidates_apart():
    """On the yarn config every wrong candidate (rope form, scale rule) is far from transformers' module."""
    import torch
    from transformers import AutoModelForCausalLM

    from agent.recipe.native.parts import mla as mla_features
    from agent.recipe.native.parts.probe import shrunk_config

    config = shrunk_config(mla_config("yarn"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    attention = model.model.layers[0].self_attn
    x = torch.randn(6, config.hidden_size)
    cos, sin = mla_features.rope_table(config, torch.arange(6))
    with torch.no_grad():
        got = mla_features._module_output(attention, model, x)
        errors = {(form, rule): float((got - mla_features.candidate(attention, config, x, cos, sin, form,
                                                                    mla_features.softmax_scale(config, rule))).abs().max())
                  for form in mla_features.ROPE_FORMS for rule in mla_features.SCALE_RULES}
    scale = float(got.abs().max())
    assert errors[("interleave", "yarn_mscale")] < 1e-5 * scale, errors
    assert all(err > 1e-3 * scale for key, err in errors.items() if key != ("interleave", "yarn_mscale")), errors


def test_mla_variants_the_kernels_do_not_compute_fall_back_with_the_attention_kind(monkeypatch):
    """A latent attention with an extra module (DeepSeek-V3.2's sparse `indexer`) or a q_a_layernorm that
    scales by 1 + w is not written natively: the layer kind and the reason."""
    import torch
    from transformers import AutoModelForCausalLM

    from agent.recipe.native.parts import mla as mla_features
    from agent.recipe.native.parts.probe import shrunk_config

    config = shrunk_config(mla_config("deepseek_v3"))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    layers = list(model.model.layers)
    layers[0].self_attn.indexer = torch.nn.Linear(4, 4)
    with pytest.raises(NotNative, match="indexer") as caught:
        mla_features.derive_mla(config, layers, model)
    assert caught.value.kind == "attention"
    del layers[0].self_attn.indexer
    monkeypatch.setattr(mla_features, "probe_norm", lambda norm, width: 1.0)
    with pytest.raises(NotNative, match="1 \\+ w"):
        mla_features.derive_mla(config, layers, model)


# ---- the written file against transformers (fp32, in-process), and faults that must fail --------------
# (case, what the fault is, text of the correct file, its faulty replacement)
FAULTS = [
    ("deepseek_v3", "absorb with the v half of kv_b_proj as W_uk", "weight[:, :self.qk_nope_head_dim].contiguous()",
     "weight[:, -self.qk_nope_head_dim:].contiguous()"),
    ("deepseek_v3", "W_uv from kv_b_proj's nope rows", "weight[:, self.qk_nope_head_dim:].transpose(1, 2)",
     "weight[:, :self.v_head_dim].transpose(1, 2)"),
    ("deepseek_v3", "rope on the query's nope dims", "q_nope, q_pe = q.view(", "q_pe, q_nope = q.view("),
    ("deepseek_v3", "q_a_layernorm skipped", "self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))",
     "self.q_b_proj(self.q_a_proj(hidden_states))"),
    ("rope_half", "rotate-half rope without the interleaved rope rows of q",
     "q_heads[:, self.qk_nope_head_dim:] = interleaved(", "q_heads[:, self.qk_nope_head_dim:] = ("),
    ("yarn", "softmax scale without yarn's mscale", "scale = scale * mscale * mscale", "scale = scale"),
]


@pytest.fixture(scope="module")
def checked(features, tmp_path_factory):
    """Every variant's written file and every fault, held to transformers by the generator's own self-check,
    in one stand-in process (agent.recipe.native.decide.selfcheck)."""
    from agent.recipe.native.decide import render_native, selfcheck

    if not harness.UPSTREAM.is_dir():
        pytest.skip(f"no upstream snapshot at {harness.UPSTREAM}")
    folder = tmp_path_factory.mktemp("native_mla")
    texts = {case: render_native(CTX, f) for case, f in features.items()}
    jobs, labels = [], []
    for case, text in texts.items():
        (folder / f"good_{case}.py").write_text(text)
        jobs.append({"config": mla_config(case), "file": str(folder / f"good_{case}.py"), "class_name": CTX["framework_class"]})
        labels.append(("good", case))
    for index, (case, what, correct, faulty) in enumerate(FAULTS):
        assert texts[case].count(correct) == 1, (case, correct)
        (folder / f"fault_{index}.py").write_text(texts[case].replace(correct, faulty))
        jobs.append({"config": mla_config(case), "file": str(folder / f"fault_{index}.py"),
                     "class_name": CTX["framework_class"]})
        labels.append((what, case))
    return {"texts": texts, "results": dict(zip(labels, selfcheck(jobs, harness.UPSTREAM)))}


def test_native_mla_file_matches_transformers_per_step_and_every_fault_fails(checked):
    """Each variant's file within 1e-4 (of the largest logit) of transformers at the packed prefill and every
    decode step; each fault differs from transformers at some step."""
    results = checked["results"]
    for case in CASES:
        result = results[("good", case)]
        assert result["ok"] and result["max_rel"] < 1e-4, (case, result)
        print(f"{case}: native MLA, prefill + decode logits within {result['max_rel']:.1e} of transformers (fp32)")
    for case, what, _, _ in FAULTS:
        result = results[(what, case)]
        # (the checkpoint's own widths: a fault that mixes nope and rope dims may fail on their shapes)
        assert not result["ok"] and ("differ from transformers" in result["reason"] or "Error" in result["reason"]), \
            (what, result)
    # the file is upstream-shaped: its layers, the MLA cache kinds and kernels, no transformers runtime
    text = checked["texts"]["deepseek_v3"]
    for needed in ("ReplicatedLinear(", "ColumnParallelLinear(", "RowParallelLinear(", "is_mla_backend=True",
                   'cache_name=name', '("nope_cache", self.kv_lora_rank), ("rope_cache", self.qk_rope_head_dim)',
                   'input_layout="TND_NTD"', 'input_layout="NTD_TND"', "atten_mask=None", 'cache_mode="PA_NZ"',
                   "npu_mla_prolog_v3", "def split_kv_b_weight"):
        assert needed in text, needed
    assert "transformers.models" not in text and "DynamicCache" not in text and "past_key_values" not in text
    assert "torch.ops.npu.npu_mla_prolog_v3(" not in checked["texts"]["no_q_lora"]     # the prolog needs the q LoRA


def test_mla_heads_that_do_not_split_are_refused_in_one_line():
    """MLA's one latent head is whole on every rank: only the query heads (and widths) must divide."""
    from agent.recipe.native.preflight import parallel_problem

    config = {"num_attention_heads": 4, "num_key_value_heads": 3, "intermediate_size": 128, "vocab_size": 384,
              "kv_lora_rank": 32}
    assert parallel_problem(config, {"attn_tp_size": 2, "lmhead_tp_size": 2}) is None
    problem = parallel_problem(config, {"attn_tp_size": 3})
    assert problem == ("num_attention_heads 4 does not divide by parallel_config's tensor-parallel size 3: "
                       "choose a size that divides it")
    dense = {k: v for k, v in config.items() if k != "kv_lora_rank"}
    assert "num_key_value_heads" in parallel_problem(dense, {"attn_tp_size": 2})   # a dense model's key heads split


# ---- slow: the recipe through upstream's launcher, per-step precision --------------------------------
PROMPTS = ["An attention function can be described as mapping a query and a set of key-value pairs to an "
           "output, where the query, keys, values, and output are all vectors. The output is",
           "The capital of France is"]


def _migrated_mla(tmp_path_factory, name: str, first_k_dense_replace: int) -> dict:
    """A tiny deepseek_v3 checkpoint (the --tiny settings: 32-wide NZ latent, the published 64-wide rope, YaRN) migrated by the
    framework target into a copy of the snapshot; dense up to layer `first_k_dense_replace` (2: all dense)."""
    from agent.measure import reference
    from agent.run.standin import TINY_SETTINGS
    from agent.workflow.run import run_migration
    from upstream_checkout import copy_snapshot

    root = tmp_path_factory.mktemp(name)
    checkout = copy_snapshot(root / "cann-recipes-infer")
    checkpoint = reference.tiny_checkpoint("deepseek_v3", root / "ckpt", **TINY_SETTINGS["deepseek_v3"],
                                           first_k_dense_replace=first_k_dense_replace)
    run_migration({"target": str(checkpoint), "output_dir": str(checkout / "models"), "name": name,
                   "device": "cpu", "max_new_tokens": 8, "max_rounds": 0, "world_size": 1,
                   "recipe_target": "framework", "transformers_source": "installed"}, stop_after="render")
    return {"root": root, "checkout": checkout, "recipe": checkout / "models" / name, "checkpoint": checkpoint,
            "name": name}


@pytest.fixture(scope="module")
def mla_recipe(tmp_path_factory):
    """Every layer dense: the MLA attention alone."""
    return _migrated_mla(tmp_path_factory, "nat_mla", 2)


@pytest.fixture(scope="module")
def mla_moe_recipe(tmp_path_factory):
    """The whole architecture: MLA on both layers, layer 1 a sparse-MoE block (routed and shared experts)."""
    return _migrated_mla(tmp_path_factory, "nat_mla_moe", 1)


def packed_yaml(recipe_info: dict, world_size: int, custom_params: dict | None = None) -> str:
    """The recipe's YAML for `world_size` ranks on the checkpoint, two prompts of unequal length in one batch."""
    from agent.recipe.recipe import Recipe

    recipe, root = recipe_info["recipe"], recipe_info["root"]
    prompts = root / "prompts"
    prompts.mkdir(exist_ok=True)
    (prompts / "default_prompt.json").write_text(json.dumps({"text": PROMPTS}))
    source = Recipe.at(recipe).yaml_for(world_size, write=True)
    data = yaml.safe_load(source.read_text())
    data["model_config"]["model_path"] = str(recipe_info["checkpoint"])
    if custom_params:
        data["model_config"]["custom_params"] = custom_params
    data["data_config"]["dataset_path"] = str(prompts)
    data["scheduler_config"]["batch_size"] = 2
    name = f"{source.stem}_packed{'_prolog' if custom_params else ''}.yaml"
    (recipe / "config" / name).write_text(yaml.safe_dump(data, sort_keys=False))
    return name


def run_recipe(recipe_info: dict, yaml_name: str, ranks: int):
    from upstream_checkout import FAST
    from migrator_cli import run_cli

    proc = run_cli("run", str(recipe_info["recipe"]), "--standin", "--yaml", yaml_name, "--world-size", str(ranks),
                   "--max-rounds", "0", "--json", env=FAST, timeout=2400)
    summary = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(Path(summary["baseline_path"]).read_text())


MLA_KERNELS = ("npu_kv_rmsnorm_rope_cache_v2", "npu_interleave_rope", "npu_fused_infer_attention_score",
               "npu_fused_infer_attention_score_v2", "npu_transpose_batchmatmul")


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("layers", ["dense", "moe"])
def test_native_mla_recipe_passes_the_per_step_precision_check(request, layers, ranks):
    """`migrator run RECIPE --standin --world-size N` on two packed prompts: upstream's launcher runs the native
    MLA model (heads split by module.linear at 2 ranks; with MoE layers, the experts by moe_tp_size) in its
    YAML's npugraph_ex, the decode graph compiled once per rank, every prefill and decode step held to
    transformers."""
    mla_recipe = request.getfixturevalue("mla_recipe" if layers == "dense" else "mla_moe_recipe")
    name = mla_recipe["name"]
    text = (mla_recipe["recipe"] / "models" / f"modeling_{name}.py").read_text()
    assert "is_mla_backend=True" in text and "Adapted from" in text and not (mla_recipe["recipe"] / "models" / f"modeling_{name}_framework.py").exists()
    assert ("npu_moe_init_routing_v2" in text) is (layers == "moe")
    baseline = run_recipe(mla_recipe, packed_yaml(mla_recipe, ranks), ranks)
    parity, standin = baseline["verification"]["parity"], baseline["standin"]
    assert parity["ok"] is True and parity["ranks"] == ranks, parity
    # tensor parallel: every rank runs both prompts (109 and 62 tokens), each held to transformers
    requests = {(r["rank"], r["request"]): r["prompt_tokens"] for r in parity["per_request"]}
    assert sorted(requests) == [(rank, request) for rank in range(ranks) for request in (0, 1)], requests
    assert requests[(0, 0)] != requests[(0, 1)], requests
    kernels = standin["reference_kernels"]
    assert all(kernels.get(op, 0) > 0 for op in MLA_KERNELS), kernels
    assert "npu_scatter_nd_update_" not in kernels and "npu_mla_prolog_v3" not in kernels, kernels
    compiled = [entry for key, entry in standin["compiles"].items() if key.endswith("main_decode [npugraph_ex]")]
    assert len(compiled) == 1, standin["compiles"]
    assert (compiled[0]["compiles"], compiled[0]["recompiles"], compiled[0]["fullgraph"], compiled[0]["host_syncs"]) \
        == (ranks, 0, True, 0), standin["compiles"]
    assert standin["unsupported"] == []
    if layers == "moe":
        assert all(kernels.get(op, 0) > 0 for op in ("npu_moe_init_routing_v2", "npu_grouped_matmul",
                                                      "npu_moe_finalize_routing")), kernels
    print(f"NATIVE-TABLE deepseek_v3 (MLA, {layers}) ranks={ranks} ok={parity['ok']} closest={parity.get('closest')} "
          f"decode_steps={parity.get('decode_steps_checked')} requests={sorted(requests.items())}")


@pytest.mark.slow
def test_native_mla_recipe_with_the_mla_prolog(mla_recipe):
    """custom_params.enable_mla_prolog (upstream's deepseek_r1 YAMLs set it; NZ weights by default): the decode
    step runs npu_mla_prolog_v3 and still passes the per-step check."""
    baseline = run_recipe(mla_recipe, packed_yaml(mla_recipe, 1, {"enable_mla_prolog": True}), 1)
    parity, kernels = baseline["verification"]["parity"], baseline["standin"]["reference_kernels"]
    assert parity["ok"] is True and len(parity["per_request"]) == 2, parity
    assert kernels.get("npu_mla_prolog_v3", 0) > 0 and kernels.get("npu_format_cast", 0) > 0, kernels
    print(f"NATIVE-TABLE deepseek_v3 (MLA, dense, enable_mla_prolog) ranks=1 ok={parity['ok']} "
          f"closest={parity.get('closest')} decode_steps={parity.get('decode_steps_checked')}")


@pytest.mark.slow
def test_native_mla_moe_recipe_with_chunked_moe(mla_moe_recipe):
    """custom_params.moe_chunk_max_len (upstream's deepseek_r1): the packed prefill of 171 tokens through the
    sparse-MoE block 16 tokens at a time, still held to transformers per step; the routing kernel runs once per
    chunk (more calls than the unchunked run's)."""
    whole = run_recipe(mla_moe_recipe, packed_yaml(mla_moe_recipe, 1), 1)
    chunked = run_recipe(mla_moe_recipe, packed_yaml(mla_moe_recipe, 1, {"moe_chunk_max_len": 16}), 1)
    parity = chunked["verification"]["parity"]
    assert parity["ok"] is True and len(parity["per_request"]) == 2, parity
    calls = [run["standin"]["reference_kernels"].get("npu_moe_init_routing_v2", 0) for run in (whole, chunked)]
    assert 0 < calls[0] < calls[1], calls
    print(f"NATIVE-TABLE deepseek_v3 (MLA, moe, moe_chunk_max_len=16) ranks=1 ok={parity['ok']} "
          f"closest={parity.get('closest')} routing_calls whole/chunked={calls}")


# ---- the run dtype and the kernels' own widths (issue 42 item 5) -----------------------------------------
NZ_FAULT = ("c0 = 32 // self.nope_cache.element_size()", "c0 = 8")
# the plain-torch latent cache write (a rope width the fused kernels do not take) in row order, not FRACTAL_NZ's
PLAIN_NZ_FAULT = ("torch.arange(pieces, device=slots.device) * self.block_size",
                  "torch.arange(pieces, device=slots.device)")


@pytest.fixture(scope="module")
def run_dtype_checked(tmp_path_factory):
    """deepseek_v3 (every layer dense) in float32 and bfloat16; a file whose NZ view of the latent cache is
    float32's in every dtype; a checkpoint whose rope width (8) the fused rope kernels do not take (its rope and
    cache write in plain torch), and that file with its cache rows written out of FRACTAL_NZ order."""
    from agent.recipe.native.decide import render_native, selfcheck
    from agent.recipe.native.selfcheck import RUN_DTYPE

    if not harness.UPSTREAM.is_dir():
        pytest.skip(f"no upstream snapshot at {harness.UPSTREAM}")
    folder = tmp_path_factory.mktemp("native_mla_dtype")
    narrow = {**mla_config("deepseek_v3"), "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "kv_lora_rank": 16,
              "head_dim": 8}
    cases = {}
    for name, config in (("deepseek_v3", mla_config("deepseek_v3")), ("narrow_rope", narrow)):
        text = render_native(CTX, derive(config))
        (folder / f"{name}.py").write_text(text)
        cases[name] = (config, folder / f"{name}.py")
        if name == "deepseek_v3":
            assert text.count(NZ_FAULT[0]) == 1
            (folder / "nz_fault.py").write_text(text.replace(*NZ_FAULT))
            cases["nz_fault"] = (config, folder / "nz_fault.py")
        else:
            assert text.count(PLAIN_NZ_FAULT[0]) == 1 and "npu_interleave_rope(" not in text
            (folder / "plain_nz_fault.py").write_text(text.replace(*PLAIN_NZ_FAULT))
            cases["plain_nz_fault"] = (config, folder / "plain_nz_fault.py")
    labels = [(name, dtype) for name in cases for dtype in ("float32", RUN_DTYPE) if (name, dtype) != ("plain_nz_fault", RUN_DTYPE)]
    jobs = [{"config": cases[name][0], "file": str(cases[name][1]), "class_name": CTX["framework_class"], "dtype": dtype}
            for name, dtype in labels]
    return dict(zip(labels, selfcheck(jobs, harness.UPSTREAM)))


def test_the_run_dtype_and_the_kernels_widths_fail_what_float32_passes(run_dtype_checked):
    """The MLA file in bfloat16 within the verdict's tolerance; a file correct in float32 only (the latent
    cache's NZ inner block taken as float32's) fails the self-check in the run dtype; a checkpoint whose rope
    width the fused kernels do not take (8: the maintainer's failed trial) gets plain-torch rope and cache writes
    that pass in float32 and fail in bfloat16 (the NZ caches' 16-wide blocks), as they would at its trial; its
    cache written in row order fails."""
    from agent.recipe.native.selfcheck import RUN_DTYPE

    results = run_dtype_checked
    assert results[("deepseek_v3", "float32")]["ok"] and results[("deepseek_v3", RUN_DTYPE)]["ok"], results
    assert results[("nz_fault", "float32")]["ok"], results[("nz_fault", "float32")]
    assert not results[("nz_fault", RUN_DTYPE)]["ok"]
    # an 8-wide rope: npu_interleave_rope takes D 64 only, so plain torch; the bfloat16 FRACTAL_NZ caches take
    # 16-wide blocks — the file refuses in the run dtype, as it would fail at its trial on an NPU
    assert results[("narrow_rope", "float32")]["ok"], results[("narrow_rope", "float32")]
    narrow = results[("narrow_rope", RUN_DTYPE)]
    assert not narrow["ok"] and "take widths in multiples of 16" in narrow["reason"], narrow
    assert not results[("plain_nz_fault", "float32")]["ok"], results[("plain_nz_fault", "float32")]


# the plain-torch rope's rotation turned the other way; the latent cache written in row order, not FRACTAL_NZ's
MINICPM3_FAULTS = [("torch.cat((-x2, x1), dim=-1)", "torch.cat((x2, -x1), dim=-1)"), PLAIN_NZ_FAULT]


@pytest.mark.slow
def test_minicpm3s_32_wide_rope_matches_transformers_in_plain_torch_and_faults_fail(tmp_path):
    """Slow (minicpm3's derive and self-check): transformers' minicpm3 (qk_rope_head_dim 32, kv_lora_rank 256, its
    embedding / residual / logits multipliers) in float32, bfloat16 and its family settings, the rope and the latent
    cache write in plain torch and no prolog; each fault fails. The default case of this path is
    test_the_run_dtype_and_the_kernels_widths_fail_what_float32_passes (narrow_rope, its row-order fault)."""
    from transformers import AutoConfig

    from part_selfcheck import selfcheck_with_faults

    config = AutoConfig.for_model("minicpm3").to_dict()
    composition = derive(config)
    assert composition.options["ROPE_PLAIN"] is True and composition.options["PROLOG"] is False
    assert any("plain torch (npu_interleave_rope" in line for line in composition.unfused), composition.unfused
    selfcheck_with_faults({"minicpm3": (config, composition)}, {"minicpm3": MINICPM3_FAULTS}, "NativeForCausalLM",
                          tmp_path)
