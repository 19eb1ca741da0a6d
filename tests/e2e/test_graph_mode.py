"""exe_mode graph: compiled decode step on a static cache, same greedy tokens as eager."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import yaml

from locations import REPO_ROOT

# Runs in the recipe dir: the recipe's Runner in eager and in graph mode, warm-up then formal run
# (as infer.py), on a batch of two prompts of different lengths (left padding). Graph mode
# compiles with a backend that counts the graphs dynamo hands it and runs them as traced, so
# tracing, guards and recompilations are the real thing without inductor's minutes of codegen.
PROBE = textwrap.dedent("""
    import functools, importlib, json, sys, torch
    from pathlib import Path
    from engine.config import load_runner_settings
    from engine.data import DEFAULT_PROMPT
    from models.model_setting import check_vars, update_vars
    from transformers.cache_utils import StaticCache

    graphs, argmax_in_graph = [], []
    def counting_backend(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        argmax_in_graph.append(any("argmax" in str(node.target) for node in gm.graph.nodes))
        return gm.forward
    torch.compile = functools.partial(torch.compile, backend=counting_backend)

    prompts = [DEFAULT_PROMPT, "Multi-head attention allows the model"]
    module = importlib.import_module("runner_" + sys.argv[1])
    recipe_runner = next(v for k, v in vars(module).items() if k.endswith("Runner") and k != "ModelRunner")

    # Overrides a step hook: graph mode keeps the compiled forward and runs the hooks around it.
    class OwnHooksRunner(recipe_runner):
        def model_output_process(self, model_inputs, outputs, batch):
            super().model_output_process(model_inputs, outputs, batch)

    result = {}
    for mode in ("eager", "graph", "graph_own_hooks"):
        graphs.clear(); argmax_in_graph.clear()
        settings = load_runner_settings(next(Path("config").glob("*.yaml")))
        settings["exe_mode"] = mode.removesuffix("_own_hooks")
        settings["data_config"]["batch_size"] = 2
        check_vars(settings); update_vars(settings)
        cls = OwnHooksRunner if mode.endswith("own_hooks") else recipe_runner
        runner = cls(settings)
        runner.init_model()
        runner.model_generate(prompts, warm_up=True)
        warm_ids, warm_graphs = runner.last_generate_ids.tolist(), len(graphs)
        runner.model_generate(prompts)
        formal_ids = runner.last_generate_ids.tolist()
        # A shorter generation in the same cache (the bench's prefill-only runs do this) reuses the graph.
        runner.max_new_tokens -= 3
        runner.model_generate(prompts)
        shorter_ids = runner.last_generate_ids.tolist()
        runner.max_new_tokens += 3
        result[mode] = {"warm_up": warm_ids, "formal": formal_ids, "shorter": shorter_ids,
                        "graphs_after_warm_up": warm_graphs, "graphs_after_formal": len(graphs),
                        "static_cache": runner.graph is not None and isinstance(runner.graph.cache, StaticCache),
                        "compiled": runner.graph is not None,
                        "whole_step_compiled": runner.graph is not None and runner.graph.step is not None,
                        "argmax_in_graph": any(argmax_in_graph)}
    print(json.dumps(result))
""")


@pytest.fixture(scope="module")
def recipe(tiny_checkpoints, tmp_path_factory) -> Path:
    """A tiny llama recipe rendered by the migrator's own graph, stopped before the trial run (the tests run it)."""
    from agent.workflow.run import run_migration

    state = {"target": str(tiny_checkpoints("llama")), "output_dir": str(tmp_path_factory.mktemp("graph")),
             "name": "tiny_graph", "device": "cpu", "max_new_tokens": 12}
    return Path(run_migration(state, stop_after="render")["recipe_dir"])


def test_graph_decode_matches_eager_and_compiles_only_in_warm_up(recipe, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(recipe), str(REPO_ROOT)]), "RES_PATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", PROBE, "tiny_graph"], cwd=recipe, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    eager, graph, own_hooks = result["eager"], result["graph"], result["graph_own_hooks"]

    assert not eager["compiled"] and not eager["static_cache"] and not eager["whole_step_compiled"]
    assert graph["compiled"] and graph["static_cache"]
    # Base hooks: the whole step (argmax included) is the compiled graph. Own hooks: the forward only.
    assert graph["whole_step_compiled"] and graph["argmax_in_graph"]
    assert own_hooks["compiled"] and not own_hooks["whole_step_compiled"] and not own_hooks["argmax_in_graph"]
    # Greedy tokens identical, padded row included, in both generations, on both graph paths.
    for compiled in (graph, own_hooks):
        assert compiled["warm_up"] == eager["warm_up"]
        assert compiled["formal"] == eager["formal"] == eager["warm_up"]
        # The decode step is compiled once, in the warm-up run; the formal run reuses it.
        assert compiled["graphs_after_warm_up"] == 1
        assert compiled["graphs_after_formal"] == compiled["graphs_after_warm_up"]
        assert compiled["shorter"] == eager["shorter"]
        assert all(full[:len(short)] == short for full, short in zip(eager["formal"], eager["shorter"]))
    assert len(eager["formal"][0]) > 1


def test_graph_mode_on_npu_without_torchair_falls_back_to_eager(monkeypatch):
    from engine import graph_mode

    monkeypatch.setitem(sys.modules, "torchair", None)  # import torchair -> ImportError
    warnings = []
    logger = types.SimpleNamespace(warning=warnings.append, info=lambda msg: None)
    assert graph_mode.compile_options(types.SimpleNamespace(type="npu"), logger, "m") is None
    assert warnings and "torchair" in warnings[0] and "eager" in warnings[0]
    # init_model then runs eager: no compiled step, no static cache.
    assert graph_mode.compile_options(types.SimpleNamespace(type="cpu"), logger, "m") == {"dynamic": False}


def _run_infer_sh(recipe: Path, res: Path, exe_mode: str) -> str:
    """Set exe_mode, run `bash infer.sh`, collect the baseline; returns the formal output text."""
    yaml_file = next((recipe / "config").glob("*.yaml"))
    settings = yaml.safe_load(yaml_file.read_text())
    settings["exe_mode"] = exe_mode
    yaml_file.write_text(yaml.safe_dump(settings, sort_keys=False))
    env = {**os.environ, "PYTHON": sys.executable, "RES_PATH": str(res)}
    proc = subprocess.run(["bash", "infer.sh"], cwd=recipe, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = res / "baseline.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "collect_baseline.py"), "--log-file", str(res),
                           "--output", str(out), "--yaml-file", str(yaml_file)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    baseline = json.loads(out.read_text())
    assert baseline["environment"]["exe_mode"] == exe_mode
    assert baseline["performance"]["decode_avg_ms"] is not None
    return baseline["performance"]["output_text"]


@pytest.mark.slow  # the graph decode test covers compile and parity by default
def test_infer_sh_in_graph_mode_matches_eager(recipe, tmp_path):
    """The real thing: `bash infer.sh` with exe_mode graph (inductor): ~45 s on 2 cores with a cold
    inductor cache, ~20 s warm."""
    eager_text = _run_infer_sh(recipe, tmp_path / "eager", "eager")
    graph_text = _run_infer_sh(recipe, tmp_path / "graph", "graph")
    assert graph_text == eager_text

    log = (tmp_path / "graph" / "log_0.log").read_text()
    assert "decode step compiled with torch.compile" in log
    warm_up, formal = log.split("warm-up run ends")
    decode = re.compile(r"inference time cost of decode is ([\d.]+) ms")
    warm_ms = [float(ms) for ms in decode.findall(warm_up)]
    formal_ms = [float(ms) for ms in decode.findall(formal)]
    # Compilation happens in the warm-up's first decode step, never in the formal run.
    assert warm_ms[0] > 10 * max(formal_ms)
