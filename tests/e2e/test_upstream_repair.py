"""Repair rules for cann-recipes-infer's own recipes as people break them (common_issues.md), with the
faults injected into a copy of the snapshot: the rule matches the real failure, its fix changes one
line and keeps every other byte, the original is backed up, `migrator rollback` restores it.

In-process cases use the failure the recipe's own code raises (a real subprocess or upstream's own
function); `slow` ones run the broken copy through `migrator run --standin --tiny` and its repair round."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.recipe.recipe import report_path
from agent.recipe.backup import rollback
from agent.repair.diagnose import diagnose
from agent.repair.failure import Failure
from agent.repair.fix import repair
from agent.testing.tiny_checkpoint import build_tiny_checkpoint
from migrator_cli import run_cli
from upstream_checkout import FAST, copy_snapshot


@pytest.fixture
def checkout(tmp_path):
    return copy_snapshot(tmp_path / "cann-recipes-infer")


def drop_set_env_pythonpath(checkout: Path) -> None:
    """The injection: a checkout whose set_env.sh does not export PYTHONPATH (an older one, or a
    user's own), so a legacy recipe's infer.sh has nothing putting the checkout on it."""
    set_env = checkout / "executor" / "scripts" / "set_env.sh"
    lines = set_env.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not line.startswith("export PYTHONPATH=")]
    assert len(kept) == len(lines) - 1
    set_env.write_text("".join(kept))


def repaired_in_one_round(checkout, model: str, rule: str, *args: str) -> tuple[dict, dict]:
    """`migrator run models/MODEL --standin --tiny --max-rounds 1`: the one round took `rule` and the run after
    it ended ok. Returns (report, summary)."""
    proc = run_cli("run", str(checkout / "models" / model), "--standin", "--tiny", *args, "--max-rounds", "1",
                   "--json", env=FAST, timeout=2400)
    report = json.loads(report_path(checkout / "models" / model).read_text())
    assert [r["diagnosis"]["rule"] for r in report["rounds"]] == [rule], (proc.stdout + proc.stderr)[-3000:]
    summary = json.loads(proc.stdout)
    assert proc.returncode == 0 and summary["status"] == "ok", (proc.stdout + proc.stderr)[-3000:]
    return report, summary


def test_legacy_infer_sh_gets_the_checkout_on_pythonpath(checkout):
    drop_set_env_pythonpath(checkout)
    recipe = checkout / "models" / "pangu_7b"
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "infer.py"], cwd=recipe, capture_output=True, text=True, env=env,
                          timeout=300)
    assert "No module named 'executor'" in proc.stderr      # the recipe's own import, as a run shows it
    failure = Failure.from_output(recipe, proc.stderr)
    diagnosis = diagnose(recipe, {}, failure=failure)
    assert diagnosis["rule"] == "checkout_not_on_pythonpath", diagnosis
    before = (recipe / "infer.sh").read_bytes()
    done = repair(recipe, diagnosis, round_no=1, failure=failure)
    assert done["applied"], done
    after = (recipe / "infer.sh").read_bytes()
    added = [line for line in after.decode().splitlines() if line not in before.decode().splitlines()]
    assert added == ['export PYTHONPATH="${SCRIPT_PATH}/../..:${PYTHONPATH}"']
    assert after.replace(b'export PYTHONPATH="${SCRIPT_PATH}/../..:${PYTHONPATH}"\n', b"") == before
    # the line comes after the sourced scripts, before launch
    text = after.decode()
    assert text.index("source ${FUNCTION_ABS_PATH}") < text.index("export PYTHONPATH") < text.index("\nlaunch")
    # with it, infer.py's imports of the checkout resolve (it gets to argument parsing)
    proc = subprocess.run(["bash", "-c", f'SCRIPT_PATH=$(pwd); {added[0]}; {sys.executable} -c "import importlib.util; '
                           'assert importlib.util.find_spec(\'executor.utils\')"'],
                          cwd=recipe, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rollback(recipe, 1)
    assert (recipe / "infer.sh").read_bytes() == before
    # not this rule: the recipe's own module missing, or a checkout already on the path
    assert diagnose(recipe, {}, failure=Failure.from_output(recipe, "ModuleNotFoundError: No module named 'yaml'")
                    )["rule"] != "checkout_not_on_pythonpath"


def test_vocab_not_divisible_by_lmhead_tp_sets_a_divisor(checkout, tmp_path):
    weights = build_tiny_checkpoint("qwen3", tmp_path / "weights")
    config = json.loads((weights / "config.json").read_text())
    (weights / "config.json").write_text(json.dumps({**config, "vocab_size": 385}))   # an odd vocab
    recipe = checkout / "models" / "qwen"
    yaml_path = recipe / "config" / "qwen3_8b_2tp.yaml"
    original = yaml_path.read_text().replace("/data/models/origin/Qwen3-8B", str(weights))
    yaml_path.write_text(original)
    # upstream's own check raising its own error, in a process under the npu stand-in (module/ imports torch_npu)
    from npu_standin.environment import standin_env

    env = standin_env("cpu", base={**__import__("os").environ, "PYTHONPATH": str(checkout)})
    proc = subprocess.run([sys.executable, "-c", "from module.utils import ensure_divisibility; "
                           "ensure_divisibility(385, 2)"], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=300)
    assert "ValueError: 385 is not divisible by 2" in proc.stderr, proc.stderr[-2000:]
    output = proc.stderr
    failure = Failure.from_output(recipe, output, yaml=yaml_path)
    diagnosis = diagnose(recipe, {}, failure=failure)
    assert diagnosis["rule"] == "vocab_not_divisible_by_lmhead_tp", diagnosis
    done = repair(recipe, diagnosis, round_no=1, failure=failure)
    assert done["applied"] and "lmhead_tp_size: 1" in done["note"]
    changed = [(a, b) for a, b in zip(original.splitlines(), yaml_path.read_text().splitlines()) if a != b]
    assert changed == [("  lmhead_tp_size: 2", "  lmhead_tp_size: 1")]
    rollback(recipe, 1)
    assert yaml_path.read_text() == original


@pytest.mark.slow
def test_models_init_that_shadows_the_framework_model_is_removed_and_the_run_passes(checkout):
    """common issue 1 on a framework model: a models/__init__.py copied from another model (importing a
    file this one does not have) breaks the registry's import; the round removes it, parity holds."""
    init = checkout / "models" / "qwen" / "models" / "__init__.py"
    init.write_text("from .modeling_qwen3 import Qwen3ForCausalLM\n")
    proc = run_cli("run", str(checkout / "models" / "qwen"), "--standin", "--tiny", "--yaml", "qwen3_8b_1tp.yaml",
                   "--max-rounds", "1", "--json", env=FAST, timeout=2400)
    summary = json.loads(proc.stdout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads(report_path(checkout / "models" / "qwen").read_text())
    assert [r["diagnosis"]["rule"] for r in report["rounds"]] == ["models_init_shadows_package"]
    assert not init.exists() and summary["status"] == "ok"
    assert json.loads(Path(summary["baseline_path"]).read_text())["verification"]["parity"]["ok"] is True
    proc = run_cli("rollback", str(checkout / "models" / "qwen"))
    assert proc.returncode == 0 and init.read_text() == "from .modeling_qwen3 import Qwen3ForCausalLM\n"


@pytest.mark.slow
def test_legacy_recipe_without_the_checkout_on_pythonpath_is_repaired_in_a_round(checkout):
    drop_set_env_pythonpath(checkout)
    proc = run_cli("run", str(checkout / "models" / "pangu_7b"), "--standin", "--tiny", "--max-rounds", "1",
                   "--json", env=FAST, timeout=2400)
    report = json.loads(report_path(checkout / "models" / "pangu_7b").read_text())
    assert report["rounds"][0]["diagnosis"]["rule"] == "checkout_not_on_pythonpath", report["rounds"]
    assert report["rounds"][0]["applied"]
    # the next run gets past the imports into the recipe's own modeling code
    assert "No module named 'executor'" not in Path(report["runs"][-1]["output_file"]).read_text()
    assert proc.returncode in (0, 1)


def test_a_yaml_key_of_the_old_schema_is_found_before_the_run_and_moved_into_its_section(checkout):
    """The flat schema's `model_path:` at the top of a framework YAML: upstream's InferenceConfig reads
    model_config.model_path and ignores the top-level key without a word (its own from_dict shows it);
    the check (fields read from the checkout's executor) names it, the rule moves the line."""
    from agent.recipe.recipe import Recipe
    from agent.run.plan import old_schema_keys, plan_run
    from npu_standin.environment import standin_env

    recipe_dir = checkout / "models" / "qwen"
    yaml_path = recipe_dir / "config" / "qwen3_8b_1tp.yaml"
    lines = yaml_path.read_text().splitlines(keepends=True)
    line = next(ln for ln in lines if ln.strip().startswith("model_path:"))
    injected = line.lstrip() + "".join(ln for ln in lines if ln is not line)       # the key at the top
    yaml_path.write_text(injected)
    env = standin_env("cpu", base={**__import__("os").environ, "PYTHONPATH": str(checkout)})
    code = ("import yaml; from executor.core.config import InferenceConfig; "
            f"c = InferenceConfig.from_dict(yaml.safe_load(open({str(yaml_path)!r})), global_rank=0, local_rank=0); "
            "print(repr(c.model_config.model_path))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "''", proc.stderr[-2000:]
    recipe = Recipe.at(recipe_dir)
    found = old_schema_keys(recipe, yaml_path)
    assert found == ["InferenceConfig ignores the top-level key 'model_path' of config/qwen3_8b_1tp.yaml (old "
                     "schema): executor/core/config/inference_config.py reads it as model_config.model_path"]
    # without --tiny the plan says so, not "model_path None is not here"
    with pytest.raises(Exception, match="ignores the top-level key 'model_path'"):
        plan_run(recipe, 1, yaml_name="qwen3_8b_1tp.yaml", standin="cpu")
    failure = Failure.from_output(recipe_dir, "\n".join(found) + "\n")
    diagnosis = diagnose(recipe_dir, {}, failure=failure)
    assert diagnosis["rule"] == "yaml_key_of_old_schema", diagnosis
    done = repair(recipe_dir, diagnosis, round_no=1, failure=failure)
    assert done["applied"] and "moved the top-level 'model_path'" in done["note"], done
    after = yaml_path.read_text()
    assert after.splitlines()[:3] == ["model_config:", '  model_path: "/data/models/origin/Qwen3-8B"',
                                      '  model_name: "qwen3_8b"']
    assert sorted(after.splitlines()) == sorted(injected.replace(line.lstrip(), line).splitlines())   # one line moved
    assert old_schema_keys(recipe, yaml_path) == []
    rollback(recipe_dir, 1)
    assert yaml_path.read_text() == injected
    # the snapshot's own framework YAMLs: no finding
    assert all(old_schema_keys(recipe, p) == []
               for p in (recipe_dir / "config").glob("*.yaml") if p != yaml_path)


def inject_decode_mode_0(checkout: Path) -> tuple[Path, bytes]:
    """common issue 2 as it is written: the decode step switched to sparse_mode 0 ("decode 0 + None",
    the MLA pattern of the runtime-debug skill) while the prefill's 2048x2048 causal mask is still passed."""
    modeling = checkout / "models" / "qwen" / "models" / "modeling_qwen.py"
    text = modeling.read_text()
    assert text.count("        sparse_mode = 3\n") == 1
    modeling.write_text(text.replace("        sparse_mode = 3\n", "        sparse_mode = 3 if is_prefill else 0\n"))
    return modeling, modeling.read_bytes()


def test_decode_with_the_prefill_mask_raises_the_npus_error_and_the_mask_becomes_none_at_decode(checkout):
    """The stand-in's FIA checks a mode-0 mask at one query token as the NPU does (2-D: (B, KV_S)) and
    raises its text; the rule's codemod makes the mask the prefill's only; rollback restores the bytes."""
    from npu_standin.environment import standin_env

    modeling, injected = inject_decode_mode_0(checkout)
    env = standin_env("cpu", base={**__import__("os").environ, "PYTHONPATH": str(checkout)})
    code = ("import torch, torch_npu; from executor.utils.common_utils import get_init_attn_mask; "
            "q = torch.randn(1, 2, 8); kv = torch.randn(4, 16, 8); "
            "torch_npu.npu_fused_infer_attention_score_v2(q, kv.view(4, 16, 8), kv.view(4, 16, 8), num_query_heads=2, "
            "num_key_value_heads=1, input_layout='TND', sparse_mode=0, atten_mask=get_init_attn_mask(2048, 'cpu'), "
            "actual_seq_qlen=[1], actual_seq_kvlen=[5], block_table=torch.zeros(1, 1, dtype=torch.int32), block_size=16)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=300)
    assert "batchSize[2048] of atten_mask != batchSize[1] of query" in proc.stderr, proc.stderr[-2000:]
    recipe = checkout / "models" / "qwen"
    failure = Failure.from_output(recipe, proc.stderr)
    diagnosis = diagnose(recipe, {}, failure=failure)
    assert diagnosis["rule"] == "decode_keeps_prefill_attention_mask", diagnosis
    done = repair(recipe, diagnosis, round_no=1, failure=failure)
    assert done["applied"], done
    changed = [(a, b) for a, b in zip(injected.decode().splitlines(), modeling.read_text().splitlines()) if a != b]
    assert changed == [("        attention_mask = forward_metadata.attention_mask",
                        "        attention_mask = forward_metadata.attention_mask if forward_metadata.is_prefill "
                        "else None")]
    rollback(recipe, 1)
    assert modeling.read_bytes() == injected


@pytest.mark.slow
def test_decode_with_the_prefill_mask_is_repaired_in_a_round_and_parity_holds(checkout):
    inject_decode_mode_0(checkout)
    _, summary = repaired_in_one_round(checkout, "qwen", "decode_keeps_prefill_attention_mask", "--yaml", "qwen3_8b_1tp.yaml")
    assert json.loads(Path(summary["baseline_path"]).read_text())["verification"]["parity"]["ok"] is True


@pytest.mark.slow
def test_rank0_log_empty_because_the_launch_line_sends_its_stdout_away_is_reported_with_the_line(checkout):
    """The runtime-debug skill's 'rank 0's stdout goes through tee and can be cut': a launch line whose
    redirect sends rank 0's stdout to /dev/null before `| tee`. The real run (pangu_7b's infer.sh through the
    checkout's function.sh, failing: its weights are not here) leaves an empty log_0.log; the report names
    the line and upstream's form; nothing is edited (the skill reports it)."""
    from agent.recipe.recipe import Recipe, RunPlan
    from agent.run.trial_run import trial_run

    function_sh = checkout / "executor" / "scripts" / "function.sh"
    text = function_sh.read_text()
    tee = '"${cmd[@]}" 2>&1 | tee ${WORK_DIR}/${RES_PATH}/log_${LOCAL_RANK}.log &'
    assert text.count(tee) == 1
    function_sh.write_text(text.replace(tee, tee.replace("2>&1 |", "> /dev/null 2>&1 |")))
    number = text[:text.index(tee)].count("\n") + 1
    recipe = Recipe.at(checkout / "models" / "pangu_7b")
    weights = checkout.parent / "broken_weights"                 # here, but not loadable: the run fails fast
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    yaml_path = str(recipe.path / "config" / "broken.yaml")
    Path(yaml_path).write_text(recipe.yaml.read_text().replace(recipe.settings()["model_path"], str(weights)))
    run = trial_run(recipe, "classify", RunPlan(Path(yaml_path), 1, Path(yaml_path), standin="cpu"), 600)
    log0 = Path(run["log_dir"]) / "log_0.log"
    assert not run["ok"] and log0.is_file() and log0.stat().st_size == 0, run
    assert run["problem"].startswith("rank 0's log log_0.log is empty")
    before = {p: p.read_bytes() for p in (function_sh, recipe.path / "infer.sh")}
    failure = Failure.from_run(recipe.path, run)
    diagnosis = diagnose(recipe.path, {}, failure=failure)
    assert diagnosis["rule"] == "rank0_log_empty", diagnosis
    done = repair(recipe.path, diagnosis, round_no=1, failure=failure)
    assert f"executor/scripts/function.sh:{number} sends it to '> /dev/null' before `| tee`" in done["note"], done
    assert tee in done["note"] and "read log_1.log" not in done["note"]          # one rank: no other log
    assert {p: p.read_bytes() for p in before} == before


def test_rank0_log_empty_is_reported_with_the_line_that_cut_it_or_the_skills_advice(checkout):
    """In-process: the evidence line the run check writes (test above: a real run), with 2 ranks."""
    from agent.run.trial_run import RANK0_SILENT

    function_sh = checkout / "executor" / "scripts" / "function.sh"
    text = function_sh.read_text()
    tee = '"${cmd[@]}" 2>&1 | tee ${WORK_DIR}/${RES_PATH}/log_${LOCAL_RANK}.log &'
    number = text[:text.index(tee)].count("\n") + 1
    function_sh.write_text(text.replace(tee, tee.replace("2>&1 |", "> /dev/null 2>&1 |")))
    recipe = checkout / "models" / "qwen"
    evidence = f"{RANK0_SILENT} (0 bytes); log_1.log: model run success\n"
    diagnosis = diagnose(recipe, {}, failure=Failure.from_output(recipe, evidence))
    assert diagnosis["rule"] == "rank0_log_empty", diagnosis
    done = repair(recipe, diagnosis, round_no=1, failure=Failure.from_output(recipe, evidence))
    assert f"function.sh:{number} sends it to '> /dev/null' before `| tee`" in done["note"] and tee in done["note"]
    assert "read log_1.log, which the other ranks write without tee (log_1.log: model run success)" in done["note"]
    # upstream's own line, the log still empty (a tee cut short): the skill's advice, no line blamed
    function_sh.write_text(text)
    diagnosis = diagnose(recipe, {}, failure=Failure.from_output(recipe, evidence))
    done = repair(recipe, diagnosis, round_no=2, failure=Failure.from_output(recipe, evidence))
    assert "cut or not flushed (executor/scripts/function.sh:%d tees it)" % number in done["note"], done
    assert function_sh.read_text() == text


PROCESS_WEIGHTS = '''    def process_weights_after_loading(self):
        for _, module in self.named_modules():
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(module, is_nz=False)

'''


def drop_process_weights(checkout: Path) -> tuple[Path, bytes]:
    """common issue 4: gpt_oss's model class without process_weights_after_loading, so the MoE's fused
    w13 / w2 weights stay as loaded (not transposed for npu_grouped_matmul)."""
    modeling = checkout / "models" / "gpt_oss" / "models" / "modeling_gpt_oss.py"
    text = modeling.read_text()
    assert text.count(PROCESS_WEIGHTS) == 1
    modeling.write_text(text.replace(PROCESS_WEIGHTS, ""))
    return modeling, modeling.read_bytes()


def test_moe_weights_left_as_loaded_fail_grouped_matmul_and_the_model_gets_the_hook(checkout):
    """The stand-in's npu_grouped_matmul checks K as the NPU does (the error common_issues.md quotes);
    the rule adds the catalogue's process_weights_after_loading to the model class; rollback restores it."""
    from npu_standin.environment import standin_env

    modeling, injected = drop_process_weights(checkout)
    env = standin_env("cpu", base={**__import__("os").environ, "PYTHONPATH": str(checkout)})
    # one process, two calls (each traceback printed, split by a marker): the MoE layer's grouped matmul
    # on (E, 2I, H) as loaded, and upstream's UnquantizedLinearMethod.apply on a weight not transposed
    code = ("import sys, traceback, torch, torch_npu\nfrom module.linear import UnquantizedLinearMethod\n"
            "try:\n    torch_npu.npu_grouped_matmul([torch.randn(6, 64)], [torch.randn(2, 128, 64)], "
            "group_list=torch.tensor([3, 6]), group_type=0, group_list_type=0, split_item=3)\n"
            "except Exception:\n    traceback.print_exc()\nprint('=====', file=sys.stderr)\n"
            "layer = torch.nn.Module()\nlayer.weight = torch.nn.Parameter(torch.randn(128, 64), requires_grad=False)\n"
            "UnquantizedLinearMethod().apply(layer, torch.randn(5, 64))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=300)
    grouped, _, linear = proc.stderr.partition("=====\n")
    assert "aclnnGroupedMatmul (npu stand-in): Dim 1 mismatch (64 vs 128)" in grouped, proc.stderr[-2000:]
    recipe = checkout / "models" / "gpt_oss"
    failure = Failure.from_output(recipe, grouped)
    diagnosis = diagnose(recipe, {}, failure=failure)
    assert diagnosis["rule"] == "process_weights_after_loading_missing", diagnosis
    done = repair(recipe, diagnosis, round_no=1, failure=failure)
    assert done["applied"] and "GptOssForCausalLM" in done["note"], done
    after = modeling.read_text()
    assert "def process_weights_after_loading(self):" in after and after.count("class GptOssForCausalLM") == 1
    added = [line for line in after.splitlines() if line not in injected.decode().splitlines()]
    assert all("process_weights_after_loading" in line or "quant_method" in line or "named_modules" in line
               or not line.strip() for line in added), added
    rollback(recipe, 1)
    assert modeling.read_bytes() == injected
    # before any MoE layer the first linear shows it: upstream's UnquantizedLinearMethod.apply multiplies by
    # the weight its process_weights_after_loading transposes
    assert "mat1 and mat2 shapes cannot be multiplied" in linear and "module/linear.py" in linear, linear[-2000:]
    assert diagnose(recipe, {}, failure=Failure.from_output(recipe, linear))["rule"] == \
        "process_weights_after_loading_missing"
    # the same error elsewhere (not in a layer method the hook prepares) is not this rule
    other = "Traceback (most recent call last):\n  File \"/x/y.py\", line 3, in f\n" \
            "RuntimeError: mat1 and mat2 shapes cannot be multiplied (5x64 and 128x64)\n"
    assert diagnose(recipe, {}, failure=Failure.from_output(recipe, other))["rule"] != \
        "process_weights_after_loading_missing"


@pytest.mark.slow
def test_moe_weights_left_as_loaded_are_repaired_in_a_round_and_parity_holds(checkout):
    from upstream_checkout import correct_gpt_oss_window

    correct_gpt_oss_window(checkout)        # its window's extra key fails parity on its own (see there)
    drop_process_weights(checkout)
    _, summary = repaired_in_one_round(checkout, "gpt_oss", "process_weights_after_loading_missing")
    assert json.loads(Path(summary["baseline_path"]).read_text())["verification"]["parity"]["ok"] is True


@pytest.mark.slow
def test_an_old_schema_key_stops_the_stand_in_run_and_is_moved_in_a_round(checkout):
    """Nothing fails on its own (the --tiny copy even sets model_config.model_path): the check before the
    run names the key, the round moves it, the run after it reaches a baseline."""
    yaml_path = checkout / "models" / "qwen" / "config" / "qwen3_8b_1tp.yaml"
    lines = yaml_path.read_text().splitlines(keepends=True)
    line = next(ln for ln in lines if ln.strip().startswith("model_path:"))
    yaml_path.write_text(line.lstrip() + "".join(ln for ln in lines if ln is not line))
    report, _ = repaired_in_one_round(checkout, "qwen", "yaml_key_of_old_schema", "--yaml", "qwen3_8b_1tp.yaml")
    assert report["runs"][0]["summary"].startswith("InferenceConfig ignores the top-level key 'model_path'")
    assert yaml_path.read_text().startswith('model_config:\n  model_path: "/data/models/origin/Qwen3-8B"\n')


def inject_decode_graph_break(checkout: Path) -> Path:
    """A data-dependent branch on a device value in the decode step of upstream's qwen (the graph-mode skill's
    '.item() 调用 → 强制 Graph Break'): eager runs it, the fullgraph capture of the decode cannot."""
    modeling = checkout / "models" / "qwen" / "models" / "modeling_qwen.py"
    text = modeling.read_text()
    anchor = "        inputs_embeds = self.embed_tokens(input_ids)\n        hidden_states = inputs_embeds\n"
    assert text.count(anchor) == 1
    modeling.write_text(text.replace(anchor, anchor + "        if not is_prefill and hidden_states.float().abs().sum()"
                                                      ".item() < 0:\n            hidden_states = -hidden_states\n"))
    return modeling


@pytest.mark.slow
def test_a_decode_graph_mode_cannot_capture_falls_back_to_eager_in_a_round_and_parity_holds(checkout):
    """The real capture failure of a real trial: the round takes graph_mode_capture_failed, the stand-in copy of
    the YAML is set to eager with the mode and the error in its comment and the round's note, and the run
    after it reaches a checked baseline. Default case of the rule: tests/unit/agent/repair/rules/test_upstream.py."""
    inject_decode_graph_break(checkout)
    report, summary = repaired_in_one_round(checkout, "qwen", "graph_mode_capture_failed", "--yaml", "qwen3_8b_1tp.yaml")
    note = report["rounds"][0]["note"]
    assert note.startswith("graph mode (ge_graph) failed: torch._dynamo.exc.") and "falls back to eager" in note, note
    assert "models/modeling_qwen.py:" in note and "the run's copy of it" in note, note
    copy = Path(report["runs"][-1]["yaml"])
    assert "  exe_mode: eager  # was ge_graph: its capture failed (torch._dynamo.exc." in copy.read_text()
    original = checkout / "models" / "qwen" / "config" / "qwen3_8b_1tp.yaml"
    assert 'exe_mode: "ge_graph"' in original.read_text()                 # upstream's file untouched
    assert json.loads(Path(summary["baseline_path"]).read_text())["verification"]["parity"]["ok"] is True
