"""Upstream's own common issues (model-infer-migrator references/common_issues.md) as rules
(agent/repair/rules/upstream.py): each rule taking the phenomenon the document names on a recipe that
has the pattern, then fixing it so the rule no longer matches. Each fix's codemod and its CodemodTest:
tests/unit/agent/codemods/commands/."""

from __future__ import annotations

import subprocess

import pytest

from agent.repair.diagnose import first_matching_rule
from agent.repair.failure import Failure
from agent.repair.rules.rule import RepairContext


ATTENTION = '''import torch


class QwenAttention(torch.nn.Module):
    def forward(self, hidden_states, forward_metadata):
        atten_mask = forward_metadata.attention_mask
        return hidden_states
'''
MODEL = '''import torch


class QwenMoeForCausalLM(torch.nn.Module):
    def __init__(self, config, infer_config):
        super().__init__()
        bs = infer_config.scheduler_config.batch_size
        self.row_idx_decode = torch.zeros(bs, 8)
'''
# The phenomena as common_issues.md quotes them (NPU kernels: replayed here).
LOGS = {
    "decode_keeps_prefill_attention_mask": "RuntimeError: aclnnFusedInferAttentionScoreV3 failed: batchSize[2048] "
                                           "of atten_mask != batchSize[1] of query\n",
    "process_weights_after_loading_missing": "RuntimeError: aclnnGroupedMatmul failed: Dim 1 mismatch (2816 vs 1408)\n",
    "per_rank_buffers_sized_by_global_batch": "RuntimeError: aclnnMoeInitRouting: row_idx shape mismatch\n",
}


@pytest.fixture
def repo(tmp_path):
    """A cann-recipes-infer-shaped tree with a framework model folder and a sibling model."""
    root = tmp_path / "cann-recipes-infer"
    (root / "executor" / "scripts").mkdir(parents=True)
    (root / "executor" / "scripts" / "infer.sh").write_text("#!/bin/bash\n")
    (root / "models" / "gpt_oss" / "models").mkdir(parents=True)
    recipe = root / "models" / "qwen"
    (recipe / "models").mkdir(parents=True)
    (recipe / "config").mkdir()
    (recipe / "config" / "qwen.yaml").write_text("model_config:\n  model_name: qwen\n")
    (recipe / "models" / "modeling_qwen.py").write_text(ATTENTION + "\n\n" + MODEL)
    return recipe


@pytest.mark.parametrize("rule", sorted(LOGS))
def test_common_issue_rule_takes_its_phenomenon_and_fixes_it(repo, rule):
    failure = Failure.from_output(repo, LOGS[rule])
    matched, facts = first_matching_rule(failure)
    assert matched.name == rule, matched.name
    before = (repo / "models" / "modeling_qwen.py").read_text()
    matched.fix(failure, facts, RepairContext())
    after = (repo / "models" / "modeling_qwen.py").read_text()
    assert after != before
    compile(after, "modeling_qwen.py", "exec")
    again = first_matching_rule(Failure.from_output(repo, LOGS[rule]))
    assert again is None or again[0].name != rule                      # fixed: not proposed again


def test_sibling_model_not_found_puts_the_repository_root_on_pythonpath(repo):
    """Issue 3: infer.sh written without the export; the fix adds it before the Python line, and the
    script then finds models.gpt_oss from any working directory."""
    root = repo.parent.parent
    (root / "models" / "gpt_oss" / "models" / "modeling_gpt_oss.py").write_text("NAME = 'gpt_oss'\n")
    infer_sh = repo / "infer.sh"
    infer_sh.write_text('#!/bin/bash\nSCRIPT_PATH=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)\n'
                        'cd "$SCRIPT_PATH"\npython3 -c "import models.gpt_oss.models.modeling_gpt_oss as m; print(m.NAME)"\n')
    run = subprocess.run(["bash", str(infer_sh)], capture_output=True, text=True, cwd=root.parent)
    assert run.returncode != 0 and "No module named 'models.gpt_oss'" in run.stderr
    failure = Failure.from_output(repo, run.stderr)
    matched, facts = first_matching_rule(failure)
    assert matched.name == "infer_sh_without_repository_root", matched.name
    matched.fix(failure, facts, RepairContext())
    assert 'export PYTHONPATH="${SCRIPT_PATH}/../..:${PYTHONPATH}"\n' in infer_sh.read_text()
    run = subprocess.run(["bash", str(infer_sh)], capture_output=True, text=True, cwd=root.parent)
    assert run.returncode == 0 and run.stdout.strip() == "gpt_oss", run.stderr
    # Issue 1 first: with a shadowing models/__init__.py the rule that removes it takes the failure.
    (repo / "models" / "__init__.py").write_text("")
    assert first_matching_rule(Failure.from_output(repo, "ModuleNotFoundError: No module named 'models.gpt_oss'\n"))[0] \
        .name == "models_init_shadows_package"


# ---- graph mode: the capture of the decode step failed ------------------------------------------
# Real failures, raised by torch.compile under the npu stand-in in one subprocess: the decode step captured as
# upstream's executor does (npugraph_ex, fullgraph), with a fault of the kinds the graph-mode skill names, and
# failures that are not graph mode's.
CAPTURE_FAULTS = '''
import traceback

import torch
import torch_npu


def npugraph_ex(fn):
    return torch.compile(fn, backend="npugraph_ex", fullgraph=True, dynamic=True)


def data_dependent_branch(x):          # .item() steering Python control flow ("强制 Graph Break")
    if x.sum().item() > 0:
        return x + 1
    return x - 1


def graph_break(x):                    # a call dynamo cannot put in a graph, under fullgraph
    torch._dynamo.graph_break()
    return x * 2


def shape_mismatch(x):                 # a bug of the model itself: eager fails the same way
    return x + torch.ones(3, device=x.device)


def raises_its_own_error(x):           # the code raises under capture (dynamo's "Observed exception"): eager too
    raise KeyError("Communication group 'moe_ep_group' not found")


def no_reference_kernel(x):            # a kernel the stand-in has no reference for: eager meets it too
    return torch_npu.npu_weight_quant_batchmatmul(x, x, x) + 1


x = torch.ones(2, 4, device="npu")
for name, run in (("data_dependent_branch", lambda: npugraph_ex(data_dependent_branch)(x)),
                  ("graph_break", lambda: npugraph_ex(graph_break)(x)),
                  ("shape_mismatch_eager", lambda: shape_mismatch(x)),
                  ("shape_mismatch_captured", lambda: npugraph_ex(shape_mismatch)(x)),
                  ("raises_its_own_error_captured", lambda: npugraph_ex(raises_its_own_error)(x)),
                  ("no_reference_kernel_captured", lambda: npugraph_ex(no_reference_kernel)(x))):
    try:
        run()
        print(f"=== {name}\\nno failure")
    except BaseException:
        print(f"=== {name}\\n{traceback.format_exc()}", flush=True)
'''
GRAPH_YAML = ('model_config:\n  model_name: qwen\n  model_path: "your_model_path"\n'
              '  exe_mode: "npugraph_ex"        # ["ge_graph", "eager", "npugraph_ex"]\n'
              'parallel_config:\n  world_size: 1\n')


@pytest.fixture(scope="module")
def capture_failures(tmp_path_factory) -> dict[str, str]:
    import os
    import sys

    from npu_standin.environment import standin_env

    script = tmp_path_factory.mktemp("capture") / "faults.py"
    script.write_text(CAPTURE_FAULTS)
    env = standin_env("cpu", base={**os.environ, "NPU_STANDIN_COMPILE": "capture"})
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    cases = dict(part.split("\n", 1) for part in proc.stdout.split("=== ")[1:])
    assert len(cases) == 6 and "no failure" not in cases.values(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return cases


@pytest.mark.parametrize("case,exception", [("data_dependent_branch", "torch._dynamo.exc.UserError"),
                                            ("graph_break", "torch._dynamo.exc.Unsupported")])
def test_a_graph_mode_capture_failure_falls_back_to_eager_and_the_note_names_the_mode_and_the_error(
        repo, capture_failures, case, exception):
    import yaml

    from agent.recipe.backup import rollback
    from agent.repair.diagnose import diagnose
    from agent.repair.fix import repair

    yaml_path = repo / "config" / "qwen.yaml"
    yaml_path.write_text(GRAPH_YAML)
    failure = Failure.from_output(repo, capture_failures[case])
    assert failure.error.startswith(exception), failure.error
    diagnosis = diagnose(repo, {}, failure=failure)
    assert diagnosis["rule"] == "graph_mode_capture_failed", diagnosis
    done = repair(repo, diagnosis, round_no=1, failure=failure)
    assert done["applied"], done
    assert done["note"].startswith(f"graph mode (npugraph_ex) failed: {exception}: "), done["note"]
    assert "falls back to eager" in done["note"] and "qwen.yaml" in done["note"]
    after = yaml_path.read_text()
    changed = [(a, b) for a, b in zip(GRAPH_YAML.splitlines(), after.splitlines()) if a != b]
    assert len(changed) == 1 and changed[0][1].startswith(f"  exe_mode: eager  # was npugraph_ex: its capture "
                                                          f"failed ({exception}"), changed
    assert yaml.safe_load(after)["model_config"]["exe_mode"] == "eager"
    # eager now: the same failure is no longer graph mode's to fix
    assert diagnose(repo, {}, failure=Failure.from_output(repo, capture_failures[case]))["rule"] != \
        "graph_mode_capture_failed"
    rollback(repo, 1)
    assert yaml_path.read_text() == GRAPH_YAML


@pytest.mark.parametrize("case,exe_mode", [
    ("shape_mismatch_eager", "npugraph_ex"),           # the prefill (eager) failed: not the capture
    ("raises_its_own_error_captured", "npugraph_ex"),  # the model's own KeyError under capture: eager raises it too
    ("no_reference_kernel_captured", "npugraph_ex"),   # the stand-in's refusal inside the capture: eager meets it too
    ("data_dependent_branch", "eager"),                # a YAML already eager: switching does nothing
])
def test_a_failure_that_is_not_graph_modes_is_not_taken_for_one(repo, capture_failures, case, exe_mode):
    from agent.repair.diagnose import diagnose

    (repo / "config" / "qwen.yaml").write_text(GRAPH_YAML.replace('"npugraph_ex"  ', f'"{exe_mode}"  '))
    diagnosis = diagnose(repo, {}, failure=Failure.from_output(repo, capture_failures[case]))
    assert diagnosis["rule"] != "graph_mode_capture_failed", diagnosis


def test_a_logged_graph_break_before_another_failure_is_not_the_capture_failing(repo, capture_failures):
    """A graph break logged (a partial graph, the run went on) and a later unrelated failure: the evidence
    is a traceback that ends in dynamo's exception, not a line that mentions it."""
    from agent.repair.diagnose import diagnose

    (repo / "config" / "qwen.yaml").write_text(GRAPH_YAML)
    logged = ("W1205 10:00:00.000000 123 torch/_dynamo/convert_frame.py:1000] Graph break: "
              "torch._dynamo.exc.Unsupported: Dynamo does not know how to trace the builtin `time.time`\n"
              "W1205 10:00:00.000000 123 torch/_dynamo/convert_frame.py:1000] torch._dynamo hit "
              "config.recompile_limit (8)\n")
    diagnosis = diagnose(repo, {}, failure=Failure.from_output(repo, logged + capture_failures["shape_mismatch_eager"]))
    assert diagnosis["rule"] != "graph_mode_capture_failed", diagnosis


def test_a_stand_in_runs_copy_of_the_yaml_is_what_the_fix_edits_and_the_round_records(repo, capture_failures):
    """A `--standin` run of upstream's recipe runs a copy of its YAML in our state folder, and a YAML fix edits
    that copy (upstream's file never): the round is applied with the copy's diff, or the loop would give up
    after a fix it cannot see (backups skip the state folder)."""
    from agent.repair.diagnose import diagnose
    from agent.repair.fix import repair

    own = repo / "config" / "qwen.yaml"
    own.write_text(GRAPH_YAML)
    from agent.recipe.targets import state_dir

    copy = state_dir(repo) / "standin" / "config" / "qwen.yaml"          # agent.run.plan.copy_path
    copy.parent.mkdir(parents=True)
    copy.write_text(GRAPH_YAML)
    failure = Failure.from_output(repo, capture_failures["graph_break"], yaml=copy)
    diagnosis = diagnose(repo, {}, failure=failure)
    assert diagnosis["rule"] == "graph_mode_capture_failed", diagnosis
    done = repair(repo, diagnosis, round_no=1, failure=failure)
    assert done["applied"] and f"+++ b/{copy.relative_to(repo).as_posix()}" in done["diff"], done
    assert "the run's copy of it" in done["note"] and "exe_mode: eager  # was npugraph_ex" in copy.read_text()
    assert own.read_text() == GRAPH_YAML
