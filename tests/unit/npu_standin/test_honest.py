"""Records only from evidence (#30.4) and nothing of ours left in a checkout (#35.5).

* a stand-in baseline is named baseline_metadata.standin.json for every recipe (ours too), the
  README's 支持的产品型号 / 性能基线 sections say only what a baseline records and are rewritten by the
  one writer of baselines; one previous baseline is kept, never a growing pile;
* `git status --porcelain --ignored` of a checkout after a migration, after an exit-4 run and after a
  stand-in run shows only the recipe and executor/core/support_models.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agent.measure import baseline as bl
from agent.recipe import readme
from agent.recipe.targets import REGISTRY
from migrator_cli import run_cli
from npu_standin import honest

TEMPLATE_README = """# M模型在NPU上推理

## 概述

text

## 支持的产品型号

{product}

## Agent 优化说明

x

## 性能基线

{perf}

## 附录

kept
"""
YAML = ("model_config:\n  model_name: \"m\"\n  exe_mode: \"eager\"\n\ndata_config:\n  input_truncated_len: 480\n\n"
        "parallel_config:\n  world_size: 1\n\nscheduler_config:\n  batch_size: 2\n  max_new_tokens: 32\n")


def _recipe(tmp_path: Path) -> Path:
    recipe = tmp_path / "m"
    (recipe / "config").mkdir(parents=True)
    (recipe / "config" / "m.yaml").write_text(YAML)
    (recipe / "README.md").write_text(TEMPLATE_README.format(product=readme.product_section(None),
                                                             perf=readme.performance_section(None, "agentic/baseline/")))
    return recipe


def _baseline(device: str, npu_model: str | None, decode: float, standin: bool) -> dict:
    data = {"yaml_path": "config/m.yaml",
            "environment": {"device": device, "npu_model": npu_model, "num_cards": 1 if device == "npu" else 0},
            "performance": {"prefill_ms": 9.0, "decode_avg_ms": decode, "output_text": "t"},
            "verification": {"parity": None}}
    if standin:
        data["standin"] = {"device": "cpu", "world_size": 1}
    return data


def test_file_name_follows_the_evidence():
    assert honest.baseline_file_name({"standin": {"device": "cpu"}}) == "baseline_metadata.standin.json"
    assert honest.baseline_file_name({}, standin=True) == "baseline_metadata.standin.json"
    assert honest.baseline_file_name({"environment": {"device": "npu"}}) == "baseline_metadata.json"


def test_product_line_only_from_an_npu_run():
    assert "尚未在 NPU 上运行" in readme.product_section(None)
    assert "not yet run on an NPU" in readme.product_section(_baseline("cpu (npu stand-in)", None, 5.0, True))
    # a stand-in record never names a product line, even one that copied an NPU's name
    fake = _baseline("npu", "Ascend910B3", 5.0, True)
    assert "Atlas" not in readme.product_section(fake)
    assert "<term>Atlas A2 系列产品</term>" in readme.product_section(_baseline("npu", "Ascend910B3", 5.0, False))
    assert "<term>Atlas A3 系列产品</term>" in readme.product_section(_baseline("npu", "Ascend910_9391", 5.0, False))
    assert "Atlas" not in readme.product_section(_baseline("npu", "Ascend310P3", 5.0, False))


def test_the_one_writer_names_a_standin_baseline_and_fills_the_readme(tmp_path):
    recipe = _recipe(tmp_path)
    out_dir = recipe / "agentic" / "baseline"
    standin = _baseline("cpu (npu stand-in)", None, 4.0, True)
    out = out_dir / honest.baseline_file_name(standin)
    bl.write_baseline(out, standin, recipe_dir=recipe)
    text = (recipe / "README.md").read_text()
    assert out.name == "baseline_metadata.standin.json" and not (out_dir / "baseline_metadata.json").exists()
    perf = text.split("## 性能基线\n", 1)[1].split("\n## ", 1)[0]
    # stand-in timings are never shown as performance: the row keeps the YAML's batch and lengths only
    assert "| BF16 | 2 | ≤480/32 | — | — | — |" in perf, perf
    assert "4.00" not in perf and "500.0" not in perf
    assert perf.strip().startswith("尚未在 NPU 上测量性能（not measured on an NPU）") and "`migrator run models/m`" in perf
    assert "agentic/baseline/baseline_metadata.standin.json" in perf     # the honest stand-in record, named
    assert "精度" not in perf                                   # no parity recorded: no precision claim
    assert "Atlas" not in text and text.endswith("## 附录\n\nkept\n")
    # an NPU baseline: the product line and its figures
    npu = _baseline("npu", "Ascend910B3", 8.0, False)
    npu["verification"]["parity"] = {"checked": True, "ok": True, "reference": "transformers LlamaForCausalLM",
                                     "max_abs_logits_diff": 0.0123, "tolerance": 0.05}
    bl.write_baseline(out_dir / honest.baseline_file_name(npu), npu, recipe_dir=recipe)
    text = (recipe / "README.md").read_text()
    assert "<term>Atlas A2 系列产品</term>" in text and "| 1×Ascend910B3 | 8.00 | 250.0 |" in text
    assert "精度：与 transformers LlamaForCausalLM 的参考输出对比一致（最大 logits 偏差 0.0123，容差 0.05）。" in text
    # a stand-in run after it leaves the NPU baseline the README's (a stand-in never replaces an NPU one)
    bl.write_baseline(out, _baseline("cpu (npu stand-in)", None, 3.0, True), recipe_dir=recipe)
    assert (recipe / "README.md").read_text() == text
    # without a recipe_dir (upstream's own recipe) the README is not touched
    before = (recipe / "README.md").read_bytes()
    bl.write_baseline(out_dir / "baseline_metadata.json", _baseline("npu", "Ascend910_9391", 1.0, False))
    assert (recipe / "README.md").read_bytes() == before


@pytest.mark.parametrize("source, recorded", [
    ("/data/checkpoints/qwen3", "your_model_source"),                      # a local folder: the placeholder
    ("./ck/qwen3", "your_model_source"),
    ("file:///data/checkpoints/qwen3", "your_model_source"),
    ("https://huggingface.co/Qwen/Qwen3-8B", "https://huggingface.co/Qwen/Qwen3-8B"),
    ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B"),
    ("/home/u/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/9c925d64d72725edaf899c6cb9c377fd0709d9c5",
     "https://huggingface.co/Qwen/Qwen3-8B/tree/9c925d64d72725edaf899c6cb9c377fd0709d9c5"),   # a hub cache: its link
])
def test_a_written_baseline_names_no_path_of_this_machine(tmp_path, source, recorded):
    """The framework recipe's tracked agentic/baseline/*.json held the local checkpoint path as model_source:
    the one writer of baselines records the hub link or a placeholder (upstream's checklist rule for paths)."""
    recipe = _recipe(tmp_path)
    out = recipe / "agentic" / "baseline" / "baseline_metadata.standin.json"
    standin = _baseline("cpu (npu stand-in)", None, 4.0, True)
    standin["model_config"] = {"model_name": "m", "model_source": source}
    bl.write_baseline(out, standin, recipe_dir=recipe)
    assert json.loads(out.read_text())["model_config"] == {"model_name": "m", "model_source": recorded}
    assert standin["model_config"]["model_source"] == source            # the caller's record is not changed


def test_one_previous_baseline_is_kept_where_it_is_told(tmp_path):
    out = tmp_path / "agentic" / "baseline" / "baseline_metadata.json"
    keep = tmp_path / "res" / ".migrator"
    for i in range(3):
        bl.write_baseline(out, {"n": i}, previous_dir=keep)
    assert sorted(p.name for p in out.parent.iterdir()) == ["baseline_metadata.json"]
    assert sorted(p.name for p in keep.iterdir()) == ["baseline_metadata.previous.json"]
    assert json.loads((keep / "baseline_metadata.previous.json").read_text()) == {"n": 1}


def _ignored_status(checkout: Path) -> list[str]:
    from upstream_checkout import _git

    return _git(checkout, "status", "--porcelain", "--ignored", "--untracked-files=all").splitlines()


def _only_recipe_and_registry(status: list[str], name: str) -> None:
    paths = [line[3:] for line in status]
    assert all(p.startswith(f"models/{name}/") or p == REGISTRY.as_posix() for p in paths), status


def test_a_checkout_after_a_migration_and_after_an_exit_4_run_shows_only_the_recipe(tmp_path):
    from agent.workflow.run import run_migration
    from agent.measure import reference as upstream
    from upstream_checkout import copy_checkout

    checkout = copy_checkout(tmp_path)
    checkpoint = upstream.tiny_checkpoint("llama", tmp_path / "ckpt")
    # exit 4 before anything is written: the checkout's pin is not this interpreter's transformers
    proc = run_cli("run", str(checkpoint), "--target", "framework", "--output-dir", str(checkout / "models"),
                   "--name", "e4_llama", "--json", cwd=tmp_path, timeout=300)
    if proc.returncode == 0:
        pytest.skip("this interpreter has the checkout's transformers pin: no exit 4 to provoke")
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert _ignored_status(checkout) == [], _ignored_status(checkout)
    assert not (checkout / "models" / "res").exists()
    run_migration({"target": str(checkpoint), "output_dir": str(checkout / "models"), "name": "st_llama",
                   "device": "cpu", "max_new_tokens": 8, "max_rounds": 0, "world_size": 1,
                   "recipe_target": "framework", "transformers_source": "installed"}, stop_after="render")
    status = _ignored_status(checkout)
    _only_recipe_and_registry(status, "st_llama")
    assert f" M {REGISTRY.as_posix()}" in status and not (checkout / "models" / "res").exists()


@pytest.mark.slow
def test_a_standin_run_of_a_framework_recipe_records_itself_as_one(tmp_path):
    """`migrator standin -- migrator run CKPT` into a checkout, then `migrator baseline RECIPE`: the
    baseline is the .standin.json one (its model_source no path of this machine), the README says it has
    not run on an NPU and its table shows no stand-in timing as performance, the previous baseline is kept once under the ignored res/, and the checkout
    shows only the recipe and the registry line."""
    from agent.measure import reference as upstream
    from upstream_checkout import copy_checkout

    checkout = copy_checkout(tmp_path)
    checkpoint = upstream.tiny_checkpoint("llama", tmp_path / "ckpt")
    proc = run_cli("standin", "--", sys.executable, "-m", "agent.cli", "run", str(checkpoint), "--output-dir",
                   str(checkout / "models"), "--name", "sr_llama", "--max-new-tokens", "8",
                   "--transformers-source", "installed", "--max-rounds", "0", "--json", cwd=tmp_path, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recipe = checkout / "models" / "sr_llama"
    out = recipe / "agentic" / "baseline" / "baseline_metadata.standin.json"
    summary = json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1])
    assert summary["baseline_path"] == str(out) and not out.with_name("baseline_metadata.json").exists()
    first = json.loads(out.read_text())
    text = (recipe / "README.md").read_text()
    perf = text.split("## 性能基线\n", 1)[1].split("\n## ", 1)[0]
    assert f"{first['performance']['decode_avg_ms']:.2f}" not in perf and "尚无基线" not in perf, perf
    assert "尚未在 NPU 上测量性能" in perf and "| — | — | — |" in perf
    assert "尚未在 NPU 上运行" in text and "Atlas" not in text
    # the tracked baseline names no path of this machine: the checkpoint was a local folder
    assert first["model_config"]["model_source"] == "your_model_source"
    assert str(tmp_path) not in out.read_text()
    assert "Agent Skills 完成迁移与优化" not in text
    for written in (recipe / "README.md", out):              # upstream's trailing-whitespace / end-of-file hooks
        body = written.read_text()
        assert body.endswith("\n") and not body.endswith("\n\n") and all(l == l.rstrip() for l in body.splitlines())
    _only_recipe_and_registry(_ignored_status(checkout), "sr_llama")
    # the migration's resume store (outside the checkout) is gone once the run ended: nothing to resume
    import hashlib
    import os
    import tempfile
    store = (Path(tempfile.gettempdir()) / f"infer-migrator-{os.getuid()}" / "checkouts"
             / hashlib.sha256(str((checkout / "models").resolve()).encode()).hexdigest()[:16])
    assert not store.exists(), sorted(store.rglob("*"))
    # `migrator baseline RECIPE` re-collects it: the table is rewritten from the new baseline
    proc = run_cli("standin", "--", sys.executable, "-m", "agent.cli", "baseline", str(recipe),
                   "--summary", str(tmp_path / "summary"), cwd=tmp_path, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = json.loads(out.read_text())
    assert second["timestamp"] != first["timestamp"] or second["performance"] != first["performance"]
    perf = (recipe / "README.md").read_text().split("## 性能基线\n", 1)[1].split("\n## ", 1)[0]
    assert f"{second['performance']['decode_avg_ms']:.2f}" not in perf and "尚未在 NPU 上测量性能" in perf, perf
    assert sorted(p.name for p in out.parent.iterdir()) == ["baseline_metadata.standin.json"]
    assert (recipe / "res" / ".migrator" / "baseline_metadata.standin.previous.json").is_file()
    _only_recipe_and_registry(_ignored_status(checkout), "sr_llama")


# ---- where a vendored file comes from (#35.1) ----------------------------------------------------
def test_provenance_names_the_exact_source(tmp_path):
    import transformers

    from agent import provenance

    tf = Path(transformers.__file__).parent / "models"
    # a file generated from a modular file without a header of its own: its model folder's copyright line
    prov = provenance.of_module("transformers.models.mistral.modeling_mistral", tf / "mistral" / "modeling_mistral.py",
                                "5.0.0")
    assert prov.adapted_from == ("https://github.com/huggingface/transformers/blob/v5.0.0/src/transformers/models/"
                                 "mistral/modeling_mistral.py")
    assert prov.copyrights and all("Mistral AI" in line for line in prov.copyrights) and prov.apache
    assert "/blob/main/" in provenance.of_module("transformers.models.mistral.modeling_mistral",
                                                 tf / "mistral" / "modeling_mistral.py", "5.1.0.dev0").adapted_from
    # remote code: the hub repository at the revision the cache snapshot (or the link) names
    snap = tmp_path / "models--Org--Name" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap / "modeling_x.py").write_text("# Copyright 2025 Org. All rights reserved.\nimport torch\n")
    prov = provenance.of_module("hf_remote_code.modeling_x", snap / "modeling_x.py", None, "Org/Name", snap)
    assert prov.adapted_from == "https://huggingface.co/Org/Name/blob/0123abcd/modeling_x.py"
    assert prov.copyrights == ("Copyright 2025 Org. All rights reserved.",) and not prov.apache
    assert "see the model repository" in provenance.header_text(prov)       # no licence notice it does not state
    prov = provenance.of_module("hf_remote_code.modeling_x", snap / "modeling_x.py", None,
                                "https://huggingface.co/Org/Name/tree/v2", tmp_path)
    assert prov.adapted_from == "https://huggingface.co/Org/Name/blob/v2/modeling_x.py"
    local = provenance.of_module("hf_remote_code.modeling_x", snap / "modeling_x.py", None, str(tmp_path), tmp_path)
    assert "not recorded" in local.adapted_from


def test_the_standin_marks_the_engines_environment_record_once(monkeypatch):
    """The stand-in's bootstrap wraps engine.environment.detect_environment (the engine never names the
    stand-in); a record an older recipe's engine marked itself is not marked twice."""
    import types

    from npu_standin import activate, honest

    monkeypatch.setenv("NPU_STANDIN", "cpu")
    monkeypatch.setitem(activate._state, "active", True)
    module = types.SimpleNamespace(detect_environment=lambda device="auto": {
        "device": "cpu", "npu_model": "Ascend910B3", "torch_npu_version": "2.1"})
    honest.mark_environment_module(module)
    honest.mark_environment_module(module)
    env = module.detect_environment("auto")
    assert env["device"] == "cpu (npu stand-in)" and env["npu_model"] is None and env["torch_npu_version"] is None
    assert env["npu_standin"]["active"] is True and env["npu_standin"]["host"] == "cpu"
    assert honest.mark_environment(dict(env)) == env
    monkeypatch.setitem(activate._state, "active", False)        # outside a stand-in process: as found
    assert module.detect_environment()["device"] == "cpu"
