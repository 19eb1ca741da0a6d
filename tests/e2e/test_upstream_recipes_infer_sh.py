"""Upstream cann-recipes-infer's own recipes on the npu stand-in (a copy of the snapshot), through its
real entry point `executor/scripts/infer.sh --model M --yaml F`, with tiny random weights in the HF
shapes; greedy tokens against transformers' own model (agent.measure.reference.greedy_parity).

The default suite runs one rank of Qwen3 (eager); the other variants, two ranks, graph mode and the
legacy pangu_7b recipe are marked slow (`pytest -m slow tests/e2e/test_upstream_recipes_infer_sh.py`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from locations import REPO_ROOT
from migrator_cli import run_cli
from agent.measure import reference as upstream

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"
MAX_NEW_TOKENS = 16
INPUT_LEN = 128
TP2 = {"world_size": 2, "attn_tp_size": 2, "lmhead_tp_size": 2}


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT} (../shared is absent)")
    target = tmp_path_factory.mktemp("upstream") / "cann-recipes-infer"
    shutil.copytree(SNAPSHOT, target)
    for path in [target, *target.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o200)
    return target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    built: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in built:
            built[model_type] = upstream.tiny_checkpoint(model_type, tmp_path_factory.mktemp(f"tiny_{model_type}"))
        return built[model_type]

    return get


def run_recipe(checkout: Path, tmp_path: Path, model: str, source_yaml: str, checkpoint: Path, *, name: str,
               exe_mode: str | None = "eager", parallel: dict | None = None, compile_mode: str = "capture"):
    yaml_name = f"{name}.yaml"
    upstream.tiny_yaml(checkout / "models" / model / "config" / source_yaml,
                       checkout / "models" / model / "config" / yaml_name, checkpoint,
                       max_new_tokens=MAX_NEW_TOKENS, input_len=INPUT_LEN, exe_mode=exe_mode, parallel=parallel)
    record = tmp_path / "record"
    proc = run_cli("standin", "--record", str(record), "--compile", compile_mode, "--",
                   *upstream.framework_command(checkout, model, yaml_name), cwd=tmp_path, timeout=1800)
    logs = upstream.rank_logs(checkout, model, yaml_name)
    usage = json.loads((record / "standin_usage.json").read_text()) if (record / "standin_usage.json").is_file() else None
    return proc, logs, usage, yaml_name


def prompt(checkout: Path) -> str:
    return json.loads((checkout / "dataset" / "default_prompt.json").read_text())["text"]


def check_parity(checkout, logs, checkpoint, ranks):
    assert len(logs) == ranks
    texts = [upstream.outputs(log).get(0) for log in logs]
    assert all(t is not None for t in texts), [log.read_text()[-2000:] for log in logs]
    assert len(set(texts)) == 1                                   # every rank generated the same text
    result = upstream.greedy_parity(checkpoint, prompt(checkout), texts[0], MAX_NEW_TOKENS, INPUT_LEN)
    print(f"parity: equal={result['equal']} equal_up_to_ties={result['equal_up_to_ties']} "
          f"ties={result['ties']} min_margin={result['min_margin']}")
    assert result["equal_up_to_ties"], result
    assert result["tokens"] == MAX_NEW_TOKENS or result["ties"] is not None
    assert len(result["ties"]) <= 2, result
    return result


@pytest.mark.slow  # tests/e2e/test_upstream_recipes_standin.py runs the same Qwen3 rank through `migrator run --standin` by default
def test_qwen3_one_rank_runs_through_upstreams_infer_sh_with_parity(checkout, tiny, tmp_path):
    checkpoint = tiny("qwen3")
    proc, logs, usage, yaml_name = run_recipe(checkout, tmp_path, "qwen", "qwen3_8b_1tp.yaml", checkpoint,
                                              name="tiny_qwen3_1tp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log_text = logs[0].read_text()
    assert "[npu-standin] active: npu -> cpu" in log_text and "Traceback" not in log_text
    check_parity(checkout, logs, checkpoint, 1)
    assert set(usage["ops"]) == {"npu_rms_norm", "npu_add_rms_norm", "npu_apply_rotary_pos_emb",
                                 "npu_scatter_nd_update_", "npu_fused_infer_attention_score_v2", "npu_format_cast"}
    assert usage["ranks"] == [0] and not usage["unsupported"]
    assert any("kept /root/atc_data/" in line for line in usage["guards"])      # set_env.sh's rm -rf, kept
    # the baseline of this run says what it was
    out = tmp_path / "baseline_metadata.json"
    collect = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "collect_baseline.py"), "--log-file",
                              str(logs[0].parent), "--output", str(out), "--yaml-file",
                              str(checkout / "models" / "qwen" / "config" / yaml_name)],
                             capture_output=True, text=True, timeout=300)
    assert collect.returncode == 0, collect.stderr
    baseline = json.loads(out.read_text())
    env = baseline["environment"]
    assert env["device"] == "cpu (npu stand-in)" and env["npu_model"] is None and env["torch_npu_version"] is None
    assert baseline["standin"]["reference_kernels"]["npu_fused_infer_attention_score_v2"] == \
        usage["ops"]["npu_fused_infer_attention_score_v2"]
    assert "not NPU figures" in baseline["performance"]["timing"]
    assert baseline["performance"]["prefill_ms"] > 0


CASES = [
    pytest.param("qwen", "qwen3_8b_2tp.yaml", "qwen3", None, 2, id="qwen3-2ranks"),
    pytest.param("qwen", "qwen25_7b_instruct_1tp.yaml", "qwen2", None, 1, id="qwen2-1rank"),
    pytest.param("qwen", "qwen25_7b_instruct_2tp.yaml", "qwen2", None, 2, id="qwen2-2ranks"),
    pytest.param("gpt_oss", "gpt_oss_20b.yaml", "gpt_oss", None, 1, id="gpt_oss-1rank"),
    pytest.param("gpt_oss", "gpt_oss_20b.yaml", "gpt_oss", {**TP2, "moe_tp_size": 2}, 2, id="gpt_oss-2ranks"),
]


@pytest.mark.slow
@pytest.mark.parametrize("model,source_yaml,model_type,parallel,ranks", CASES)
def test_upstream_recipe_on_the_standin_matches_transformers(checkout, tiny, tmp_path, model, source_yaml,
                                                              model_type, parallel, ranks):
    checkpoint = tiny(model_type)
    proc, logs, usage, _ = run_recipe(checkout, tmp_path, model, source_yaml, checkpoint,
                                      name=f"tiny_{model_type}_{ranks}", parallel=parallel)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_parity(checkout, logs, checkpoint, ranks)
    assert usage["ranks"] == list(range(ranks)) and not usage["unsupported"]
    if ranks > 1:
        assert usage["runtime"]["hccl->gloo"] == ranks
    if model == "gpt_oss":
        assert {"npu_moe_gating_top_k_softmax", "npu_moe_init_routing", "npu_moe_compute_expert_tokens",
                "npu_grouped_matmul", "npu_moe_finalize_routing"} <= set(usage["ops"])


@pytest.mark.slow
@pytest.mark.parametrize("exe_mode,compile_mode", [("ge_graph", "capture"), ("npugraph_ex", "capture"),
                                                   ("ge_graph", "inductor")])
def test_qwen3_graph_modes_compile_with_torch_compile(checkout, tiny, tmp_path, exe_mode, compile_mode):
    """upstream's default exe_mode (ge_graph: torchair's GE backend, torchair.ops attention in decode)
    and npugraph_ex: the decode step is captured by torch.compile, once."""
    checkpoint = tiny("qwen3")
    proc, logs, usage, _ = run_recipe(checkout, tmp_path, "qwen", "qwen3_8b_1tp.yaml", checkpoint,
                                      name=f"tiny_qwen3_{exe_mode}_{compile_mode}", exe_mode=exe_mode,
                                      compile_mode=compile_mode)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_parity(checkout, logs, checkpoint, 1)
    entry = usage["compiles"][f"QwenForCausalLM.main_decode [{exe_mode}]"]
    assert entry["mode"] == compile_mode and entry["compiles"] == 1 and entry["recompiles"] == 0
    assert "eager_fallback" not in entry
    if exe_mode == "ge_graph":
        assert usage["ops"]["torchair.ops.npu_fused_infer_attention_score_v2"] > 0


@pytest.mark.slow
def test_legacy_pangu_7b_gets_as_far_as_its_own_code_allows(checkout, tmp_path):
    """models/pangu_7b's own infer.sh (ModelRunner, function.sh's launch) with its fixed YAML pointed at a
    tiny llama-shaped checkpoint: the stand-in carries it through the launcher, torch_npu / torchair
    imports and the NPU runtime calls; it stops in its own modeling code, which reads
    `config.rope_scaling["type"]` — on transformers 5 a config's rope_scaling is the rope_parameters
    dict ({"rope_theta", "rope_type"}), without "type"."""
    tiny_dir = upstream.tiny_checkpoint("llama", tmp_path / "tiny_pangu", attention_bias=True)
    config = json.loads((tiny_dir / "config.json").read_text())
    config.update(model_type="PanguEmbedded", architectures=["PanguEmbeddedForCausalLM"], bias=True)
    (tiny_dir / "config.json").write_text(json.dumps(config, indent=2))
    yaml_path = checkout / "models" / "pangu_7b" / "config" / "openpangu_v5_7b_mxfp8.yaml"   # what infer.sh reads
    upstream.tiny_yaml(yaml_path, yaml_path, tiny_dir, max_new_tokens=MAX_NEW_TOKENS, input_len=INPUT_LEN)
    record = tmp_path / "record"
    proc = run_cli("standin", "--record", str(record), "--", "bash", str(checkout / "models" / "pangu_7b" / "infer.sh"),
                   cwd=tmp_path, timeout=1200)
    log = next((checkout / "models" / "pangu_7b" / "res").glob("*/*/log_0.log"))
    text = log.read_text()
    assert "[npu-standin] active: npu -> cpu" in text
    assert "Set execution using npu index: 0" in text                        # ModelRunner on torch.npu
    assert 'scaling_type = self.config.rope_scaling["type"]' in text and "KeyError: 'type'" in text
    usage = json.loads((record / "standin_usage.json").read_text())
    assert usage["runtime"]["torch.npu.set_device"] >= 1 and not usage["unsupported"]
