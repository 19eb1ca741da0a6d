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

from agent.failure import Failure
from agent.repair import explain_unknown, first_matching_rule
from agent.repair_rules.field import FIELD_RULE_NAMES
from agent.repair_rules.run import OOM_PATTERNS
from tests.conftest import REPO_ROOT, run_cli

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
    settings = MINI_YAML.replace("world_size: 1\n", f"world_size: 1\n{entry['yaml_line']}\n") \
        if entry.get("yaml_line") else MINI_YAML
    (recipe / "config" / "fi.yaml").write_text(settings)
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
        assert entry["outcome"] in ("repaired", "reported", "exit4", "unknown"), entry["id"]
        assert entry["outcome"] == "repaired" or entry.get("why"), entry["id"]


@pytest.mark.parametrize("entry", CORPUS, ids=[e["id"] for e in CORPUS])
def test_corpus_entry_takes_the_expected_rule_first(entry, tmp_path):
    recipe = mini_recipe(tmp_path, entry)
    log = entry["log"]
    name = first_rule(recipe, log)
    if entry.get("oom"):
        assert OOM_PATTERNS.search(log) and name == "out_of_memory"   # the out-of-memory rule comes before any other
        return
    assert not OOM_PATTERNS.search(log) and name != "out_of_memory", "a non-OOM entry must not be mistaken for out of memory"
    if entry["outcome"] == "exit4":
        # NPU kernels: no rule of this catalogue may claim them (the kernel check exits 4).
        assert name is None or name not in FIELD_RULE_NAMES | {"missing_pip_package", "hardcoded_cuda_device"}, name
        return
    assert name == entry["expected_rule"], (entry["id"], name)
    if entry["outcome"] == "unknown":      # no safe rule: the unknown-failure diagnosis still points somewhere
        assert explain_unknown(Failure.from_output(recipe, log))["closest_rule"] == entry["closest_rule"]


@pytest.mark.parametrize("entry", [e for e in CORPUS if e["outcome"] == "repaired"], ids=lambda e: e["id"])
def test_repairing_rules_change_the_recipe(entry, tmp_path):
    """A rule the corpus says repairs must really edit the (mini) recipe, keeping a backup-able diff."""
    from agent.repair import rule_named
    from agent.repair_rules.rule import RepairContext

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


# ---- fault injection into a real migrated recipe --------------------------------------------
GENERATE = "    def model_generate(self, prompts, warm_up=False):\n"
IMPORT = "from engine.model_runner import ModelRunner, torch\n"


def _insert(path: Path, anchor: str, text: str, before: bool = False) -> None:
    source = path.read_text()
    assert anchor in source, f"{path.name}: anchor {anchor!r} not found"
    path.write_text(source.replace(anchor, text + anchor if before else anchor + text, 1))


def _in_generate(recipe: Path, code: str) -> None:
    """Recipe code run as each generation starts: an override of model_generate in the runner (the
    rendered runner inherits it), with torch imported through the engine's guard."""
    runner = recipe / "runner_fi.py"
    source = runner.read_text()
    if GENERATE not in source:
        source = source.replace("from engine.model_runner import ModelRunner\n", IMPORT)
        source += "\n" + GENERATE + "        return super().model_generate(prompts, warm_up)\n"
        runner.write_text(source)
    _insert(runner, GENERATE, code)


def _inject_npu_calls(recipe: Path) -> None:
    # vllm-ascend#166 / X-Oscar#4: an NPU recipe imports torch_npu and calls torch.npu in passing.
    runner = recipe / "runner_fi.py"
    _in_generate(recipe, "        torch.npu.synchronize()\n        peak = torch.npu.max_memory_allocated()\n")
    _insert(runner, IMPORT, "import torch_npu\n")


def _inject_npu_device_string(recipe: Path) -> None:
    _in_generate(recipe, "        npu = torch.device(\"npu\", 0)\n")


def _inject_crlf(recipe: Path) -> None:
    # DiffRhythm#115: infer.sh saved with Windows line endings.
    sh = recipe / "infer.sh"
    sh.write_bytes(sh.read_bytes().replace(b"\n", b"\r\n"))


def _inject_yaml_syntax(recipe: Path) -> None:
    # Swar-Chia-Plot-Manager#250: a value with ': ' inside an unquoted scalar.
    path = next((recipe / "config").glob("*.yaml"))
    _insert(path, "world_size: 1\n", "exe_mode: eager: fast\n")


def _inject_cuda_set_device(recipe: Path) -> None:
    _in_generate(recipe, "        torch.cuda.set_device(0)\n")


def _inject_mixed_dtype(recipe: Path) -> None:
    # LETTER#1: recipe code makes a float32 tensor that meets bfloat16 weights.
    path = next((recipe / "config").glob("*.yaml"))
    _insert(path, "  dtype: float32\n", "  dtype: bfloat16\n", before=True)
    path.write_text(path.read_text().replace("  dtype: float32\n", "", 1))
    _in_generate(recipe,
            "        if self.model is not None:\n"
            "            probe = torch.ones(1, self.model.config.hidden_size)\n"
            "            _ = probe @ self.model.get_input_embeddings().weight[:4].T\n")


def _inject_nan_sampling(recipe: Path) -> None:
    # baby-llama2-chinese#33: sampling on nan probabilities.
    _in_generate(recipe, "        torch.multinomial(torch.full((1, 4), float(\"nan\")), 1)\n")


def _inject_no_process_group(recipe: Path) -> None:
    # InstructSeg#7: a collective in a single-process run.
    _in_generate(recipe, "        torch.distributed.barrier()\n")


def _inject_old_rope_key(recipe: Path) -> None:
    # KBLaM#37: vendored code written before transformers renamed rope_scaling["type"] to "rope_type".
    modeling = recipe / "models" / "modeling_fi.py"
    source = modeling.read_text()
    old = 'self.config.rope_parameters["rope_type"]'
    assert old in source
    modeling.write_text(source.replace(old, 'self.config.rope_scaling["type"]', 1))


# (id of the corpus entry, inject, expected outcome, rule, text the report-only note must carry, slow)
INJECTIONS = [
    dict(id="npu-module-missing-with-npu-calls", inject=_inject_npu_calls, expected="repaired",
         rule="incidental_npu_call", note=None, slow=False),
    dict(id="infer-sh-crlf", inject=_inject_crlf, expected="repaired", rule="shell_script_crlf", note=None, slow=False),
    dict(id="yaml-mapping-values", inject=_inject_yaml_syntax, expected="reported", rule="recipe_yaml_syntax_error",
         note="line 8 column 16 is not valid YAML (ScannerError): mapping values are not allowed here", slow=False),
    dict(id="npu-device-string-on-cpu", inject=_inject_npu_device_string, expected="repaired",
         rule="incidental_npu_call", note=None, slow=True),
    dict(id="cuda-set-device-on-cpu", inject=_inject_cuda_set_device, expected="repaired",
         rule="incidental_cuda_call", note=None, slow=True),
    dict(id="mixed-dtype-bf16-float", inject=_inject_mixed_dtype, expected="repaired",
         rule="mixed_dtype_in_recipe_code", note=None, slow=True),
    dict(id="rope-scaling-type-key", inject=_inject_old_rope_key, expected="repaired", rule="rope_scaling_schema",
         note=None, slow=True),
    dict(id="nan-probabilities", inject=_inject_nan_sampling, expected="reported", rule="non_finite_logits",
         note="the logits are inf/nan", slow=True),
    dict(id="process-group-not-initialized", inject=_inject_no_process_group, expected="reported",
         rule="process_group_not_initialized", note="torch.distributed is used but no process group exists",
         slow=True),
]


def _snapshot(recipe: Path) -> dict[str, bytes]:
    from agent.backup import recipe_files

    return {rel: path.read_bytes() for rel, path in recipe_files(recipe).items()}


def run_injection(scenario: dict, work: Path, source: Path | None = None) -> dict:
    """Inject one fault into a copy of a working recipe, `migrator run RECIPE --json` from the recipe's
    parent, then `migrator rollback fi` (relative). Returns what happened (used by the coverage script too).
    The run gets the absolute path: a relative one fails before any rule (see test_relative_recipe_path)."""
    source = source or build_working_recipe(work)
    recipe = work / scenario["id"] / "fi"
    shutil.copytree(source, recipe, ignore=shutil.ignore_patterns(".migrator", "res", "baseline"))
    scenario["inject"](recipe)
    injected = _snapshot(recipe)
    proc = run_cli("run", str(recipe), "--json", cwd=recipe.parent)
    summary = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    report_file = recipe / "migration_report.json"
    report = json.loads(report_file.read_text()) if report_file.is_file() else {}
    rounds = report.get("rounds", [])
    first = rounds[0] if rounds else {}
    rule = (first.get("diagnosis") or {}).get("rule")
    if proc.returncode == 0 and summary.get("status") == "ok" and first.get("applied"):
        outcome = "repaired"
    elif rule is not None and not first.get("applied"):
        outcome = "reported"
    else:
        outcome = "unknown"
    back = run_cli("rollback", "fi", cwd=recipe.parent)
    return {"id": scenario["id"], "expected": scenario["expected"], "outcome": outcome, "rule": rule,
            "rounds": len(rounds), "note": first.get("note", ""), "returncode": proc.returncode,
            "summary": summary, "first": first, "injected": injected, "recipe": recipe,
            "rollback_ok": back.returncode == 0 and _snapshot(recipe) == injected,
            "stderr": proc.stderr[-2500:]}


def build_working_recipe(work: Path) -> Path:
    """What the working_recipe_source fixture makes: a tiny llama migrated once (cached under work)."""
    out = work / "working"
    if not (out / "fi" / "infer.sh").is_file():
        from agent.tiny_checkpoint import build_tiny_checkpoint

        checkpoint = build_tiny_checkpoint("llama", work / "tiny_llama")
        proc = run_cli("run", str(checkpoint), "--name", "fi", "--output-dir", str(out), "--device", "cpu",
                       "--max-new-tokens", "8")
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "fi"


@pytest.mark.parametrize("scenario", [pytest.param(s, marks=[pytest.mark.slow] if s["slow"] else [], id=s["id"])
                                      for s in INJECTIONS])
def test_injected_field_fault(scenario, working_recipe_source, tmp_path):
    entry = next(e for e in CORPUS if e["id"] == scenario["id"])
    assert entry["expected_rule"] == scenario["rule"] and entry["outcome"] == scenario["expected"]
    result = run_injection(scenario, tmp_path, source=working_recipe_source)
    first = result["first"]
    assert first.get("diagnosis", {}).get("rule") == scenario["rule"], (first, result["stderr"])
    if scenario["expected"] == "repaired":
        assert result["returncode"] == 0 and result["summary"]["status"] == "ok", (result["summary"], result["stderr"])
        assert first["applied"] and first["diff"]
        backup = result["recipe"] / ".migrator" / "backup" / "round_1"
        for rel, content in result["injected"].items():
            assert (backup / rel).read_bytes() == content, rel
    else:
        assert result["returncode"] == 1 and result["summary"]["status"] == "failed", result["summary"]
        assert not first["applied"] and not first["diff"]
        assert scenario["note"] in first["note"], first["note"]
    assert result["outcome"] == scenario["expected"]
    assert result["rollback_ok"]            # `migrator rollback` returns the injected bytes


def test_relative_recipe_path(working_recipe):
    working_recipe.joinpath("infer.sh").write_bytes(working_recipe.joinpath("infer.sh").read_bytes().replace(b"\n", b"\r\n"))
    proc = run_cli("run", working_recipe.name, "--json", cwd=working_recipe.parent)
    report = json.loads((working_recipe / "migration_report.json").read_text())
    assert report["rounds"][0]["diagnosis"]["rule"] == "shell_script_crlf", report["rounds"][0]["diagnosis"]
    assert proc.returncode == 0


def test_incidental_npu_fix_keeps_line_endings_bom_and_mode(tmp_path):
    entry = {"id": "bytes"}
    recipe = mini_recipe(tmp_path, entry)
    runner = recipe / "runner_fi.py"
    source = "\ufeffimport torch\r\nimport torch_npu\r\n\r\n\r\ndef sync():\r\n    torch.npu.synchronize()\r\n"
    runner.write_bytes(source.encode("utf-8"))
    runner.chmod(0o755)
    log = "AttributeError: module 'torch' has no attribute 'npu'\n"
    failure = Failure.from_output(recipe, log)
    rule, facts = first_matching_rule(failure)
    assert rule.name == "incidental_npu_call" and facts == {"files": ["runner_fi.py"]}
    rule.fix(failure, facts, None)
    data = runner.read_bytes()
    assert data.startswith("\ufeff".encode("utf-8")) and b"\n" not in data.replace(b"\r\n", b"")
    assert b"    device_ops.synchronize()\r\n" in data and b"from engine import device_ops\r\n" in data
    assert runner.stat().st_mode & 0o777 == 0o755


def test_npu_kernels_are_left_to_the_kernel_check(tmp_path):
    """A recipe that also calls an NPU kernel is not 'incidental': no rewrite (the kernel check exits 4)."""
    entry = {"id": "kernel", "recipe_code": "import torch_npu\n\n\ndef norm(x, w):\n    torch.npu.synchronize()\n"
                                            "    return torch_npu.npu_rms_norm(x, w)[0]\n"}
    recipe = mini_recipe(tmp_path, entry)
    for log in ("ModuleNotFoundError: No module named 'torch_npu'\n",
                "AttributeError: module 'torch' has no attribute 'npu'\n"):
        assert first_rule(recipe, log) not in FIELD_RULE_NAMES


# ---- what this host's torch / transformers print for corpus modes (found by the injections) ---
def test_transformers5_load_report_size_mismatch_is_a_checkpoint_shape_mismatch(tmp_path):
    """transformers >= 5 prints a load report and raises 'ignore_mismatched_sizes'; the shapes are in the report."""
    recipe = mini_recipe(tmp_path, {"id": "v5_size"})
    log = ("LlamaForCausalLM LOAD REPORT from: /ckpt\n"
           "Key                       | Status   |                                                            \n"
           "--------------------------+----------+------------------------------------------------------------\n"
           "lm_head.weight            | MISMATCH | Reinit due to size mismatch - ckpt: torch.Size([384, 64]) vs model:torch.Size([400, 64])\n"
           "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
           "RuntimeError: You set `ignore_mismatched_sizes` to `False`, thus raising an error. For details look at the above report!\n")
    rule, facts = first_matching_rule(Failure.from_output(recipe, log))
    assert rule.name == "checkpoint_shape_mismatch"
    assert (facts["param"], facts["ckpt"], facts["model"]) == ("lm_head.weight", "torch.Size([384, 64])",
                                                               "torch.Size([400, 64])")
    assert rule.fix(None, facts, None).startswith("lm_head.weight: checkpoint torch.Size([384, 64]) vs model "
                                                  "torch.Size([400, 64]): config.json")


def test_sentencepiece_missing_is_not_the_tiktoken_its_fallback_asks_for(tmp_path):
    """transformers >= 5 falls back to tiktoken without SentencePiece; the missing library is SentencePiece."""
    recipe = mini_recipe(tmp_path, {"id": "v5_spm"})
    log = ("[transformers] Could not extract SentencePiece model from /ckpt/tokenizer.model using sentencepiece "
           "library due to \nSentencePieceExtractor requires the SentencePiece library but it was not found in your "
           "environment. Check out the instructions on the\n. Falling back to TikToken extractor.\n"
           "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
           "ModuleNotFoundError: No module named 'tiktoken'\n\nDuring handling of the above exception, another "
           "exception occurred:\n\nTraceback (most recent call last):\n  File \"x.py\", line 2, in <module>\n"
           "ValueError: `tiktoken` is required to read a `tiktoken` file. Install it with `pip install tiktoken`.\n")
    rule, facts = first_matching_rule(Failure.from_output(recipe, log))
    assert rule.name == "tokenizer_backend_missing" and facts["module"] == "sentencepiece"


BLOCKED = ("Traceback (most recent call last):\n  File \"runner_fi.py\", line 3, in <module>\n"
           "ModuleNotFoundError: import of torch_npu halted; None in sys.modules\n")


def test_torch_npu_blocked_by_the_engine_probe_is_an_incidental_import(tmp_path):
    """torch_npu installed but unusable (no CANN): the engine's probe blocks it, and the recipe's own
    `import torch_npu` says only 'halted'; an incidental import is still guarded."""
    recipe = mini_recipe(tmp_path, {"id": "blocked", "recipe_code": "import torch_npu\n"})
    assert first_rule(recipe, BLOCKED) == "incidental_npu_call"


def test_torch_npu_blocked_from_a_source_tree_is_reported(tmp_path):
    """...unless the torch_npu the recipe imports is a source checkout (no compiled torch_npu._C)."""
    recipe = mini_recipe(tmp_path, {"id": "tree", "recipe_code": "import torch_npu\n"})
    (recipe / "torch_npu").mkdir()
    (recipe / "torch_npu" / "__init__.py").write_text("import torch_npu._C\n")
    assert first_rule(recipe, BLOCKED) == "torch_npu_imported_from_source_tree"
    (recipe / "torch_npu" / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")   # built: not a source tree
    assert first_rule(recipe, BLOCKED) == "incidental_npu_call"
