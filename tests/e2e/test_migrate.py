"""End to end: tiny checkpoint -> `migrator run` -> recipe that matches transformers and runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from migrator_cli import run_cli

# Four architectures end to end; tests/e2e/test_families.py covers the other families the same way.
CI_ARCHITECTURES = ["llama", "qwen2", "qwen3", "mistral"]

# Runs in the recipe dir: the vendored class, built from the recipe's own files, against
# AutoModelForCausalLM on the same weights (independent of agent.measure.parity).
PARITY_PROBE = textwrap.dedent("""
    import json, sys, torch, yaml
    from pathlib import Path
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    name, model_cls, config_cls = sys.argv[1:4]
    import importlib
    modeling = importlib.import_module(f"models.modeling_{name}")
    configuration = importlib.import_module(f"models.configuration_{name}")
    assert Path(modeling.__file__).resolve().parent == Path("models").resolve(), modeling.__file__
    settings = yaml.safe_load(open(next(Path("config").glob("*.yaml"))))
    path = settings["model_path"]
    config = getattr(configuration, config_cls).from_pretrained(path)
    ours = getattr(modeling, model_cls).from_pretrained(path, config=config, runner_settings=settings,
                                                        dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(ours).__module__ != type(ref).__module__
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(["An attention function can be described as mapping a query"], return_tensors="pt")
    gen = GenerationConfig(do_sample=False, max_new_tokens=16, min_new_tokens=16, eos_token_id=None,
                           pad_token_id=tok.pad_token_id)
    with torch.inference_mode():
        diff = (ours(**ids).logits - ref(**ids).logits).abs().max().item()
        a = ours.generate(**ids, generation_config=gen)[0].tolist()
        b = ref.generate(**ids, generation_config=gen)[0].tolist()
    print(json.dumps({"max_abs_diff": diff, "ours": a, "ref": b}))
""")


@pytest.fixture(scope="module")
def migrated(tiny_checkpoints, tmp_path_factory):
    """model_type -> (recipe dir, CLI json summary); each architecture migrated once."""
    out = tmp_path_factory.mktemp("recipes")
    done = {}

    def get(model_type):
        if model_type not in done:
            ckpt = tiny_checkpoints(model_type)
            proc = run_cli("run", str(ckpt), "--name", f"tiny_{model_type}", "--output-dir", str(out),
                           "--device", "cpu", "--json")
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[model_type] = (out / f"tiny_{model_type}", json.loads(proc.stdout))
        return done[model_type]

    return get


# llama by default; the others repeat its path (tests/e2e/test_families.py has one case per family) and are slow
@pytest.mark.parametrize("model_type", [
    pytest.param(m, marks=() if m == "llama" else pytest.mark.slow) for m in CI_ARCHITECTURES])
def test_migrated_recipe_matches_transformers_and_runs(model_type, migrated, tmp_path):
    recipe, summary = migrated(model_type)
    name = f"tiny_{model_type}"
    assert summary["status"] == "ok" and summary["scenario"] == "A"

    # Layout of SPEC §3.
    for rel in ["config/" + f"{name}_1card_eager.yaml", f"models/configuration_{name}.py",
                "models/model_setting.py", f"models/modeling_{name}.py", "infer.py", "infer.sh",
                f"runner_{name}.py", "requirements.txt", "README.md", "baseline/baseline_metadata.json"]:
        assert (recipe / rel).is_file(), rel
    assert not (recipe / "models" / "__init__.py").exists()
    modeling = (recipe / "models" / f"modeling_{name}.py").read_text()
    assert not re.search(r"^\s*from \.", modeling, re.M), "relative import left"
    assert "import torch_npu" in modeling
    assert "runner_settings=None" in modeling

    # (a) parity: the recipe's own vendored class vs AutoModelForCausalLM, fp32.
    report = json.loads((recipe / "migration_report.json").read_text())
    vendored = report["vendored"]
    proc = subprocess.run([sys.executable, "-c", PARITY_PROBE, name, vendored["model_class"],
                           vendored["config_class"]], cwd=recipe, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(recipe)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    assert probe["max_abs_diff"] <= 1e-4
    assert len(probe["ours"]) == len(probe["ref"]) and probe["ours"] == probe["ref"]

    # (b) `bash infer.sh` from another working directory: exit 0, log has the lines.
    res = tmp_path / "res"
    run = subprocess.run(["bash", str(recipe / "infer.sh")], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "RES_PATH": str(res), "PYTHON": sys.executable}, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    log = (res / "log_0.log").read_text()
    assert len(re.findall(rf"{name} inference time cost of prefill is [\d.]+ ms", log)) == 2  # warm-up + formal
    assert re.search(rf"{name} inference time cost of decode is [\d.]+ ms", log)
    assert re.search(r"Request 0: outputs: ", log)
    assert "warm-up run begins" in log

    # (c) baseline: every field of SPEC §3, timings from the formal run of the migration's trial run.
    baseline = json.loads((recipe / "baseline" / "baseline_metadata.json").read_text())
    assert set(baseline) >= {"timestamp", "yaml_path", "environment", "model_config", "performance",
                             "verification"}
    assert set(baseline["environment"]) >= {"npu_model", "num_cards", "cann_version", "pytorch_version",
                                            "torch_npu_version", "exe_mode", "device"}
    assert baseline["environment"]["device"] == "cpu" and baseline["environment"]["npu_model"] is None
    assert baseline["yaml_path"] == f"config/{name}_1card_eager.yaml"
    # a local checkpoint: the report keeps its folder, the baseline no path of this machine
    assert baseline["model_config"] == {"model_name": name, "model_source": "your_model_source"}
    assert Path(report["model_source"]).is_dir()
    trial_log = Path(report["runs"][-1]["res_path"]) / "log_0.log"
    formal = trial_log.read_text().split("warm-up run ends")[-1]
    prefills = [float(x) for x in re.findall(r"cost of prefill is ([\d.]+) ms", formal)]
    decodes = [float(x) for x in re.findall(r"cost of decode is ([\d.]+) ms", formal)]
    assert baseline["performance"]["prefill_ms"] == pytest.approx(prefills[0], abs=0.01)
    assert baseline["performance"]["decode_avg_ms"] == pytest.approx(sum(decodes[1:]) / len(decodes[1:]), abs=0.01)
    text = re.search(r"Request 0: outputs: (.*)", formal).group(1)
    assert baseline["performance"]["output_text"].startswith(text.strip()[:10])
    parity = baseline["verification"]["parity"]
    # every step of the formal run (the prefill and each decode step) against transformers, fp32 here
    new_tokens = len(decodes) + 1
    assert parity["ok"] and parity["max_abs_logits_diff"] <= 1e-4 and parity["greedy_tokens"] == new_tokens
    assert parity["decode_steps_checked"] == new_tokens - 1 and parity["dtype"] == "float32"
    assert parity["code"]["ok"] and parity["code"]["max_abs_logits_diff"] <= 1e-4     # the shrunk-config check
    assert baseline["verification"]["all_ranks_success"] is True


@pytest.mark.slow  # two full migrations compared file by file
def test_migration_is_deterministic(tiny_checkpoints, tmp_path):
    ckpt = tiny_checkpoints("llama")
    trees = []
    for out in ("a", "b"):
        proc = run_cli("run", str(ckpt), "--name", "det", "--output-dir", str(tmp_path / out), "--device", "cpu")
        assert proc.returncode == 0, proc.stderr[-2000:]
        recipe = tmp_path / out / "det"
        # Measurements and timestamps live in baseline/, the report and .migrator/ (run logs).
        trees.append({p.relative_to(recipe): p.read_bytes() for p in recipe.rglob("*") if p.is_file()
                      and p.parts[len(recipe.parts)] not in ("baseline", ".migrator")
                      and p.name not in ("migration_report.json", "migration_summary.md")})
    assert trees[0].keys() == trees[1].keys() and len(trees[0]) >= 9
    assert trees[0] == trees[1]


def test_bad_path_is_one_line_error(tmp_path):
    proc = run_cli("run", str(tmp_path / "nope"), "--output-dir", str(tmp_path))
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert "no such directory" in proc.stderr


def test_checkpoint_without_config_is_one_line_error(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"")
    proc = run_cli("run", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert "no config.json" in proc.stderr


def test_existing_recipe_dir_is_not_overwritten(tiny_checkpoints, tmp_path):
    recipe = tmp_path / "out" / "mine"
    recipe.mkdir(parents=True)
    (recipe / "notes.txt").write_text("user notes")
    proc = run_cli("run", str(tiny_checkpoints("llama")), "--name", "mine", "--output-dir", str(tmp_path / "out"))
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert (recipe / "notes.txt").read_text() == "user notes"
