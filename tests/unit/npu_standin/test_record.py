"""Records made under the stand-in say so: usage records read back from logs and record folders, the
baseline's environment and standin block, the migration report, `migrator env`."""

from __future__ import annotations

import json

from migrator_cli import run_cli
from npu_standin import read_op_usage
from npu_standin.record import ACTIVE_PREFIX, USAGE_PREFIX


def _usage_line(pid, rank, ops):
    return USAGE_PREFIX + json.dumps({"pid": pid, "rank": rank, "device": "cpu", "argv": [], "ops": ops,
                                      "runtime": {}, "notes": {}, "compiles": {}, "unsupported": []})


def test_read_op_usage_merges_ranks_once_from_logs_and_record_files(tmp_path):
    logs = tmp_path / "res"
    logs.mkdir()
    for rank, pid in ((0, 11), (1, 12)):
        (logs / f"log_{rank}.log").write_text(
            f"{ACTIVE_PREFIX} npu -> cpu in pid {pid} (rank {rank}); ...\nRequest 0: outputs: x\n"
            + _usage_line(pid, rank, {"npu_rms_norm": 3, "npu_swiglu": 1}) + "\n")
    # the same process's JSON record, next to the logs: counted once
    (logs / "standin-11.json").write_text(_usage_line(11, 0, {"npu_rms_norm": 3, "npu_swiglu": 1})[len(USAGE_PREFIX):])
    usage = read_op_usage(logs)
    assert usage["processes"] == 2 and usage["ranks"] == [0, 1] and usage["device"] == "cpu"
    assert usage["ops"] == {"npu_rms_norm": 6, "npu_swiglu": 2}
    assert read_op_usage(logs / "log_1.log")["ops"] == {"npu_rms_norm": 3, "npu_swiglu": 1}
    (tmp_path / "plain.log").write_text("an ordinary log\n")
    assert read_op_usage(tmp_path / "plain.log") is None


def test_report_of_a_standin_baseline_says_it_was_no_npu_run(tmp_path):
    from agent.workflow.report import write_report

    recipe = tmp_path / "recipe"
    (recipe / "baseline").mkdir(parents=True)
    baseline = {"environment": {"device": "cpu (npu stand-in)", "npu_model": None},
                "performance": {"prefill_ms": 10.0, "decode_avg_ms": 5.0, "output_text": "x"},
                "standin": {"device": "cpu", "reference_kernels": {"npu_rms_norm": 4}}}
    path = recipe / "baseline" / "baseline_metadata.json"
    path.write_text(json.dumps(baseline))
    write_report({"recipe_dir": str(recipe), "status": "ok", "scenario": "C", "baseline_path": str(path),
                  "env": {"device": "cpu", "npu_model": "Ascend910B3"}})
    report = json.loads((recipe / "migration_report.json").read_text())
    assert report["env"]["device"] == "cpu (npu stand-in)" and report["env"]["npu_model"] is None
    assert report["standin"]["reference_kernels"] == {"npu_rms_norm": 4}
    summary = (recipe / "migration_summary.md").read_text()
    assert "npu stand-in: a validation run, not an NPU run" in summary and "npu_rms_norm x4" in summary


def test_migrator_env_says_whether_a_standin_run_is_possible():
    proc = run_cli("env", "--json")
    assert proc.returncode == 0, proc.stderr
    env = json.loads(proc.stdout)
    assert env["npu_standin"]["possible"] is True and "cpu" in env["npu_standin"]["devices"]
    assert env["device"] in ("cpu", "cuda")            # outside the stand-in: the real device


def test_the_standins_records_load_our_engine_files_wherever_its_process_runs(tmp_path):
    """In a process whose `engine` is not infer-migrator's (a standalone recipe's copy, here one that cannot even
    import; or none, a checkout's launcher venv) the stand-in's record and environment modules still load and use
    this project's safe_load / safe_write; where `engine` is ours, they use it (one LoadError class for the CLI)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import npu_standin

    home = Path(npu_standin.__file__).parent
    probe = ("import importlib.util, sys\n"
             f"spec = importlib.util.spec_from_file_location('npu_standin', {str(home / '__init__.py')!r}, "
             f"submodule_search_locations=[{str(home)!r}])\n"
             "m = importlib.util.module_from_spec(spec); sys.modules['npu_standin'] = m; spec.loader.exec_module(m)\n"
             "from npu_standin import environment, record\n"
             "print(record.run_folder_tree.__module__, record.load_json.__module__, environment.loads_json.__module__)\n")
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text("raise ImportError('a recipe of its own')\n")
    # `python -c` puts its working directory first on sys.path: that `engine` shadows ours
    foreign = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert foreign.returncode == 0, foreign.stderr
    assert foreign.stdout.split() == ["_npu_standin_engine_safe_write", "_npu_standin_engine_safe_load",
                                      "_npu_standin_engine_safe_load"], foreign.stdout
    from npu_standin import record

    assert (record.run_folder_tree.__module__, record.load_json.__module__) == ("engine.safe_write", "engine.safe_load")
