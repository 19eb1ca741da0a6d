"""Recipes this tool did not write, in process: NPU kernel scan, what a folder is, the run verdict from evidence,
the first real error, byte-preserving repairs, and what the report writes."""

from __future__ import annotations

import json

import pytest

from agent.recipe.recipe import Recipe
from agent.recipe.npu_scan import scan_recipe, scan_source
from agent.repair.failure import Failure, summarise_failure
from agent.repair.diagnose import first_matching_rule
from agent.recipe.textfile import detect_format, restore_format

from checkout_fixture import write_executor, write_framework_recipe, write_legacy_recipe


# ---- NPU kernel scan ----------------------------------------------------------------------
@pytest.mark.parametrize("source, expected", [
    ("import torch\n", []),
    # incidental calls with a portable equivalent are not kernels
    ("import torch\nimport torch_npu\ntorch.npu.synchronize()\nx = y.npu()\ntorch_npu.npu.set_device(0)\n", []),
    ("import torch_npu\nout = torch_npu.npu_rms_norm(x, w)[0]\n", [("npu_rms_norm", 2)]),
    ("import torch_npu as tnpu\n\ndef f(q):\n    return tnpu.npu_rotary_mul(q, c, s)\n", [("npu_rotary_mul", 4)]),
    ("from torch_npu import npu_fused_infer_attention_score as fia\n", [("npu_fused_infer_attention_score", 1)]),
    # a kernel imported by name is called by that name: each call is a call site
    ("from torch_npu import npu_rms_norm as rms\ny = rms(x, w)\nz = rms(y, w)\n",
     [("npu_rms_norm", 1), ("npu_rms_norm", 2), ("npu_rms_norm", 3)]),
    # private kernels (vllm-ascend#218): no portable equivalent either
    ("import torch_npu\nq = torch_npu._npu_rotary_embedding(pos, q, k, 64, cache, True)\n", [("_npu_rotary_embedding", 2)]),
    ("from torch_npu import _npu_reshape_and_cache\n", [("_npu_reshape_and_cache", 1)]),
    ("import torch\ny = torch.ops.npu.npu_add_rms_norm(a, b, w)\n", [("torch.ops.npu.npu_add_rms_norm", 2)]),
    ("import torchair as tng\nbackend = tng.get_npu_backend()\n", [("torchair", 1)]),
    # a bare torchair import nothing uses: guarded by a repair, not a torchair-only path
    ("import torchair as tng\n", []),
    # a lazy torchair import (graph mode only) is no kernel for an eager recipe
    ("def graph_compile(self):\n    import torchair as tng\n", []),
    ("try:\n    import torchair\nexcept ImportError:\n    torchair = None\n", []),
    ("def f(:\n", []),                                       # does not parse: nothing claimed
])
def test_scan_source_counts_kernels_only(source, expected):
    assert scan_source(source) == expected


def test_unguarded_torch_npu_import_counts_in_shared_code_only():
    unguarded = "import torch\nimport torch_npu\n"
    guarded = "try:\n    import torch_npu\nexcept ImportError:\n    torch_npu = None\n"
    assert scan_source(unguarded) == []                                   # the recipe's own: portable-able
    assert scan_source(unguarded, shared=True) == [("import torch_npu", 2)]
    assert scan_source(guarded, shared=True) == []
    assert scan_source("def f():\n    import torch_npu\n", shared=True) == []


@pytest.mark.parametrize("source, expected", [
    ("import custom_ops\n", [("import custom_ops", "AscendC", 1, True)]),
    ("from ops.pypto_python import mla\n", [("from ops.pypto_python import mla", "PyPTO", 1, True)]),
    # behind a function, try, if or with: reached only when that runs
    ("def f():\n    import tilelang\n", [("import tilelang", "TileLang", 2, False)]),
    ("try:\n    import custom_ops\nexcept ImportError:\n    import cann_ops_transformer\n",
     [("import custom_ops", "AscendC", 2, False), ("import cann_ops_transformer", "CANN ops-transformer", 4, False)]),
    ("if fast:\n    import ops.cannbot_dsl\n", [("import ops.cannbot_dsl", "cannbot DSL", 2, False)]),
    ("with ctx():\n    import pypto\n", [("import pypto", "PyPTO", 2, False)]),
    # a torch.ops call may sit behind a YAML switch: possible, never certain
    ("import torch\ny = torch.ops.custom.npu_hc_pre(x)\n", [("torch.ops.custom.npu_hc_pre", "AscendC", 2, False)]),
    ("import torch\nimport torch_npu\ntorch_npu.npu_rms_norm(x)\nimport ops_local\n", []),   # not compiled ops
    ("def f(:\n", []),
])
def test_compiled_op_scan_says_which_ops_are_certain_to_run(source, expected):
    from agent.recipe.compiled_ops import scan_source as compiled_ops

    assert compiled_ops(source) == expected


def test_the_npu_scans_share_one_walker():
    """The kernel scan, the compiled-op scan and the stand-in's coverage scan walk sources the same way
    (npu_standin.scan.SourceScan): one scope rule for what is lazy, optional or not certain to run."""
    from agent.recipe import compiled_ops, npu_scan
    from npu_standin import scan

    assert all(issubclass(v, scan.SourceScan) for v in (npu_scan._Visitor, compiled_ops._Visitor, scan._Visitor))
    source = "import torch_npu\nif x:\n    torch_npu.npu_swiglu(y)\ndef f():\n    import custom_ops\n"
    assert scan.scan_source(source) == [("torch_npu", 1), ("torch_npu.npu_swiglu", 3)]
    assert scan_source(source) == [("npu_swiglu", 3)]
    assert compiled_ops.scan_source(source) == [("import custom_ops", "AscendC", 5, False)]


def test_scan_follows_the_recipe_into_shared_code_it_imports(tmp_path, tiny_ckpt_path):
    write_executor(tmp_path)
    recipe = write_legacy_recipe(tmp_path, "plain", tiny_ckpt_path)
    assert not scan_recipe(recipe, tmp_path).needs_npu                    # the stand-in executor is portable
    utils = tmp_path / "executor" / "utils" / "__init__.py"
    utils.write_text("import torch_npu\nimport torchair as tng\n" + utils.read_text())
    scan = scan_recipe(recipe, tmp_path)
    assert [(k.name, k.where, k.shared) for k in scan.kernels] == [
        ("import torch_npu", "executor/utils/__init__.py:1", True), ("torchair", "executor/utils/__init__.py:2", True)]
    assert scan.message() == ("needs an Ascend NPU: NPU-only imports with no portable path (import torch_npu, "
                              "torchair; first: import torch_npu at executor/utils/__init__.py:1); run on an NPU host")
    # a kernel called later is the first real call, ahead of the import lines
    utils.write_text(utils.read_text() + "\ndef norm(x, w):\n    return torch_npu.npu_rms_norm(x, w)[0]\n")
    calls = scan_recipe(recipe, tmp_path)
    last = len(utils.read_text().splitlines())
    assert calls.message() == ("needs an Ascend NPU: 1 torch_npu kernel (npu_rms_norm) at 1 call site; first call: "
                               f"npu_rms_norm at executor/utils/__init__.py:{last}; run on an NPU host")
    utils.write_text("import torch_npu\nimport torchair as tng\n" + utils.read_text().split("\n", 2)[2]
                     .rsplit("\ndef norm", 1)[0])
    # a shared module the recipe does not import does not count
    (tmp_path / "executor" / "other.py").write_text("import torch_npu\n")
    assert len(scan_recipe(recipe, tmp_path).kernels) == 2


def test_graph_exe_mode_makes_lazy_torchair_a_kernel(tmp_path, tiny_ckpt_path):
    write_executor(tmp_path)
    recipe = write_framework_recipe(tmp_path, "g", tiny_ckpt_path, exe_mode="ge_graph")
    (recipe / "runner_g.py").write_text("def compile(self):\n    import torchair as tng\n")
    assert [k.name for k in scan_recipe(recipe, tmp_path).kernels] == ["torchair"]


@pytest.fixture
def tiny_ckpt_path(tmp_path):
    """A path recorded in YAMLs only (the scan never loads it)."""
    return tmp_path / "no_weights_needed"


# ---- what a folder is ---------------------------------------------------------------------
def test_recipe_kinds_commands_and_paths(tmp_path, tiny_ckpt_path, monkeypatch):
    write_executor(tmp_path)
    legacy = write_legacy_recipe(tmp_path, "leg", tiny_ckpt_path)
    fw = write_framework_recipe(tmp_path, "fw", tiny_ckpt_path)
    ckpt = tmp_path / "models" / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"\0")
    (ckpt / "infer.sh").write_text("touch ran\n")
    assert Recipe.at(ckpt).kind == "checkpoint"                  # an infer.sh does not make it a recipe
    assert Recipe.at(legacy).kind == "legacy" and Recipe.at(legacy).yaml == legacy / "config" / "leg.yaml"
    assert Recipe.at(legacy).launch().command == ("bash", str(legacy.resolve() / "infer.sh"))
    info = Recipe.at(fw)
    assert info.kind == "framework" and info.repo_root == tmp_path.resolve() and info.model_name == "fw"
    launch = info.launch()
    assert launch.command == ("bash", str(tmp_path.resolve() / "executor/scripts/infer.sh"), "--model", "fw",
                              "--yaml", "fw_rank_1_eager.yaml")
    assert launch.cwd is None and launch.env["PYTHONPATH"].split(":")[0] == str(tmp_path.resolve())
    assert info.entry_files == (tmp_path.resolve() / "executor/offline/infer.py",)
    assert info.baseline_dir() == fw.resolve() / "baseline"
    (fw / "agentic").mkdir()
    assert Recipe.at(fw).baseline_dir() == fw.resolve() / "agentic" / "baseline"   # the repository's convention
    none = Recipe.at(tmp_path / "executor")
    assert none.kind == "none" and not none.is_recipe and "no infer.sh" in none.reason
    readme_only = tmp_path / "models" / "hstu"
    readme_only.mkdir()
    (readme_only / "README.md").write_text("# hstu\n")
    assert Recipe.at(readme_only).kind == "none" and "no config/*.yaml" in Recipe.at(readme_only).reason
    # relative, ".", and a symlinked folder all name the same recipe
    link = tmp_path / "link"
    link.symlink_to(fw)
    monkeypatch.chdir(fw)
    assert Recipe.at(".").path == Recipe.at("../fw").path == Recipe.at(link).path == fw.resolve()


def test_standalone_recipe_yamls_and_launch(tmp_path):
    """Our layout: the runner on engine.model_runner; the N-card YAML is named, written from the
    single-card one when missing, and handed to infer.sh through YAML_FILE."""
    recipe = tmp_path / "ours"
    (recipe / "config").mkdir(parents=True)
    (recipe / "infer.sh").write_text('YAML_FILE="${YAML_FILE:-config/ours_1card_eager.yaml}"\n')
    (recipe / "runner_ours.py").write_text("from engine.model_runner import ModelRunner\n")
    (recipe / "config" / "ours_1card_eager.yaml").write_text(
        "model_name: ours\nworld_size: 1\nparallel_config:\n  attn_tp_size: 1\n")
    found = Recipe.at(recipe)
    assert (found.kind, found.model_name, found.yaml.name) == ("standalone", "ours", "ours_1card_eager.yaml")
    assert found.yaml_for(2) is None and found.launch(1).env == {"YAML_FILE": "config/ours_1card_eager.yaml"}
    launch = found.launch(2)
    assert launch.env == {"YAML_FILE": "config/ours_2card_eager.yaml"} and launch.cwd == recipe.resolve()
    written = found.yaml_for(2)
    assert found.settings(written)["world_size"] == 2 and found.settings(written)["parallel_config"] == {
        "attn_tp_size": 2, "moe_tp_size": 2, "lmhead_tp_size": 2}
    assert found.settings()["world_size"] == 1                          # the single-card YAML is kept
    (recipe / "runner_ours.py").write_text("class Runner: pass\n")    # not on this engine: someone else's
    assert Recipe.at(recipe).kind == "legacy"


def test_classify_never_runs_anything_inside_a_checkpoint(tmp_path):
    from agent.workflow.nodes import node_classify

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "llama"}')
    (ckpt / "model.safetensors").write_bytes(b"\0" * 8)
    (ckpt / "infer.sh").write_text(f"touch {tmp_path / 'ran'}\n")
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    result = node_classify({"target": str(ckpt)}, {})
    assert result["scenario"] == "A" and "checkpoint" in result["classify_reason"]
    assert not (tmp_path / "ran").exists()
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before


# ---- the first real error -------------------------------------------------------------------
def _tb(*frames, error):
    body = "".join(f'  File "{f}", line {n}, in fn\n    code()\n' for f, n in frames)
    return f"Traceback (most recent call last):\n{body}{error}\n"


def test_first_real_error_and_its_innermost_recipe_frame(tmp_path):
    recipe = tmp_path / "repo" / "models" / "m"
    recipe.mkdir(parents=True)
    repo = tmp_path / "repo"
    torch_init = "/venv/lib/python3.11/site-packages/torch/__init__.py"
    first = _tb((str(recipe / "infer.py"), 40), (str(recipe / "runner_m.py"), 12), (torch_init, 2963),
                error="ModuleNotFoundError: No module named 'torch_npu'")
    later = _tb((str(repo / "executor/model_runner.py"), 7), error="RuntimeError: rank 1 gave up")
    output = "launch ...\n" + first + "\nwait\n" + later + "BaselineError: synthesized by a tool\n"
    got = summarise_failure(output, roots=[recipe, repo])
    assert got == {"error": "ModuleNotFoundError: No module named 'torch_npu'",
                   "location": f"{recipe / 'runner_m.py'}:12", "traceback": True}
    # no frame in the recipe: the repository's shared code, never library internals
    shared = _tb((str(repo / "executor/offline/infer.py"), 88), (torch_init, 2963), error="OSError: no weights")
    assert summarise_failure(shared, roots=[recipe, repo])["location"] == f"{repo / 'executor/offline/infer.py'}:88"
    assert summarise_failure(_tb((torch_init, 1), error="E: x"), roots=[recipe])["location"] is None


def test_warm_up_rule_fires_only_on_its_own_evidence(tmp_path):
    recipe = tmp_path / "r"
    recipe.mkdir()
    (recipe / "infer.py").write_text("runner.model_generate(prompts)\n")
    crash = _tb((str(recipe / "infer.py"), 1), error="ModuleNotFoundError: No module named 'torch_npu'")
    matched = first_matching_rule(Failure.from_output(recipe, crash))
    assert matched is None or matched[0].name != "infer_py_without_warm_up"
    conclusion = "ok\nBaselineError: infer.py ran without a warm-up generation (1 prefill in log_0.log)\n"
    assert first_matching_rule(Failure.from_output(recipe, conclusion))[0].name == "infer_py_without_warm_up"


# ---- the verdict of a run, from evidence --------------------------------------------------------
LEGACY = "2026-06-12 10:21:{s:02d},000 - INFO - [LLM](model_runner.py:287): m inference time cost of {stage} is {ms} ms"


def _legacy_call(start):
    lines = [LEGACY.format(s=start, stage="prefill", ms=100)]
    lines += [LEGACY.format(s=start + 1 + i, stage="decode", ms=10 + i) for i in range(3)]
    lines.append("2026-06-12 10:21:59,000 - INFO - [LLM](model_runner.py:351): m average inference time cost is 11 ms")
    lines.append("2026-06-12 10:21:59,001 - INFO - [LLM](model_runner.py:362): Inference decode result for batch 0: ")
    lines.append("Hello there")
    return lines


@pytest.mark.parametrize("case, logs, infer_py, problem, no_warm_up", [
    ("warm-up + formal", {"log_0.log": _legacy_call(0) + _legacy_call(10)}, "", None, False),
    ("silent warm-up in infer.py", {"log_0.log": _legacy_call(0)},
     "r.model_generate(p, warm_up=True)\nr.model_generate(p)\n", None, False),
    ("no warm-up at all", {"log_0.log": _legacy_call(0)}, "r.model_generate(p)\n", None, True),
    ("python crashed, launch exited 0", {"log_0.log": ["loading", *_tb(("/x/infer.py", 3), error="OSError: bad").splitlines()]},
     "", "traceback in log_0.log", False),
    ("no prefill line", {"log_0.log": ["model run success"]}, "", "no formal prefill line in log_0.log", False),
    ("rank 1 did not finish", {"log_0.log": _legacy_call(0) + _legacy_call(10), "log_1.log": _legacy_call(0)[:3]},
     "", "rank 1 did not finish its formal run", False),
])
def test_judge_run(tmp_path, case, logs, infer_py, problem, no_warm_up):
    from agent.run.trial_run import judge_run

    for name, lines in logs.items():
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    (tmp_path / "infer.py").write_text(infer_py)
    verdict = judge_run("", tmp_path, tmp_path, log_style="runner")
    assert (verdict.problem, verdict.no_warm_up) == (problem, no_warm_up), case


def test_framework_log_needs_no_warm_up_line(tmp_path):
    from agent.run.trial_run import Verdict, judge_run

    fw = ["[INFO][2026-06-12 10:21:08.125][scheduler.py:412] [Main] Inference time (prefill): 52.31 ms",
          "[INFO][2026-06-12 10:21:08.136][scheduler.py:412] [Main] Inference time (decode): 10.00 ms",
          "[INFO][2026-06-12 10:21:08.137][infer.py:93] Request 0: outputs: Hi", ""]
    (tmp_path / "log_0.log").write_text("\n".join(fw))
    assert judge_run("", tmp_path, tmp_path, log_style="executor") == Verdict(None, [], False, 1)


# ---- byte-preserving edits ----------------------------------------------------------------------
@pytest.mark.parametrize("original, edited, expected", [
    (b"a\r\nb\r\n", b"a\nX\nb\n", b"a\r\nX\r\nb\r\n"),                          # CRLF kept, new line CRLF
    (b"\xef\xbb\xbfa\r\n", b"\xef\xbb\xbfa\nb\n", b"\xef\xbb\xbfa\r\nb\r\n"),     # BOM kept
    (b"a\nb\r\nc\n", b"a\nb\nc\nd\n", b"a\nb\r\nc\nd\n"),                         # mixed: each line keeps its own
    (b"a\r\nb", b"a\nb\nc", b"a\r\nb\r\nc"),                                       # no final newline stays so
    ("# 中文\r\nx = 1\r\n".encode("gb18030"), "# 中文\nx = 2\n".encode("utf-8"),
     "# 中文\r\nx = 2\r\n".encode("gb18030")),                                     # encoding kept
    (b"a\n", b"a\nb\n", b"a\nb\n"),
])
def test_restore_format(original, edited, expected):
    assert restore_format(original, edited) == expected


def test_warm_up_repair_keeps_crlf_mode_and_records_the_true_diff(tmp_path):
    from agent.repair.diagnose import diagnose
    from agent.repair.fix import repair

    recipe = tmp_path / "r"
    recipe.mkdir()
    lines = [f"# line {i}" for i in range(100)] + ["runner.model_generate(prompts)", "print('done')"]
    infer_py = recipe / "infer.py"
    infer_py.write_bytes(("\r\n".join(lines) + "\r\n").encode())
    infer_py.chmod(0o750)
    original = infer_py.read_bytes()
    out = tmp_path / "output.txt"
    out.write_text("ok\nBaselineError: infer.py ran without a warm-up generation (1 prefill in log_0.log)\n")
    diagnosis = diagnose(recipe, {"output_file": str(out)})
    assert diagnosis["rule"] == "infer_py_without_warm_up"
    result = repair(recipe, diagnosis, round_no=1)
    new = infer_py.read_bytes()
    assert new == original.replace(b"runner.model_generate(prompts)\r\n",
                                   b"runner.model_generate(prompts, warm_up=True)\r\nrunner.model_generate(prompts)\r\n")
    assert infer_py.stat().st_mode & 0o777 == 0o750
    added = [ln for ln in result["diff"].splitlines(True) if ln.startswith("+") and not ln.startswith("+++")]
    removed = [ln for ln in result["diff"].splitlines(True) if ln.startswith("-") and not ln.startswith("---")]
    assert added == ["+runner.model_generate(prompts, warm_up=True)\r\n"] and removed == []
    assert detect_format(new)["newline"] == "\r\n"


# ---- report ------------------------------------------------------------------------------------
def test_report_writes_no_readme_block_without_a_baseline(tmp_path):
    from agent.workflow.report import write_report

    recipe = tmp_path / "their_model"
    recipe.mkdir()
    readme = recipe / "README.md"
    readme.write_bytes(b"# Theirs\r\n")
    write_report({"recipe_dir": str(recipe), "scenario": "B", "status": "failed", "message": "x"})
    assert readme.read_bytes() == b"# Theirs\r\n"
    assert (recipe / "migration_summary.md").read_text().startswith("# Migration summary: their_model\n")
    baseline = recipe / "baseline" / "baseline_metadata.json"
    baseline.parent.mkdir()
    baseline.write_text(json.dumps({"performance": {"prefill_ms": 1, "decode_avg_ms": 2}}))
    write_report({"recipe_dir": str(recipe), "scenario": "C", "status": "ok", "baseline_path": str(baseline)})
    assert "Migration status" in readme.read_text()


@pytest.mark.parametrize("marker, error", [
    ("The above exception was the direct cause of the following exception:", "OSError: Incorrect path"),
    ("During handling of the above exception, another exception occurred:", "huggingface_hub.HFValidationError: bad id"),
])
def test_a_chained_error_is_one_error_with_the_chain_s_recipe_frame(tmp_path, marker, error):
    repo = tmp_path / "repo"
    lib = "/venv/lib/python3.11/site-packages"
    inner = _tb((f"{lib}/huggingface_hub/v.py", 10), error="huggingface_hub.HFValidationError: bad id")
    outer = _tb((str(repo / "executor/offline/infer.py"), 70), (f"{lib}/transformers/a.py", 5),
                error="OSError: Incorrect path")
    rank1 = _tb((str(repo / "executor/x.py"), 1), error="RuntimeError: rank 1 saw rank 0 die")
    got = summarise_failure(f"{inner}\n{marker}\n\n{outer}\nrank 1:\n{rank1}", roots=[repo])
    assert got["error"] == error and got["location"] == f"{repo / 'executor/offline/infer.py'}:70"


def test_yaml_line_edit_keeps_crlf_gbk_comments_and_mode(tmp_path):
    from agent.recipe.recipe import read_settings
    from agent.repair.rules._util import edit_yaml_line

    recipe = tmp_path / "r"
    (recipe / "config").mkdir(parents=True)
    path = recipe / "config" / "m.yaml"
    text = "model_name: m  # 模型\r\nexe_mode: eager\r\ndata_config:\r\n  batch_size: 1\r\n"
    path.write_bytes(text.encode("gb18030"))
    path.chmod(0o640)
    assert read_settings(path)["data_config"] == {"batch_size": 1}
    edit_yaml_line(path, "data_config", "batch_size", 4, root=recipe)
    edit_yaml_line(path, "data_config", "max_new_tokens", 8, root=recipe)
    assert path.read_bytes() == (text.replace("batch_size: 1", "batch_size: 4") + "  max_new_tokens: 8\r\n").encode("gb18030")
    assert path.stat().st_mode & 0o777 == 0o640
