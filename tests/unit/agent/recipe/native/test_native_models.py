"""The native generator (agent/recipe/native): the parts of each dense, sliding-window and sparse-MoE
architecture derived from its transformers code (agent.recipe.native.compose), and the written file held to
transformers under the npu stand-in (agent.recipe.native.selfcheck: float32, and the run dtype by the precision
verdict's rule) for llama, qwen2, qwen3, mistral, phi3, gemma, gemma2, gemma3_text and the MoE types mixtral,
qwen2_moe (gated shared expert), qwen3_moe and gpt_oss (attention sinks, biased projections, alternating
windows, clamped experts); faults written into a correct file (a window off by one, rotary on the wrong pairs,
the gemma norm's missing 1 + w, a routing without its renormalisation or with another top-k, sinks dropped,
...) must fail the same check. Slow: each type's recipe through upstream's launcher at 1 and 2 ranks, per step
against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.recipe.native.parts.part import Expr
from agent.recipe.native.compose import derive
from agent.recipe.native.decide import render_native, selfcheck
from agent.recipe.native.not_native import NotNative
from agent.recipe.native.selfcheck import RUN_DTYPE, RUN_DTYPE_SLACK
from locations import REPO_ROOT

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"
# the tested dense and sliding-window types; mistral with a window (its default has none)
TYPES = {"llama": {}, "qwen2": {}, "qwen3": {}, "mistral": {"sliding_window": 4096}, "phi3": {}, "gemma": {},
         "gemma2": {}, "gemma3_text": {}, "mixtral": {}, "qwen2_moe": {}, "qwen3_moe": {}, "gpt_oss": {}}


def type_config(model_type: str) -> dict:
    from transformers import AutoConfig

    return {**AutoConfig.for_model(model_type).to_dict(), **TYPES.get(model_type, {})}


def ctx_for(model_type: str) -> dict:
    return {"model_name": f"tiny_{model_type}", "framework_class": "TinyForCausalLM", "display_name": model_type,
            "model_class": "ForCausalLM", "transformers_version": "5.0.0"}


@pytest.fixture(scope="module")
def features():
    return {model_type: derive(type_config(model_type)) for model_type in TYPES}


# ---- what the architecture is, read from its code -------------------------------------------------
QKV = ("merged_qkv_proj", "q_proj", "q")
BIAS = Expr("config.attention_bias")


@pytest.mark.parametrize("model_type,parts,options", [
    ("llama", dict(norm="rms_norm", attention="fused_paged", block="pre_norm", mlp="gated_mlp"),
     dict(QKV="merged_qkv_proj", QK_NORM=False, EMBED_SCALE=False, WINDOWS=False, QKV_BIAS=BIAS, O_BIAS=BIAS,
          MLP_BIAS=Expr("config.mlp_bias"), SWIGLU=True)),
    ("qwen2", dict(attention="fused_paged"), dict(QKV_BIAS=True, O_BIAS=False, QK_NORM=False, WINDOWS=True,
                                                   LAYER_TYPE_WINDOWS=True)),
    ("qwen3", dict(attention="fused_paged"), dict(QKV_BIAS=BIAS, QK_NORM=True)),
    ("mistral", dict(attention="fused_paged"), dict(WINDOWS=True, LAYER_TYPE_WINDOWS=False)),
    ("phi3", dict(mlp="gated_mlp"), dict(QKV="qkv_proj", STACKED_PARAMS=())),
    ("gemma", dict(norm="offset_rms_norm"), dict(EMBED_SCALE=True, SWIGLU=False)),
    ("gemma2", dict(block="sandwich", attention="softcap_paged"),
     dict(FINAL_SOFTCAP=True, QUERY_PRE_ATTN_SCALAR=True, WINDOWS=True, LAYER_TYPE_WINDOWS=True)),
    ("gemma3_text", dict(block="sandwich", attention="fused_paged", norm="offset_rms_norm"),
     dict(QK_NORM=True, ROPE_BY_LAYER_TYPE=True, WINDOWS=True)),
    ("gpt_oss", dict(attention="fused_paged_sinks", moe="sparse_moe"),
     dict(SINKS=True, O_BIAS=BIAS, QKV_BIAS=BIAS, WINDOWS=True, LAYER_TYPE_WINDOWS=True, MOE_LAYERS="all")),
    ("qwen3_moe", dict(moe="sparse_moe", mlp="gated_mlp"),
     dict(MOE_LAYERS="decoder_sparse_step", RENORMALIZE=Expr("config.norm_topk_prob"))),
    ("mixtral", dict(moe="sparse_moe"), dict(MOE_LAYERS="all", RENORMALIZE=True,
                                             CHECKPOINT_RENAMES=((".block_sparse_moe.", ".mlp."),))),
])
def test_parts_are_read_from_the_architecture(features, model_type, parts, options):
    composition = features[model_type]
    assert {slot: composition.parts.get(slot) for slot in parts} == parts
    got = composition.options
    assert {key: got.get(key) for key in options} == options
    stacked = got.get("STACKED_PARAMS", ())
    assert (QKV in stacked) is (got.get("QKV") == "merged_qkv_proj")
    fused = " ".join(composition.fused)
    assert ("npu_fused_infer_attention_score_v2" in fused) is (composition.parts["attention"] != "softcap_paged")
    if "mlp" in composition.parts:           # a dense MLP layer: the config's activation fused or not
        assert ("npu_swiglu (gate/up)" in fused) is got["SWIGLU"]
    else:                                    # experts only: their own activation (gpt_oss's clamp: plain)
        assert "npu_swiglu (gate/up)" not in fused
    assert ("npu_moe_init_routing_v2" in fused) is ("moe" in composition.parts)
    assert "mlp" not in composition.parts or got.get("MOE_LAYERS") != "all"


def test_every_type_serves_its_family_switches(features):
    """The variants each file is checked on: every rope type transformers builds for the architecture, the bias
    keys, the tie, the sliding window, the MoE layout switches."""
    labels = {t: {label for label, _ in c.checked_variants} for t, c in features.items()}
    assert {"rope linear", "rope dynamic", "rope yarn", "rope longrope", "rope llama3", "bias attention_bias",
            "bias mlp_bias", "tie_word_embeddings"} <= labels["llama"]
    assert {"sliding window on", "tie_word_embeddings"} <= labels["qwen2"]
    assert "sliding window off" in labels["mistral"]
    assert {"decoder_sparse_step 2", "mlp_only_layers [0]", "norm_topk_prob", "no shared experts"} <= labels["qwen2_moe"]
    assert labels["phi3"] >= {"rope longrope"} and "rope linear" not in labels["phi3"]   # phi3 takes longrope only


@pytest.mark.parametrize("model_type,kind", [("deepseek_v32", "attention"), ("axk2", "norm")])  # axk2: a gated RMSNorm
def test_architectures_the_generator_does_not_write_fall_back_with_the_layer_kind(model_type, kind):
    from transformers import AutoConfig

    with pytest.raises(NotNative) as caught:
        derive(AutoConfig.for_model(model_type).to_dict())
    assert caught.value.kind == kind and caught.value.reason


# ---- the written file against transformers, and faults the check must catch ----------------------------
# (type, what the fault is, text of the correct file, its faulty replacement)
FAULTS = [
    ("mistral", "prefill window one token too wide", "pre_tokens=self.sliding_window - 1,", "pre_tokens=self.sliding_window,"),
    ("mistral", "decode window one token too wide", '{"pre_tokens": self.sliding_window - 1',
     '{"pre_tokens": self.sliding_window'),
    ("mistral", "decode reads the whole table (right mask, but the null block before the window read)",
     "table, start = self._window_blocks(block_table, kv_lens)", "table, start = block_table, torch.zeros_like(kv_lens)"),
    ("gemma2", "plain-torch decode reads the whole table on a sliding layer",
     "block_table, start = self._window_blocks(block_table, kv_lens)", "start = torch.zeros_like(kv_lens)"),
    ("llama", "rotary on interleaved pairs", 'layout="TND")', 'layout="TND", rotary_mode="interleave")'),
    ("gemma", "norm without gemma's 1 + w", "param.data.copy_(weight.float() + 1.0)", "param.data.copy_(weight.float())"),
    ("gemma", "embedding not scaled", "hidden_states = hidden_states * torch.tensor(", "hidden_states = hidden_states / torch.tensor("),
    ("gemma2", "no attention soft-capping at decode",
     "            scores = torch.tanh(scores / self.softcap) * self.softcap\n        allowed", "        allowed"),
    ("gemma2", "plain-torch decode reads the table's padding (the null block) past a row's own blocks",
     "block_table = self._own_blocks(block_table, kv_lens)", "pass"),
    ("gemma2", "plain-torch decode reads one block short of the row's length",
     "last = ((kv_lens + self.block_size - 1) // self.block_size - 1)", "last = (kv_lens // self.block_size - 1)"),
    ("gemma3_text", "the global rope base on local layers", "cos, sin = cos_sin[self.layer_type]", 'cos, sin = cos_sin["full_attention"]'),
    ("qwen3", "q/k norms skipped", "query, key = self.q_norm(query), self.k_norm(key)", "pass"),
    ("mixtral", "top-k weights not renormalised", "weights = weights / weights.sum(dim=-1, keepdim=True)\n", "\n"),
    ("qwen3_moe", "top-1 routing of a top-2 model", "npu_moe_gating_top_k_softmax(logits, None, k=self.top_k)",
     "npu_moe_gating_top_k_softmax(logits, None, k=1)"),
    ("qwen2_moe", "shared expert's sigmoid gate dropped", "torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared",
     "shared"),
    ("gpt_oss", "attention sinks dropped at decode", "block_size=self.block_size, learnable_sink=self.sinks,",
     "block_size=self.block_size,"),
]


@pytest.fixture(scope="module")
def checked(features, tmp_path_factory):
    """Every type's written file and every fault, in one stand-in process."""
    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    folder = tmp_path_factory.mktemp("native")
    jobs, labels = [], []
    texts = {t: render_native(ctx_for(t), f) for t, f in features.items()}
    for model_type, text in texts.items():
        path = folder / f"good_{model_type}.py"
        path.write_text(text)
        for dtype in ("float32", RUN_DTYPE):
            jobs.append({"config": type_config(model_type), "file": str(path), "class_name": "TinyForCausalLM",
                         "dtype": dtype})
            labels.append((dtype, model_type))
    for index, (model_type, what, correct, faulty) in enumerate(FAULTS):
        assert texts[model_type].count(correct) == 1, (model_type, correct)
        path = folder / f"fault_{index}.py"
        path.write_text(texts[model_type].replace(correct, faulty))
        jobs.append({"config": type_config(model_type), "file": str(path), "class_name": "TinyForCausalLM"})
        labels.append((what, model_type))
    results = selfcheck(jobs, SNAPSHOT)
    return dict(zip(labels, results))


@pytest.mark.parametrize("model_type", list(TYPES))
def test_native_file_matches_transformers_per_step(checked, model_type):
    """float32 within 1e-4 of the largest logit at every step; the run dtype within the precision verdict's
    tolerance (agent.measure.precision) at the prefill and the first decode."""
    result = checked[("float32", model_type)]
    assert result["ok"], result["reason"]
    assert result["max_rel"] < 1e-4
    rounded = checked[(RUN_DTYPE, model_type)]
    assert rounded["ok"], rounded["reason"]
    assert rounded["ratio"] <= RUN_DTYPE_SLACK
    print(f"{model_type}: native, prefill + decode logits within {result['max_rel']:.1e} of transformers (fp32); "
          f"{RUN_DTYPE} at {rounded['ratio']:.2f} of the verdict's tolerance")


@pytest.mark.parametrize("model_type,what", [(t, w) for t, w, _, _ in FAULTS])
def test_a_fault_in_the_native_file_fails_the_check(checked, model_type, what):
    result = checked[(what, model_type)]
    assert not result["ok"], what
    assert "differ from transformers" in result["reason"] or "Error" in result["reason"], result["reason"]


# ---- slow: each type's native recipe through upstream's launcher, held to transformers per step ------
# (tiny checkpoints; a sliding window shorter than the prompts)
RECIPE_TYPES = {"llama": {}, "qwen2": {}, "qwen3": {}, "mistral": {"sliding_window": 16}, "phi3": {}, "gemma": {},
                "gemma2": {"sliding_window": 16}, "gemma3_text": {"sliding_window": 16},
                "mixtral": {}, "qwen3_moe": {}, "qwen2_moe": {}, "gpt_oss": {"sliding_window": 16},
                # MLA + MoE at DeepSeek-V3's rope width (the NZ cache's kernel needs it divisible by 16); as many
                # key heads as query heads, as its own config (transformers' sdpa packs GQA by key heads)
                "deepseek_v3": {"qk_rope_head_dim": 64, "num_key_value_heads": 4},
                # sub-norms over the width tensor parallel splits (their sums of squares all-reduced)
                "bitnet": {},
                # an output gate from its own projection, split by heads; NoPE full-attention layers
                "afmoe": {"sliding_window": 16}}
MOE_RECIPE_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "afmoe")


@pytest.fixture(scope="module")
def native_checkout(tmp_path_factory):
    from upstream_checkout import copy_snapshot

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    root = tmp_path_factory.mktemp("native_recipes")
    return {"root": root, "checkout": copy_snapshot(root / "cann-recipes-infer"), "recipes": {}}


def native_recipe(native_checkout, model_type: str) -> tuple[Path, str]:
    from agent.measure import reference as upstream
    from agent.workflow.run import run_migration

    if model_type not in native_checkout["recipes"]:
        root, checkout = native_checkout["root"], native_checkout["checkout"]
        checkpoint = upstream.tiny_checkpoint(model_type, root / f"ckpt_{model_type}", **RECIPE_TYPES[model_type])
        name = f"nat_{model_type}"
        run_migration({"target": str(checkpoint), "output_dir": str(checkout / "models"), "name": name,
                       "device": "cpu", "max_new_tokens": 16, "max_rounds": 0, "world_size": 1,
                       "recipe_target": "framework", "transformers_source": "installed"}, stop_after="render")
        native_checkout["recipes"][model_type] = (checkout / "models" / name, name)
    return native_checkout["recipes"][model_type]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("model_type", list(RECIPE_TYPES))
def test_native_recipe_of_each_type_passes_the_per_step_precision_check(native_checkout, model_type, ranks, tmp_path):
    """`migrator run RECIPE --standin --yaml Y --world-size N` on the type's tiny checkpoint (a sliding window
    shorter than the prompts: the window's code runs) and two packed prompts of unequal length: upstream's
    launcher runs the native model (N-way tensor parallel by module.linear) in npugraph_ex, every prefill
    and decode step of each request held to transformers per layer."""
    per_step_run(native_checkout, model_type, ranks, tmp_path, "npugraph_ex")


# ge_graph (torchair's GE backend: a static graph, the decode lengths as tensors) on a dense, a sliding-window,
# a soft-capped, a MoE and an MLA family
GE_GRAPH_TYPES = ("qwen3", "mistral", "gemma2", "qwen3_moe", "deepseek_v3")


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("model_type", GE_GRAPH_TYPES)
def test_native_recipe_compiles_once_in_ge_graph_per_step(native_checkout, model_type, ranks, tmp_path):
    """The same run in `exe_mode: ge_graph`, as upstream's models/qwen and qwen3_moe run it: the decode's fused
    attention is torchair.ops' (lengths as tensors; torch.ops.npu's takes host lists, which a static graph
    reads back as unbacked symbols), the decode graph compiled once per rank, whole, nothing read back to the
    host, every step held to transformers."""
    per_step_run(native_checkout, model_type, ranks, tmp_path, "ge_graph")


def per_step_run(native_checkout, model_type: str, ranks: int, tmp_path: Path, exe_mode: str) -> None:
    import json

    from framework_recipes import check_native_model, two_prompt_yaml
    from migrator_cli import run_cli
    from upstream_checkout import FAST

    recipe, name = native_recipe(native_checkout, model_type)
    check_native_model(recipe / "models" / f"modeling_{name}.py")
    assert not (recipe / "models" / f"modeling_{name}_framework.py").exists()
    checkpoint = native_checkout["root"] / f"ckpt_{model_type}"
    window = json.loads((checkpoint / "config.json").read_text()).get("sliding_window") or None   # qwen2_moe: 0
    assert window == RECIPE_TYPES[model_type].get("sliding_window"), window
    settings = two_prompt_yaml(recipe, tmp_path, ranks, checkpoint, exe_mode)
    proc = run_cli("run", str(recipe), "--standin", "--yaml", settings, "--world-size", str(ranks),
                   "--max-rounds", "0", "--json", env=FAST, timeout=2400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    baseline = json.loads(Path(json.loads(proc.stdout)["baseline_path"]).read_text())
    parity = baseline["verification"]["parity"]
    assert parity["ok"] is True and parity["ranks"] == ranks, parity
    # every rank runs both prompts, of unequal length, each longer than the window
    requests = {(r["rank"], r["request"]): r["prompt_tokens"] for r in parity["per_request"]}
    assert sorted(requests) == [(rank, request) for rank in range(ranks) for request in (0, 1)], requests
    assert requests[(0, 0)] != requests[(0, 1)] and min(requests.values()) > (window or 0), requests
    compiled = {k: v for k, v in (baseline.get("standin") or {}).get("compiles", {}).items() if f"[{exe_mode}]" in k}
    # the decode graph compiled once in each rank's warm-up (the record sums the ranks' processes), never
    # again, captured whole, nothing in it read back to the host
    assert [(v["compiles"], v["recompiles"], v["fullgraph"], v["host_syncs"]) for v in compiled.values()] \
        == [(ranks, 0, True, 0)], compiled
    ops = (baseline.get("standin") or {}).get("reference_kernels", {})
    if model_type != "gemma2":                # gemma2's soft-capped attention is plain torch
        # the prefill's fused attention is torch_npu's (MLA's the first op, over its latent cache, as upstream's
        # deepseek_r1); the decode's is torchair's in a GE graph, torch_npu's otherwise
        fused = "npu_fused_infer_attention_score"
        assert any(op.startswith(fused) for op in ops), ops
        assert any(op.startswith(f"torchair.ops.{fused}") for op in ops) is (exe_mode == "ge_graph"), ops
    if model_type in MOE_RECIPE_TYPES:      # the MoE kernel chain ran, the experts split by moe_tp_size
        assert {"npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_moe_finalize_routing"} <= set(ops), ops
        assert f"moe_tp_size: {ranks}" in (recipe / "config" / settings).read_text()
    print(f"NATIVE-TABLE {model_type} {exe_mode} ranks={ranks} window={window} ok={parity['ok']} "
          f"closest={parity.get('closest')} routing_ties={parity.get('routing_ties_taken')} "
          f"decode_steps={parity.get('decode_steps_checked')} requests={sorted(requests.items())} "
          f"compiles={list(compiled.values())}")


# a recipe generated from one tiny checkpoint, run on another of its family (model_path alone changed)
FAMILY_CHECKPOINTS = {
    "llama": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64},
                            tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "qwen2_moe": ("qwen2_moe", dict(decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=True)),
    # the other switch: every layer sparse by the step, the last one dense by mlp_only_layers
    "qwen2_moe-mlp_only_layers": ("qwen2_moe", dict(decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False)),
}


@pytest.mark.slow     # the default case of this path: tests/e2e/test_framework_target.py::test_the_llama_recipe_serves_a_llama_checkpoint_with_another_rope_tied_embeddings_and_biases
@pytest.mark.parametrize("variant", list(FAMILY_CHECKPOINTS))
def test_native_recipe_serves_another_checkpoint_of_its_family_per_step(native_checkout, variant, tmp_path):
    """The recipe generated from the type's plain tiny checkpoint (default rope, untied, no biases; every qwen2_moe
    layer sparse, no renormalisation), its YAML's model_path pointed at a checkpoint of the family that differs
    in what the file reads from the config (llama: llama3 rope, tied embeddings without lm_head.weight, attention
    and MLP biases; qwen2_moe: a dense layer by decoder_sparse_step, renormalised top-k, or a dense layer by
    mlp_only_layers): upstream's launcher runs it, every prefill and decode step held to transformers on that
    checkpoint."""
    import json

    from agent.measure import reference as upstream
    from framework_recipes import two_prompt_yaml
    from migrator_cli import run_cli
    from upstream_checkout import FAST

    model_type, overrides = FAMILY_CHECKPOINTS[variant]
    recipe, name = native_recipe(native_checkout, model_type)
    other = upstream.tiny_checkpoint(model_type, native_checkout["root"] / f"ckpt_{variant}_family",
                                     seed=1, **overrides)
    stored = json.loads((other / "config.json").read_text())
    assert {k: stored[k] for k in overrides if k != "rope_parameters"} == \
        {k: v for k, v in overrides.items() if k != "rope_parameters"}
    if model_type == "llama":
        from safetensors import safe_open

        with safe_open(str(other / "model.safetensors"), "pt") as weights:
            assert "lm_head.weight" not in weights.keys() and "model.layers.0.self_attn.q_proj.bias" in weights.keys()
    settings = two_prompt_yaml(recipe, tmp_path, 1, other, "npugraph_ex")
    proc = run_cli("run", str(recipe), "--standin", "--yaml", settings, "--world-size", "1",
                   "--max-rounds", "0", "--json", env=FAST, timeout=2400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    parity = json.loads(Path(json.loads(proc.stdout)["baseline_path"]).read_text())["verification"]["parity"]
    assert parity["ok"] is True and len(parity["per_request"]) == 2, parity
    print(f"NATIVE-TABLE {model_type} (family checkpoint {sorted(overrides)}) ranks=1 "
          f"ok={parity['ok']} closest={parity.get('closest')} decode_steps={parity.get('decode_steps_checked')}")


def test_native_coverage_script_writes_a_row_per_type(tmp_path):
    """scripts/native_coverage.py: a type the generator writes is native with its self-check figure, measured on
    its checkpoint-shaped config (agent.testing.checkpoint_shapes); one whose layer kind it does not write (rwkv:
    no attention heads) falls back naming the kind; one the migrator refuses (bart: an encoder-decoder) and one
    transformers itself runs on none of try_architectures' tiny configs (dbrx: its attention config lacks
    rope_theta) are not counted as testable."""
    import json
    import subprocess
    import sys

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "native_coverage.py"), "llama", "rwkv", "bart",
                           "dbrx", "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                          env={**__import__("os").environ, "CHECKOUT": str(SNAPSHOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {row["type"]: row for row in json.loads(out.read_text())}
    assert rows["llama"]["result"] == "native" and rows["llama"]["max_rel"] < 1e-4, rows["llama"]
    assert rows["llama"]["config"] == "meta-llama/Llama-3.1-8B-Instruct", rows["llama"]    # its checkpoint shape
    assert rows["rwkv"]["result"] == "fell back" and rows["rwkv"]["kind"] == "attention", rows["rwkv"]
    assert rows["bart"]["result"] == "refused" and "encoder-decoder" in rows["bart"]["reason"], rows["bart"]
    assert rows["dbrx"]["result"] == "hf-fails" and "rope_theta" in rows["dbrx"]["reason"], rows["dbrx"]
    shaped = sum(rows[t]["config"] != "defaults" for t in ("llama", "rwkv"))
    assert (f"1 native of 2 testable types ({shaped} on a checkpoint-shaped config); 1 fell back, 1 refused, "
            "1 hf-fails, 0 no config; 4 types") in proc.stdout
