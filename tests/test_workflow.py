"""The LangGraph workflow: structure, routing functions, classify, env, resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from locations import REPO_ROOT
from migrator_cli import run_cli


# ---- graph structure and routing functions (no model needed) ------------------------------
def test_graph_has_the_nodes_and_edges_of_the_spec():
    from agent.workflow.graph import build_graph

    graph = build_graph().compile().get_graph()
    edges = {(e.source, e.target) for e in graph.edges}
    for edge in [("__start__", "detect_env"), ("detect_env", "classify"), ("classify", "acquire"),
                 ("classify", "diagnose"), ("classify", "collect_baseline"), ("acquire", "vendor"),
                 ("vendor", "render"), ("render", "trial_run"), ("trial_run", "collect_baseline"),
                 ("trial_run", "diagnose"), ("diagnose", "repair"), ("diagnose", "estimate_memory"),
                 ("repair", "trial_run"), ("collect_baseline", "verify"), ("verify", "report"),
                 ("estimate_memory", "report"), ("report", "__end__")]:
        assert edge in edges, edge


def test_every_node_lives_in_agent_nodes_and_is_added_as_is():
    from agent.workflow import nodes
    from agent.workflow.graph import NODES, build_graph

    assert all(getattr(nodes, fn.__name__) is fn for fn in NODES.values())
    assert set(build_graph().nodes) == set(NODES)
    wrapped = build_graph(wrap=lambda name, fn: (lambda state: {"message": name}))
    assert all(spec.runnable.invoke({}) == {"message": name} for name, spec in wrapped.nodes.items())


def test_runs_and_rounds_are_reduced_from_the_new_items_nodes_return():
    """Nodes return only new items: runs are appended, a round's repair completes its diagnosis."""
    from langgraph.graph import END, START, StateGraph

    from agent.workflow.state import MigrationState

    graph = StateGraph(MigrationState)
    graph.add_node("run", lambda state: {"runs": [{"label": f"trial{len(state['runs'])}"}]})
    graph.add_node("diagnose", lambda state: {"rounds": [{"round": len(state["rounds"]) + 1, "diagnosis": "d"}]})
    graph.add_node("repair", lambda state: {"rounds": [dict(state["rounds"][-1], applied=True)]})
    for source, target in [(START, "run"), ("diagnose", "repair"), ("repair", "run")]:
        graph.add_edge(source, target)
    graph.add_conditional_edges("run", lambda state: END if len(state["runs"]) == 3 else "diagnose")
    final = graph.compile().invoke({"target": "t"})
    assert [r["label"] for r in final["runs"]] == ["trial0", "trial1", "trial2"]
    assert final["rounds"] == [{"round": 1, "diagnosis": "d", "applied": True},
                               {"round": 2, "diagnosis": "d", "applied": True}]


def _state_with_run(tmp_path, ok, output=""):
    out = tmp_path / "output.txt"
    out.write_text(output)
    return {"runs": [{"ok": ok, "output_file": str(out)}]}


def test_after_trial_run_routes_success_failure_and_oom(tmp_path):
    from agent.workflow.graph import after_diagnose, after_trial_run
    from agent.repair.diagnose import diagnose

    assert after_trial_run(_state_with_run(tmp_path, True)) == "collect_baseline"
    assert after_trial_run(_state_with_run(tmp_path, False, "ValueError: bad")) == "diagnose"
    # Out of memory is a rule: the failed run goes to diagnose, its diagnosis to the memory estimate.
    oom = "RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"
    for output in (oom, "torch.OutOfMemoryError: CUDA out of memory."):
        state = _state_with_run(tmp_path, False, output)
        assert after_trial_run(state) == "diagnose"
        diagnosis = diagnose(tmp_path, state["runs"][-1])
        assert diagnosis["rule"] == "out_of_memory" and diagnosis["oom"]
        assert after_diagnose({"rounds": [{"diagnosis": diagnosis}]}, {"configurable": {"max_rounds": 0}}) == "estimate_memory"
    bad = diagnose(tmp_path, _state_with_run(tmp_path, False, "ValueError: bad")["runs"][-1])
    assert not bad["oom"] and after_diagnose({"rounds": [{"diagnosis": bad}]}, {"configurable": {"max_rounds": 5}}) == "give_up"


def _round(signature, rule="some_rule"):
    return {"diagnosis": {"signature": signature, "rule": rule, "diagnosis": signature}}


def test_after_diagnose_counts_rounds_and_stops_on_repeats():
    from agent.workflow.graph import after_diagnose

    assert after_diagnose({"rounds": [_round("a")]}, {"configurable": {"max_rounds": 5}}) == "repair"
    assert after_diagnose({"rounds": [_round("a"), _round("b")]}, {"configurable": {"max_rounds": 5}}) == "repair"
    assert after_diagnose({"rounds": [_round("a"), _round("a")]}, {"configurable": {"max_rounds": 5}}) == "give_up"
    # the same failure, now taken by another rule (the first fix removed what it matched): that rule runs
    assert after_diagnose({"rounds": [_round("a", "r1"), _round("a", "r2")]}, {"configurable": {"max_rounds": 5}}) == "repair"
    assert after_diagnose({"rounds": [_round("a", "r1"), _round("a", "r2"), _round("a", "r1")]},
                          {"configurable": {"max_rounds": 5}}) == "give_up"
    assert after_diagnose({"rounds": [_round(str(i)) for i in range(6)]}, {"configurable": {"max_rounds": 5}}) == "give_up"
    assert after_diagnose({"rounds": [_round("x", rule=None)]}, {"configurable": {"max_rounds": 5}}) == "give_up"


def test_classify_node_alone_gives_a_for_a_checkpoint(tiny_checkpoints):
    from agent.workflow.nodes import node_classify

    result = node_classify({"target": str(tiny_checkpoints("llama"))}, {})
    assert result["scenario"] == "A" and "no infer.sh" in result["classify_reason"]


# ---- CLI: env ----------------------------------------------------------------------------
def test_env_json_reports_the_cpu_actually_used():
    proc = run_cli("env", "--json")
    assert proc.returncode == 0, proc.stderr
    env = json.loads(proc.stdout)
    assert env["device"] == "cpu" and env["pytorch_version"].startswith("2.")
    assert env["npu_model"] is None and env["num_cards"] == 0


def test_env_device_npu_without_npu_is_a_one_line_environment_error():
    proc = run_cli("env", "--device", "npu")
    assert proc.returncode == 4
    assert len(proc.stderr.strip().splitlines()) == 1 and "npu" in proc.stderr and "Traceback" not in proc.stderr


def test_run_device_npu_without_npu_stops_before_any_work(tiny_checkpoints, tmp_path):
    proc = run_cli("run", str(tiny_checkpoints("llama")), "--output-dir", str(tmp_path), "--device", "npu")
    assert proc.returncode == 4 and "Traceback" not in proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("migrator: error:")]
    assert not any(p.is_dir() and p.name != ".migrator" for p in tmp_path.iterdir())


# ---- CLI: classify and scenarios B/C on a real recipe ------------------------------------
@pytest.fixture(scope="module")
def recipe(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("wf")
    proc = run_cli("run", str(tiny_checkpoints("qwen2")), "--name", "wf", "--output-dir", str(out),
                   "--device", "cpu", "--max-new-tokens", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "wf"


@pytest.mark.slow  # scenarios B and C have their own default cases below; this one runs all three in a row
def test_classify_a_b_c(tiny_checkpoints, recipe, tmp_path):
    proc = run_cli("classify", str(tiny_checkpoints("llama")))
    assert proc.returncode == 0 and proc.stdout.startswith("A:")
    proc = run_cli("classify", str(recipe))
    assert proc.returncode == 0 and proc.stdout.startswith("C:"), proc.stdout + proc.stderr
    broken = tmp_path / "broken"
    shutil.copytree(recipe, broken)
    (broken / "infer.py").write_text((broken / "infer.py").read_text().replace("def main():", "def main(:"))
    proc = run_cli("classify", str(broken))
    assert proc.returncode == 0 and proc.stdout.startswith("B:") and "SyntaxError" in proc.stdout
    proc = run_cli("classify", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_scenario_c_recollects_baseline_and_keeps_the_previous_one(recipe, tmp_path):
    copy = tmp_path / "c"
    shutil.copytree(recipe, copy)
    before = json.loads((copy / "baseline" / "baseline_metadata.json").read_text())
    proc = run_cli("run", str(copy), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    assert summary["scenario"] == "C" and summary["status"] == "ok"
    kept = list((copy / "baseline").glob("baseline_metadata.previous*.json"))
    assert [p.name for p in kept] == ["baseline_metadata.previous.json"] and json.loads(kept[0].read_text()) == before
    after = json.loads((copy / "baseline" / "baseline_metadata.json").read_text())
    assert after["performance"]["prefill_ms"] is not None and after["verification"]["parity"]["ok"]


def test_scenario_b_unknown_failure_is_reported_with_file_and_line(recipe, tmp_path):
    broken = tmp_path / "b"
    shutil.copytree(recipe, broken)
    runner = broken / "runner_wf.py"
    runner.write_text(runner.read_text() + "\n    def model_input_prepare(self, batch):\n"
                                           "        raise KeyError('mystery')\n")
    proc = run_cli("run", str(broken), "--json")
    assert proc.returncode == 1
    summary = json.loads(proc.stdout)
    assert summary["scenario"] == "B" and summary["status"] == "failed"
    assert "KeyError" in summary["message"] and "runner_wf.py:" in summary["message"]
    report = json.loads((broken / "migration_report.json").read_text())
    assert report["rounds"][0]["diagnosis"]["location"].endswith(tuple(f"runner_wf.py:{n}" for n in range(1, 200)))


@pytest.mark.slow  # resume after a kill is covered by default by tests/test_field_processes.py (killed after render, then --resume)
# ---- resume ------------------------------------------------------------------------------
def test_killed_run_resumes_to_the_same_recipe(tiny_checkpoints, tmp_path):
    ckpt = tiny_checkpoints("llama")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "agent.cli", "run", str(ckpt), "--name", "r", "--output-dir", str(out),
           "--device", "cpu", "--max-new-tokens", "8"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    for line in proc.stderr:           # kill it as soon as the trial run starts
        if "trial_run ..." in line:
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    recipe = out / "r"
    assert (recipe / "infer.sh").is_file() and not (recipe / "baseline").exists()

    resumed = subprocess.run(cmd + ["--resume", "--json"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming at trial_run" in resumed.stderr
    assert "vendor ..." not in resumed.stderr          # finished nodes are not redone
    assert json.loads(resumed.stdout)["status"] == "ok"
    assert (recipe / "baseline" / "baseline_metadata.json").is_file()

    fresh = run_cli("run", str(ckpt), "--name", "r", "--output-dir", str(tmp_path / "fresh"), "--device", "cpu",
                    "--max-new-tokens", "8")
    assert fresh.returncode == 0
    for rel in ["infer.py", "infer.sh", "runner_r.py", "models/modeling_r.py", "config/r_1card_eager.yaml"]:
        assert (recipe / rel).read_bytes() == (tmp_path / "fresh" / "r" / rel).read_bytes(), rel


def test_after_repair_reruns_only_when_something_changed():
    from agent.workflow.graph import after_repair

    assert after_repair({"rounds": [{"applied": True}]}) == "trial_run"
    assert after_repair({"rounds": [{"applied": False, "note": "pip install einops"}]}) == "give_up"


# ---- the input step ----------------------------------------------------------------------
def test_the_input_step_gives_the_state_and_the_run_options_apart(tiny_checkpoints, tmp_path):
    """`migrator run` is checked once into the state the graph runs on; the run options go to the
    graph's config (agent.workflow.state.RunOptions), never into the stored state."""
    from agent.cli import _parser
    from agent.workflow import inputs
    from agent.workflow.state import OPTION_KEYS, MigrationState, run_options

    checkpoint = tiny_checkpoints("llama")
    args = _parser().parse_args(["run", str(checkpoint), "--output-dir", str(tmp_path / "out"), "--max-rounds", "2",
                                 "--timeout", "30", "--device", "cpu"])
    state, options = inputs.validate_run(args)
    assert options == {"max_rounds": 2, "timeout_s": 30, "device": "cpu"}
    assert not set(OPTION_KEYS) & set(state) and not set(OPTION_KEYS) & set(MigrationState.__annotations__)
    assert state["target"] == str(checkpoint.resolve()) and state["recipe_target"] == "standalone"
    assert (tmp_path / "out").is_dir()                       # the output dir was checked by making it
    assert run_options({"configurable": options}) == options
    from engine import defaults

    assert run_options(None) == {"max_rounds": defaults.MAX_ROUNDS, "timeout_s": None, "device": "auto"}


def test_the_input_step_refuses_a_target_kind_the_output_dir_cannot_hold(tiny_checkpoints, tmp_path):
    from agent import errors
    from agent.cli import _parser
    from agent.workflow import inputs

    args = _parser().parse_args(["run", str(tiny_checkpoints("llama")), "--output-dir", str(tmp_path / "out"),
                                 "--target", "framework"])
    with pytest.raises(errors.InputError, match="--target framework needs --output-dir inside a cann-recipes-infer"):
        inputs.validate_run(args)
