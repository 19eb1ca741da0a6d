"""The field corpus (tests/field_faults/corpus.yaml) against the whole catalogue, in-process.

Table-driven: every corpus log runs through the catalogue on a minimal recipe (with the recipe code
the report's project had) and the first rule that takes it must be the one the corpus names, so rules
of different modes do not shadow each other. Every entry injected into a real recipe and run by
`migrator run`: tests/e2e/test_field_fault_injections.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from agent.repair.failure import Failure
from agent.repair.diagnose import explain_unknown, first_matching_rule
from agent.repair.rules.reports import OOM_PATTERNS
from mini_recipe import mini_recipe

# The rules written from the field reports (tests/field_faults/corpus.yaml): none may claim an NPU kernel.
FIELD_RULE_NAMES = frozenset({
    "recipe_yaml_syntax_error", "torch_npu_imported_from_source_tree", "incidental_npu_call",
    "torch_npu_backend_autoload_failed", "torch_npu_without_cann", "tokenizer_backend_missing", "incidental_cuda_call",
    "shell_script_crlf", "shell_script_not_executable", "npu_device_id_invalid", "npu_device_busy",
    "cann_runtime_init_failed", "hccl_init_failed", "hccl_collective_timeout", "npu_api_version_mismatch",
    "static_tls_libgomp", "shared_library_missing", "transformers_does_not_know_model", "tokenizer_class_unknown",
    "transformers_api_moved", "rope_scaling_schema", "safetensors_header_invalid", "checkpoint_shape_mismatch",
    "meta_tensor_not_loaded", "mixed_dtype_in_recipe_code", "non_finite_logits", "process_group_not_initialized",
    "rendezvous_port_in_use"})
from locations import REPO_ROOT


CORPUS_FILE = REPO_ROOT / "tests" / "field_faults" / "corpus.yaml"
CORPUS = yaml.safe_load(CORPUS_FILE.read_text())


def first_rule(recipe: Path, log: str) -> str | None:
    matched = first_matching_rule(Failure.from_output(recipe, log))
    return matched[0].name if matched else None


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
    from agent.repair.diagnose import rule_named
    from agent.repair.rules.rule import RepairContext

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
    from agent.repair.diagnose import diagnose

    recipe = mini_recipe(tmp_path, {"id": "unknown2"})
    out = tmp_path / "output.txt"
    out.write_text("step 1\nRuntimeError: HCCL communicator destroyed while ranks were still running\n")
    result = diagnose(recipe, {"output_file": str(out)})
    assert result["rule"] is None
    assert result["diagnosis"].startswith("unknown failure: RuntimeError: HCCL communicator destroyed")
    assert "closest known rule: hccl_" in result["diagnosis"]
    assert result["last_lines"] == ["step 1"]


UPSTREAM_GROUPS_ERROR = ("KeyError: \"Communication group 'moe_ep_group' not found. Available groups: "
                         "['attn_tp_group', 'moe_tp_group', 'default_pg']\"")


@pytest.mark.parametrize("error, before", [
    ("ZeroDivisionError: division by zero", ""),                            # injected into infer.py
    ("RuntimeError: unreadable output: the run printed no token ids", ""),  # was: closest tokenizer_without_pad_token
    ("ValueError: expected 4 token ids in the output, got 3", ""),         # was: the same; 'expected … got' is no evidence
    # the field's three (issue 41): a shared piece of an identifier ("attn") or a bash line elsewhere in the
    # output is no evidence
    ("NameError: name 'attn_outputs' is not defined. Did you mean: 'attn_output'?", ""),   # was: flash_attn_not_installed
    (UPSTREAM_GROUPS_ERROR, ""),                                            # was: flash_attn_not_installed
    ("IndexError: list index out of range", "/r/infer.sh: line 40: 1234 Killed  python infer.py\n"),  # was: shell_script_crlf
    # unlisted variants of the same class
    ("AttributeError: 'LlamaAttention' object has no attribute 'attn_impl'", ""),
    ("KeyError: 'attn_tp_group'", ""),
    ("TypeError: __init__() got an unexpected keyword argument 'foo'", ""),    # a dunder is no subsystem
    ("IndexError: index 1 is out of bounds for dimension 0 with size 1", ""),  # numbers are no names
    ("ValueError: npu_kv_rmsnorm_rope_cache_v2: cache_mode PA_NZ needs a contiguous cache", ""),  # was: rope_scaling_schema
    # (dynamo's own exception, which named dtype_… before, is now a known rule in a graph-mode recipe:
    # graph_mode_capture_failed, tests/unit/agent/repair/rules/test_upstream.py)
    ("RuntimeError: Cannot determine the equality comparison of an object of type Foo", ""),
    ("RuntimeError: CUDA error: device-side assert triggered", ""),          # CUDA: in three rules, names none
    ("ImportError: cannot import name 'foo' from 'torch.utils'", ""),        # was: torch_npu_backend_autoload_failed
    ("KeyError: 'pad_token_id'", ""),       # a config key named like a rule's subject (was: tokenizer_without_pad_token)
    ("AttributeError: 'GPT2Model' object has no attribute 'rope'", ""),     # a plain word the pattern writes RoPE
])
def test_unrelated_unknown_failure_gets_no_closest_rule_hint(tmp_path, error, before):
    """A "closest known rule" hint only where the rule shares evidence with the failure: its pattern in
    the error, or a distinctive whole identifier of its pattern; an error with only plain words, a
    builtin exception's name, a piece of an identifier or a line elsewhere in common with a rule gets none."""
    from agent.repair.diagnose import closest_rule, diagnose

    recipe = mini_recipe(tmp_path, {"id": "unrelated"})
    out = tmp_path / "output.txt"
    out.write_text(f"step 1\n{before}Traceback (most recent call last):\n  File \"{recipe}/infer.py\", line 12, in <module>\n"
                   f"    main()\n{error}\n")
    result = diagnose(recipe, {"output_file": str(out)})
    assert result["rule"] is None and result["closest_rule"] is None, result
    assert "closest known rule" not in result["diagnosis"], result["diagnosis"]
    assert closest_rule(Failure.from_output(recipe, out.read_text())) is None


@pytest.mark.parametrize("error, rule", [
    ("RuntimeError: HcclAllreduce failed with EI0002", "hccl_collective_timeout"),    # an identifier of its pattern
    ("RuntimeError: HCCL communicator destroyed on rank 1", "hccl_init_failed"),      # HCCL: its pattern's `hccl`
    ("AssertionError: Torch not compiled with CUDA enabled", "incidental_cuda_call"),   # its pattern matches
    # a real near miss: flash_attn is installed but not the release the code imports from
    ("ImportError: cannot import name 'flash_attn_func' from 'flash_attn' (/usr/lib/flash_attn/__init__.py)",
     "flash_attn_not_installed"),
    ("ValueError: 96 is not divisible by 7", "vocab_not_divisible_by_lmhead_tp"),      # its pattern, facts declined
])
def test_related_unknown_failure_keeps_its_closest_rule_hint(tmp_path, error, rule):
    from agent.repair.diagnose import closest_rule

    recipe = mini_recipe(tmp_path, {"id": "related"})
    failure = Failure(recipe, output=f"Traceback (most recent call last):\n  File \"x.py\", line 3\n{error}\n",
                      error=error, location=None)
    assert first_matching_rule(failure) is None
    assert closest_rule(failure)[0] == rule


def test_a_branch_that_names_an_exception_type_needs_that_type(tmp_path):
    """rope_scaling_schema's `KeyError: '(type|rope_type|…)'` is evidence for a KeyError, not for another
    exception that names rope_type."""
    from agent.repair.diagnose import closest_rule, evidence_branches

    assert any(exceptions == {"KeyError"} and "rope_type" in tokens
               for tokens, exceptions in evidence_branches(r"KeyError: '(type|rope_type)'|Unknown RoPE (\w+)"))
    recipe = mini_recipe(tmp_path, {"id": "typed"})
    other = "ValueError: rope_type is llama3 but the config lacks rope_theta"
    assert closest_rule(Failure(recipe, output=other, error=other, location=None)) is None


def test_evidence_branches_keep_identifiers_whole_and_skip_what_is_not_literal():
    from agent.repair.diagnose import evidence_branches

    branches = evidence_branches(r"No module named '(flash_attn[\w.]*)'|package flash_attn seems to be not installed")
    assert [sorted(tokens) for tokens, _ in branches] == [
        ["flash_attn", "module", "named", "no"], ["be", "flash_attn", "installed", "not", "package", "seems", "to"]]
    # a negative lookahead is no evidence; an optional part is none either
    [(tokens, _)] = evidence_branches(r"module 'torch_npu(?:\.npu)?' has no attribute '(?P<api>(?!npu_|_npu)\w+)'")
    assert "npu_" not in tokens and "npu" not in tokens and "torch_npu" in tokens


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
