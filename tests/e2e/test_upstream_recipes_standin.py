"""Upstream cann-recipes-infer recipes validated off an NPU: `migrator run RECIPE --standin --tiny` on a
copy of the snapshot (agent.run.plan, agent.run.standin): the plan (which YAML, which weights, the copy of
the YAML), the exit-4 line without --standin, and a real run through the checkout's
`executor/scripts/infer.sh` with parity against transformers recorded in the baseline.

The default suite runs Qwen3 at one rank end to end; the other models, two ranks, the deliberately
broken copy and the legacy recipe are `slow` (`pytest -m slow tests/e2e/test_upstream_recipes_standin.py`)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from agent.recipe.recipe import report_path
from agent.errors import InputError
from agent.recipe.model_type import recipe_model_type
from agent.recipe.recipe import Recipe, RunPlan
from agent.run import standin as standin_hooks
from agent.run.plan import copy_path, parallel_for, plan_run
from migrator_cli import run_cli
from upstream_checkout import FAST, SNAPSHOT, copy_snapshot, run_standin


def standin_plan(recipe: Recipe, world_size: int = 1, **options) -> dict:
    """The plan `migrator run RECIPE --standin` makes (agent.cli.standin_plan), as the state keeps it."""
    return plan_run(recipe, world_size, standin="cpu", **options).as_dict()


def legacy_command(recipe: Recipe, plan: dict) -> tuple[str, ...] | None:
    """The command a legacy recipe's launch gives for `plan`; None when it is its infer.sh unchanged."""
    command = recipe.launch(RunPlan(Path(plan["yaml"]), 1, Path(plan["source_yaml"]))).command
    return None if command == ("bash", str(recipe.path / "infer.sh")) else command


def digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return copy_snapshot(tmp_path_factory.mktemp("pristine") / "cann-recipes-infer")


@pytest.fixture
def checkout(tmp_path):
    return copy_snapshot(tmp_path / "cann-recipes-infer")


# ---- the plan (in-process) -------------------------------------------------------------------
@pytest.mark.parametrize("model,yaml_name,model_type", [
    ("qwen", "qwen3_8b_1tp.yaml", "qwen3"),
    ("qwen", "qwen25_7b_instruct_1tp.yaml", "qwen2"),
    ("gpt_oss", "gpt_oss_20b.yaml", "gpt_oss"),
    ("deepseek_r1", "decode_r1_rank_16_16ep_a8w8.yaml", "deepseek_v3"),
    ("pangu_7b", "openpangu_v5_7b_mxfp8.yaml", "PanguEmbedded"),
])
def test_the_recipes_own_config_class_names_the_architecture(pristine, model, yaml_name, model_type):
    """The YAML's model_name -> the checkout's registry -> the config class -> its model_type (the
    legacy recipe: the config class in its own models/)."""
    recipe = Recipe.at(pristine / "models" / model)
    settings = recipe.settings(recipe.path / "config" / yaml_name)
    assert recipe_model_type(recipe, settings) == model_type


def test_a_legacy_recipes_draft_model_config_does_not_name_its_architecture(checkout):
    """kimi_k3's shape (the full repository): beside its model's config a draft model's
    configuration_dspark.py says model_type "qwen3" and sorts first; the runner's
    `init_model(XForCausalLM, XConfig)` names the architecture."""
    recipe = Recipe.at(checkout / "models" / "pangu_7b")
    (recipe.path / "models" / "configuration_dspark.py").write_text(
        "from transformers import PretrainedConfig\n\n\nclass DraftConfig(PretrainedConfig):\n    model_type = \"qwen3\"\n")
    assert recipe_model_type(recipe, recipe.settings()) == "PanguEmbedded"


def test_cann_ops_transformer_imported_at_module_level_is_exit_4_before_anything_runs(checkout):
    """kimi_k3 (full repository) imports CANN ops-transformer's package at the top of its modeling file:
    compiled kernels the stand-in cannot run, named with the line before a checkpoint is built."""
    from agent.errors import EnvironmentProblem

    recipe = Recipe.at(checkout / "models" / "pangu_7b")
    modeling = next((recipe.path / "models").glob("modeling_*.py"))
    modeling.write_text("import cann_ops_transformer.ops\n" + modeling.read_text())
    with pytest.raises(EnvironmentProblem, match=r"import cann_ops_transformer\.ops \(CANN ops-transformer\) at "
                                                 rf"models/pangu_7b/models/{modeling.name}:1"):
        standin_plan(recipe, tiny=True)


def test_absent_weights_without_tiny_are_bad_input_that_names_tiny(pristine):
    with pytest.raises(InputError, match=r"model_path '/data/models/origin/Qwen3-8B' is not here.*--tiny"):
        standin_plan(Recipe.at(pristine / "models" / "qwen"), yaml_name="qwen3_8b_1tp.yaml")
    with pytest.raises(InputError, match=r"--yaml nope.yaml: no such file .*qwen3_8b_2tp.yaml"):
        standin_plan(Recipe.at(pristine / "models" / "qwen"), yaml_name="nope.yaml", tiny=True)


def test_tiny_plan_points_a_copy_of_the_yaml_at_a_tiny_checkpoint(checkout):
    before = digests(checkout)
    recipe = Recipe.at(checkout / "models" / "deepseek_r1")
    plan = standin_plan(recipe, yaml_name="decode_r1_rank_16_16ep_a8w8.yaml", world_size=2, tiny=True)
    copy = Path(plan["yaml"])
    assert copy.parent == recipe.path / "res" / ".migrator" / "standin" / "config" and plan["tiny"] and plan["model_type"] == "deepseek_v3"
    data = recipe.settings(copy)
    assert data["model_config"]["model_path"] == plan["checkpoint"]
    config = json.loads((Path(plan["checkpoint"]) / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3"
    # its MLA caches are FRACTAL_NZ, 16-wide blocks (modeling_deepseek.py's KV_CACHE_NZ_DIM)
    assert config["kv_lora_rank"] % 16 == 0 and config["qk_rope_head_dim"] % 16 == 0
    # 16 ranks (embed/lmhead tp 16) cut to 2; the 1s stay 1
    assert data["parallel_config"] == {"world_size": 2, "attn_tp_size": 1, "dense_tp_size": 1, "moe_tp_size": 1,
                                       "embed_tp_size": 2, "lmhead_tp_size": 2}
    assert data["scheduler_config"]["batch_size"] == 4 and data["data_config"]["input_truncated_len"] == 128
    assert data["model_config"]["exe_mode"] == "npugraph_ex"     # the recipe's own mode is kept
    assert any("tiny random deepseek_v3" in note for note in plan["notes"])
    after = digests(checkout)
    assert {k: v for k, v in after.items() if k in before} == before      # upstream's bytes untouched
    assert all(k.startswith("models/deepseek_r1/res/.migrator/")
               for k in set(after) - set(before))


def test_real_weights_run_the_yaml_as_it_is(checkout, tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    yaml_path = checkout / "models" / "qwen" / "config" / "qwen3_8b_1tp.yaml"
    yaml_path.write_text(yaml_path.read_text().replace("/data/models/origin/Qwen3-8B", str(weights)))
    plan = standin_plan(Recipe.at(checkout / "models" / "qwen"), yaml_name="qwen3_8b_1tp.yaml", tiny=True)
    assert plan["yaml"] == str(yaml_path) and not plan["tiny"] and plan["checkpoint"] == str(weights)


def _changed_outside_res(recipe_dir: Path) -> list[str]:
    """Files of the recipe folder, outside res/, that are not the snapshot's bytes."""
    snapshot = SNAPSHOT / "models" / recipe_dir.name
    return sorted(p.relative_to(recipe_dir).as_posix() for p in recipe_dir.rglob("*")
                  if p.is_file() and not p.relative_to(recipe_dir).parts[0] == "res"
                  and (not (snapshot / p.relative_to(recipe_dir)).is_file()
                       or (snapshot / p.relative_to(recipe_dir)).read_bytes() != p.read_bytes()))


def _qwen3_moe(checkout: Path) -> Recipe:
    if not (checkout / "models" / "qwen3_moe").is_dir():
        pytest.skip("this upstream snapshot has no models/qwen3_moe (hicann/cann-recipes-infer fbc225d2de31 has it)")
    return Recipe.at(checkout / "models" / "qwen3_moe")


def test_qwen3_moe_at_the_default_one_rank_is_planned_at_a_layout_its_code_runs(checkout):
    """`migrator run models/qwen3_moe --standin --tiny` (no --world-size): at one rank moe_tp_size is 1, so its
    MoE takes the expert-parallel path, whose moe_ep_group it registers only for moe_ep_size > 1 (KeyError
    'moe_ep_group' not found). The plan says so and runs its own 16tp YAML at 2 ranks (MoE tensor parallel,
    moe_ep 1), before anything runs."""
    recipe = _qwen3_moe(checkout)
    before = digests(checkout)
    plan = standin_plan(recipe, tiny=True, fit_ranks=True)
    assert plan["world_size"] == 2 and Path(plan["source_yaml"]) == recipe.path / "config" / "qwen3_235b_16tp.yaml"
    data = recipe.settings(Path(plan["yaml"]))
    assert data["parallel_config"] == {"world_size": 2, "attn_tp_size": 2, "moe_tp_size": 2, "embed_tp_size": 2,
                                       "lmhead_tp_size": 2} == plan["parallel"]
    note = plan["notes"][0]
    assert note.startswith("qwen3_moe: its code does not run at 1 rank (attn_tp 1, moe_tp 1, so moe_ep 1): its code "
                           "gets the communication group 'moe_ep_group"), note
    assert note.endswith("running config/qwen3_235b_16tp.yaml at 2 ranks (attn_tp 2, moe_tp 2, so moe_ep 1) "
                         "instead, a layout its code runs"), note
    after = digests(checkout)
    assert {k: v for k, v in after.items() if k in before} == before      # upstream's bytes untouched


def test_one_rank_asked_for_a_recipe_whose_code_cannot_run_there_is_one_line_before_anything_runs(checkout):
    recipe = _qwen3_moe(checkout)
    with pytest.raises(InputError) as refused:
        standin_plan(recipe, world_size=1, tiny=True)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("qwen3_moe: its code does not run at 1 rank (attn_tp 1, moe_tp 1, "
                                                "so moe_ep 1): its code gets the communication group 'moe_ep_group")
    assert "only where `self.moe_ep_size > 1" in line and "--world-size N and --yaml FILE" in line
    assert not (recipe.path / "res").exists()                              # no tiny checkpoint, no copy
    proc = run_cli("run", str(recipe.path), "--standin", "--tiny", "--world-size", "1")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "moe_ep_group" in proc.stderr, proc.stderr


@pytest.mark.parametrize("model,yaml_name", [("qwen", "qwen3_8b_1tp.yaml"), ("gpt_oss", "gpt_oss_20b.yaml")])
def test_a_recipe_whose_code_runs_at_one_rank_is_planned_as_before(pristine, model, yaml_name):
    from agent.run.plan import fit_layout

    recipe = Recipe.at(pristine / "models" / model)

    base = RunPlan(recipe.path / "config" / yaml_name, 1)
    assert fit_layout(recipe, base, fixed_yaml=True, fit_ranks=True) == (base, ())


def test_a_yaml_named_with_yaml_keeps_it_and_takes_tensor_parallel_over_2_ranks(checkout):
    """deepseek_r1's 16ep YAML (--yaml) at the default rank: its code gets moe_ep_group_mc2, registered only for
    moe_ep > 1 with moe_tp 1; the named YAML is kept, made tensor parallel over 2 ranks."""
    recipe = Recipe.at(checkout / "models" / "deepseek_r1")
    from agent.run.plan import fit_layout

    base = RunPlan(recipe.path / "config" / "decode_r1_rank_16_16ep_a8w8.yaml", 1)
    plan, notes = fit_layout(recipe, base, fixed_yaml=True, fit_ranks=True)
    assert plan.yaml == base.yaml and plan.world_size == 2
    assert (plan.parallel["attn_tp_size"], plan.parallel["moe_tp_size"]) == (2, 2)
    assert "'moe_ep_group_mc2'" in notes[0] and "running config/decode_r1_rank_16_16ep_a8w8.yaml at 2 ranks" in notes[0]
    with pytest.raises(InputError, match=r"deepseek_r1: its code does not run at 1 rank .* no YAML of it at 1 rank "):
        fit_layout(recipe, base, fixed_yaml=True, fit_ranks=False)


def test_legacy_infer_sh_runs_its_own_text_with_only_the_yaml_name_changed(checkout):
    recipe = Recipe.at(checkout / "models" / "pangu_7b")
    assert recipe.kind == "legacy"
    plan = {"yaml": str(copy_path(recipe, Path("openpangu_v5_7b_mxfp8.yaml"), standin=True)),
            "source_yaml": str(recipe.path / "config" / "openpangu_v5_7b_mxfp8.yaml")}
    command = legacy_command(recipe, plan)
    original = (recipe.path / "infer.sh").read_text()
    assert command[:2] == ("bash", "-c") and command[3] == str(recipe.path / "infer.sh")
    changed = [(a, b) for a, b in zip(original.splitlines(), command[2].splitlines()) if a != b]
    assert changed == [('export YAML_FILE_NAME="openpangu_v5_7b_mxfp8.yaml" # modify to your yaml file name',
                        'export YAML_FILE_NAME="../res/.migrator/standin/config/openpangu_v5_7b_mxfp8.yaml" # modify to your yaml file name')]
    assert legacy_command(recipe, {**plan, "yaml": plan["source_yaml"]}) is None
    # the full repository's kimi_k3 names its YAML as a default the environment may override
    infer_sh = recipe.path / "infer.sh"
    infer_sh.write_text(original.replace('export YAML_FILE_NAME="openpangu_v5_7b_mxfp8.yaml"',
                                         'export YAML_FILE_NAME="${YAML_FILE_NAME:-openpangu_v5_7b_mxfp8.yaml}"'))
    changed = [b for a, b in zip(infer_sh.read_text().splitlines(), legacy_command(recipe, plan)[2]
                                 .splitlines()) if a != b]
    assert changed == ['export YAML_FILE_NAME="../res/.migrator/standin/config/openpangu_v5_7b_mxfp8.yaml" # modify '
                       'to your yaml file name']


def test_legacy_infer_sh_with_an_overridable_yaml_name_keeps_its_quotes(checkout):
    """kimi_k3's infer.sh: export YAML_FILE_NAME="${YAML_FILE_NAME:-NAME.yaml}" — the whole quoted value
    is replaced, so the script stays valid bash."""
    import subprocess

    recipe = Recipe.at(checkout / "models" / "pangu_7b")
    script = recipe.path / "infer.sh"
    script.write_text(script.read_text().replace(
        'export YAML_FILE_NAME="openpangu_v5_7b_mxfp8.yaml"',
        'export YAML_FILE_NAME="${YAML_FILE_NAME:-openpangu_v5_7b_mxfp8.yaml}"'))
    plan = {"yaml": str(recipe.path / "config" / ".standin" / "openpangu_v5_7b_mxfp8.yaml"),
            "source_yaml": str(recipe.path / "config" / "openpangu_v5_7b_mxfp8.yaml")}
    command = legacy_command(Recipe.at(recipe.path), plan)
    assert 'export YAML_FILE_NAME=".standin/openpangu_v5_7b_mxfp8.yaml" #' in command[2]
    assert subprocess.run(["bash", "-n", "-c", command[2]], capture_output=True).returncode == 0


def test_tiny_config_json_states_what_hub_config_files_state(tmp_path):
    """rope_scaling with "type" (DeepSeek-V3 / Kimi-K2 read rope_scaling["type"]) and head_dim
    (Qwen3-MoE's recipe reads config.head_dim, which transformers 5.0's class derives)."""
    from agent.measure.reference import _hub_style_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}))
    _hub_style_config(path)
    config = json.loads(path.read_text())
    assert config["rope_scaling"]["type"] == config["rope_scaling"]["rope_type"] == "yarn"
    assert config["head_dim"] == 16 and config["rope_theta"] == 10000.0
    path.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}))
    _hub_style_config(path)
    assert json.loads(path.read_text())["head_dim"] == 32                      # stated: kept
    # Qwen3-MoE: transformers 5 writes num_local_experts, the hub's file (and upstream's class) num_experts
    path.write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4,
                                "num_local_experts": 4}))
    _hub_style_config(path)
    config = json.loads(path.read_text())
    assert config["num_experts"] == config["num_local_experts"] == 4


def test_without_standin_the_answer_stays_exit_4_and_names_standin(pristine):
    proc = run_cli("run", str(pristine / "models" / "qwen"))
    assert proc.returncode == 4, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs an Ascend NPU" in lines[0] and "--standin --tiny" in lines[0]


def test_standin_refuses_what_is_not_an_upstream_recipe(tmp_path, pristine):
    proc = run_cli("run", str(pristine / "models" / "qwen"), "--tiny")
    assert proc.returncode == 2 and "--tiny needs --standin" in proc.stderr
    proc = run_cli("run", str(pristine / "models" / "qwen"), "--standin")
    assert proc.returncode == 2 and "pass --tiny" in proc.stderr and "Traceback" not in proc.stderr


# ---- runs --------------------------------------------------------------------------------------
def git_snapshot(checkout: Path) -> None:
    """The copy as a git checkout (upstream's .gitignore in force), committed: `git status` is clean."""
    import subprocess

    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "s"]):
        subprocess.run(["git", *args], cwd=checkout, check=True, capture_output=True)


def git_status(checkout: Path) -> str:
    import subprocess

    return subprocess.run(["git", "status", "--porcelain"], cwd=checkout, check=True, capture_output=True,
                          text=True).stdout


def test_qwen3_one_rank_reaches_a_baseline_with_parity_against_transformers(checkout):
    git_snapshot(checkout)
    before = digests(checkout)
    proc, summary = run_standin(checkout, "qwen", "--yaml", "qwen3_8b_1tp.yaml")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert summary["scenario"] == "C" and summary["status"] == "ok"
    baseline = json.loads(Path(summary["baseline_path"]).read_text())
    assert Path(summary["baseline_path"]).name == "baseline_metadata.standin.json"
    assert baseline["environment"]["device"] == "cpu (npu stand-in)"
    parity = baseline["verification"]["parity"]
    assert parity["reference"].endswith(" Qwen3ForCausalLM") and parity["method"].startswith("precision")
    assert parity["ok"] is True and parity["checked"] is True and parity["dtype"] == "bfloat16"
    # the prefill and every decode step of the formal run, each within its own tolerance
    assert parity["decode_steps_checked"] == parity["greedy_tokens"] - 1 >= 8
    assert parity["closest"]["ratio"] <= 1 and parity["per_request"][0]["prompt_tokens"] > 50
    report = json.loads(report_path(checkout / "models" / "qwen").read_text())
    assert any("tiny random qwen3 checkpoint" in n for n in report["upstream_standin"]["notes"])
    after = digests(checkout)
    assert {k: v for k, v in after.items() if k in before} == before      # upstream's files as they were
    # the YAML copy, the tiny checkpoint, the runs, the report and the stand-in baseline: all in git-ignored
    # res/.migrator/; upstream's tree shows nothing new
    assert Path(summary["baseline_path"]).parent == checkout / "models" / "qwen" / "res" / ".migrator" / "baseline"
    assert git_status(checkout) == "" and any((checkout / "models" / "qwen" / "res" / ".migrator" / "standin" /
                                               "config").glob("*.yaml"))


@pytest.mark.slow
def test_a_sign_flipped_in_one_layer_is_a_located_finding(checkout):
    """A broken copy (layer 1's MLP output negated): the run works, parity locates layer 1."""
    modeling = checkout / "models" / "qwen" / "models" / "modeling_qwen.py"
    old = "        hidden_states = self.mlp(hidden_states)\n\n        outputs = (residual, hidden_states)"
    text = modeling.read_text()
    assert text.count(old) == 1
    modeling.write_text(text.replace(old, "        hidden_states = self.mlp(hidden_states)\n"
                                          "        if self.self_attn.layer_idx == 1:\n"
                                          "            hidden_states = -hidden_states\n\n"
                                          "        outputs = (residual, hidden_states)"))
    proc, summary = run_standin(checkout, "qwen", "--yaml", "qwen3_8b_1tp.yaml")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "diverges from transformers at the prefill (rank 0, request 0), first at decoder layer 1" in summary["message"]
    parity = json.loads(Path(summary["baseline_path"]).read_text())["verification"]["parity"]
    assert parity["ok"] is False and parity["first_divergent_layer"] == 1
    errors = parity["first_failure"]["layer"]["layer_relative_errors"]
    assert errors[0] < 0.05 < 0.5 < errors[1]


# ---- one line for every model folder; exit 4 only where it must ---------------------------------
# The snapshot's model folders someone has looked at: what each calls of torch_npu, and what `migrator run
# models/X --standin --tiny` then does with it (the slow tests below). A folder the snapshot gains fails
# test_every_model_folder_gets_one_true_line until it has been looked at and listed.
LOOKED_AT = ("deepseek_r1", "gemma_4", "gpt_oss", "pangu_7b", "qwen", "qwen3_5", "qwen3_moe")


def test_every_model_folder_gets_one_true_line(checkout):
    """Each models/* folder of the checkout (plus a README-only one and one that imports a compiled
    custom op, as the full repository has) gets one stderr line and the exit code that says what it is.
    A recipe's line is derived from the recipe: the torch_npu kernels its code calls (agent.recipe.npu_scan)
    and the stand-in command that validates it, `--tiny` where a config class of it names an architecture."""
    from agent.recipe import npu_scan

    (checkout / "models" / "readme_only").mkdir()
    (checkout / "models" / "readme_only" / "README.md").write_text("# weights and code elsewhere\n")
    shutil.copytree(checkout / "models" / "qwen", checkout / "models" / "qwen_ascendc")
    modeling = checkout / "models" / "qwen_ascendc" / "models" / "modeling_qwen.py"
    text = modeling.read_text()
    modeling.write_text(text.replace("import torch\n", "import torch\nimport custom_ops\n", 1))
    line_no = modeling.read_text().splitlines().index("import custom_ops") + 1
    answers = {}
    for folder in sorted((checkout / "models").iterdir()):
        proc = run_cli("run", str(folder))
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, (folder.name, proc.stderr)
        answers[folder.name] = (proc.returncode, lines[0])
    assert set(answers) == {*LOOKED_AT, "readme_only", "qwen_ascendc"}, \
        f"a model folder nobody has looked at: {sorted(set(answers) - {*LOOKED_AT, 'readme_only', 'qwen_ascendc'})}"
    for name in LOOKED_AT:
        code, line = answers[name]
        recipe = Recipe.at(checkout / "models" / name)
        calls = [k for k in npu_scan.scan_recipe(recipe.path, recipe.repo_root, list(recipe.entry_files)).kernels
                 if k.kind == "call"]
        kernels = len(dict.fromkeys(k.name for k in calls))
        tiny = " --tiny" if recipe_model_type(recipe, recipe.settings()) else ""
        assert code == 4 and line.startswith(f"migrator: error: needs an Ascend NPU: {kernels} torch_npu kernels "), line
        assert f"at {len(calls)} call sites; first call: {calls[0].name} at {calls[0].where};" in line, line
        assert f"`migrator run {recipe.path} --standin{tiny}` can validate it" in line, line
    # the models of transformers 5 (their config classes in the recipe name an architecture): --tiny
    assert all(f"models/{name} --standin --tiny`" in answers[name][1] for name in LOOKED_AT)
    code, line = answers["readme_only"]
    assert code == 2 and "no config/*.yaml" in line
    code, line = answers["qwen_ascendc"]
    assert code == 4 and "--standin" not in line
    assert f"import custom_ops (AscendC) at models/qwen_ascendc/models/modeling_qwen.py:{line_no}" in line
    # with --standin too: nothing runs, nothing is written
    proc = run_cli("run", str(checkout / "models" / "qwen_ascendc"), "--standin", "--tiny")
    assert proc.returncode == 4 and "import custom_ops (AscendC)" in proc.stderr
    assert not (checkout / "models" / "qwen_ascendc" / "res" / ".migrator").exists() and not (checkout / "models" / "qwen_ascendc" / ".migrator").exists()


def test_a_compiled_op_reached_at_run_time_is_named_at_its_call_site(tmp_path):
    """The op behind a switch: named from the run's own traceback (torch's real error), innermost
    frame inside the checkout."""
    import subprocess
    import sys

    from agent.recipe.compiled_ops import from_evidence

    module = tmp_path / "models" / "m" / "models" / "mhc.py"
    module.parent.mkdir(parents=True)
    module.write_text("import torch\n\n\ndef hc_pre(x):\n    return torch.ops.custom.npu_hc_pre(x)\n")
    proc = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(module.parent)!r}); "
                           "import torch, mhc; mhc.hc_pre(torch.ones(1))"], capture_output=True, text=True)
    assert proc.returncode == 1
    op = from_evidence(proc.stderr, [tmp_path])
    assert (op.name, op.kind, op.where) == ("torch.ops.custom.npu_hc_pre", "AscendC", "models/m/models/mhc.py:5")
    assert from_evidence("ModuleNotFoundError: No module named 'tilelang'", [tmp_path]).kind == "TileLang"
    # kimi_k3's `import cann_ops_transformer.ops` (CANN ops-transformer kernels)
    assert from_evidence("No module named 'cann_ops_transformer'", [tmp_path]).kind == "CANN ops-transformer"
    assert from_evidence("ModuleNotFoundError: No module named 'yaml'", [tmp_path]) is None


@pytest.mark.parametrize("parallel,ranks,expected", [
    # a 16-rank YAML on 2: the layout kept, scaled down
    ({"world_size": 16, "attn_tp_size": 1, "embed_tp_size": 16, "lmhead_tp_size": 16, "moe_ep_size": 16}, 2,
     {"world_size": 2, "attn_tp_size": 1, "embed_tp_size": 2, "lmhead_tp_size": 2, "moe_ep_size": 2}),
    ({"world_size": 32, "attn_tp_size": 32, "moe_tp_size": 1}, 1, {"world_size": 1, "attn_tp_size": 1, "moe_tp_size": 1}),
    # a single-card YAML on 2: tensor parallel over both, as upstream's 2tp YAMLs are
    ({"world_size": 1, "attn_tp_size": 1, "moe_tp_size": 1, "embed_tp_size": 1, "lmhead_tp_size": 1}, 2,
     {"world_size": 2, "attn_tp_size": 2, "moe_tp_size": 2, "embed_tp_size": 1, "lmhead_tp_size": 2}),
])
def test_parallel_config_for_the_ranks_asked(parallel, ranks, expected):
    assert parallel_for(parallel, ranks) == expected


# ---- model x ranks (slow) --------------------------------------------------------------------
TABLE = [
    pytest.param("qwen", "qwen3_8b_2tp.yaml", 2, "Qwen3ForCausalLM", id="qwen3-2ranks"),
    pytest.param("qwen", "qwen25_7b_instruct_1tp.yaml", 1, "Qwen2ForCausalLM", id="qwen2-1rank"),
    pytest.param("qwen", "qwen25_7b_instruct_2tp.yaml", 2, "Qwen2ForCausalLM", id="qwen2-2ranks"),
]


@pytest.mark.slow
@pytest.mark.parametrize("model,yaml_name,ranks,reference", TABLE)
def test_upstream_model_reaches_a_baseline_with_parity(checkout, model, yaml_name, ranks, reference):
    proc, summary = run_standin(checkout, model, "--yaml", yaml_name, "--world-size", str(ranks))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    baseline = json.loads(Path(summary["baseline_path"]).read_text())
    parity = baseline["verification"]["parity"]
    assert parity["reference"] == f"transformers {reference} (npu stand-in)" and parity["ok"] is True
    assert baseline["standin"]["world_size"] == ranks and baseline["verification"]["all_ranks_success"]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_upstreams_gpt_oss_window_is_one_key_wider_than_transformers(checkout, ranks):
    """--tiny gives gpt_oss a sliding window (16) shorter than the run's sequences, so its window is exercised:
    upstream's pre_tokens=sliding_window keeps one key more than transformers' window (the band of sparse_mode
    4 holds at a one-token TND decode as at prefill: npu_standin/kernels/attention.py), and the verdict fails at
    a decode step, on the first (sliding) layer; with pre_tokens = window - 1 the same recipe passes."""
    from upstream_checkout import correct_gpt_oss_window

    proc, summary = run_standin(checkout, "gpt_oss", "--yaml", "gpt_oss_20b.yaml", "--world-size", str(ranks))
    parity = json.loads(Path(summary["baseline_path"]).read_text())["verification"]["parity"]
    assert proc.returncode == 1 and parity["ok"] is False, (proc.stdout + proc.stderr)[-3000:]
    failure = next(r["first_failure"] for r in parity["per_request"] if r["first_failure"])
    assert failure["phase"] == "decode", failure
    assert failure["layer"]["layer"] == 0, failure          # layer 0: sliding_attention
    message = summary["message"]
    correct_gpt_oss_window(checkout)
    proc, summary = run_standin(checkout, "gpt_oss", "--yaml", "gpt_oss_20b.yaml", "--world-size", str(ranks))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    baseline = json.loads(Path(summary["baseline_path"]).read_text())
    assert baseline["verification"]["parity"]["ok"] is True and baseline["standin"]["world_size"] == ranks
    print(f"gpt_oss ranks={ranks}: upstream fails at {failure['phase']} step {failure['step']} "
          f"({message}); window - 1 passes, closest {baseline['verification']['parity']['closest']}")


@pytest.mark.slow
def test_baseline_standin_tiny_writes_one_row_per_model(checkout, tmp_path):
    summary = tmp_path / "summary"
    proc = run_cli("baseline", str(checkout / "models" / "qwen"), str(checkout / "models" / "pangu_7b"),
                   "--standin", "--tiny", "--summary", str(summary), env=FAST, timeout=3600)
    rows = (summary.with_suffix(".csv")).read_text().splitlines()
    assert rows[0].startswith("model,status") and len(rows) == 3
    assert ",ok," in rows[1] and "cpu (npu stand-in)" in rows[1]
    assert proc.returncode == 1          # pangu_7b stops in its own modeling code (see the note)


def _deepseek_r1_runnable():
    import importlib.util

    pytest.importorskip("compressed_tensors", reason="deepseek_r1's requirements.txt: compressed-tensors")
    if importlib.util.find_spec("transformers.modeling_attn_mask_utils") is None:
        pytest.skip("deepseek_r1's modules import transformers.modeling_attn_mask_utils (upstream pins 5.0.0)")


@pytest.mark.slow
def test_deepseek_r1_two_ranks_runs_mla_and_moe_tp_through_upstreams_code_to_a_parity_record(checkout):
    """DeepSeek-R1 (MLA with FRACTAL_NZ caches, npu_mla_prolog_v3 decode, MoE TP) at 2 ranks on upstream's
    16-rank TP YAML: prefill and graph-mode decode run; the parity record is located layer by layer
    (layer 0, dense, at bf16 noise; the MoE layer's routing near-ties on random weights are the finding)."""
    _deepseek_r1_runnable()
    proc, summary = run_standin(checkout, "deepseek_r1", "--yaml", "decode_r1_rank_16_16tp_a8w8.yaml",
                                "--world-size", "2")
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    baseline = json.loads(Path(summary["baseline_path"]).read_text())
    assert baseline["standin"]["world_size"] == 2 and baseline["verification"]["all_ranks_success"]
    parity = baseline["verification"]["parity"]
    assert parity["reference"].endswith(" DeepseekV3ForCausalLM") and parity["checked"] and parity["ranks"] == 2
    if proc.returncode == 1:   # located: the step, and a decoder layer where that step has a layer record
        assert re.search(r"diverges from transformers at (the prefill|decode step \d+) \(rank \d, request \d\)",
                         summary["message"])


@pytest.mark.slow
def test_qwen3_moe_as_the_readme_says_runs_at_two_ranks_moe_tp_to_a_checked_baseline(checkout):
    """`migrator run models/qwen3_moe --standin --tiny`, as the README says for upstream's recipes: its code does
    not run at the default one rank (its EP path gets moe_ep_group, registered only for moe_ep_size > 1), so
    the plan runs its 16tp YAML at 2 ranks (moe_tp_size 2: the TP MoE path, moe_ep 1) and says why. Upstream's
    qwen3_moe keeps its router in fp32 and feeds it bf16 through module/linear.py's torch.matmul: the stand-in
    computes that in fp32 and returns bf16, as op-plugin's matmul and aclnnMatmul do on the NPU
    (npu_standin/kernels/matmul.py, mixed_matmul_dtypes). Prefill and graph-mode decode run and pass the
    per-step check. The plan alone: test_qwen3_moe_at_the_default_one_rank_is_planned_at_a_layout_its_code_runs."""
    recipe = _qwen3_moe(checkout)
    proc, summary = run_standin(checkout, "qwen3_moe")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert summary["scenario"] == "C" and summary["status"] == "ok"
    assert "qwen3_moe: its code does not run at 1 rank" in proc.stderr and "'moe_ep_group" in proc.stderr
    precision = summary["precision"]
    assert precision["ok"] and precision["checked"] and precision["ranks"] == 2 and precision["decode_steps_checked"] > 0
    baseline = json.loads(Path(summary["baseline_path"]).read_text())
    assert baseline["yaml_path"] == "config/qwen3_235b_16tp.yaml"
    kernels = baseline["standin"]["reference_kernels"]
    assert all(op in str(kernels) for op in ("npu_moe_gating_top_k_softmax", "npu_moe_init_routing_v2",
                                             "npu_grouped_matmul", "npu_moe_finalize_routing"))
    assert baseline["standin"]["unsupported"] == [] and baseline["standin"]["world_size"] == 2
    compiled = baseline["standin"]["compiles"]["Qwen3MoeForCausalLM.main_decode [ge_graph]"]
    assert (compiled["compiles"], compiled["recompiles"]) == (2, 0), compiled        # once on each rank
    assert _changed_outside_res(recipe.path) == []                 # upstream's files untouched


def test_deepseek_r1_at_one_rank_is_refused_before_it_runs_naming_its_own_moe_ep_code(checkout):
    """At one rank moe_tp_size is 1, so the MoE runs its EP path, which gets moe_ep_group_mc2, a group its
    code registers only for moe_ep_size > 1: the recipe's own limit, named at its lines before anything runs
    (without --world-size the plan takes 2 ranks, tensor parallel: test_a_yaml_named_with_yaml_keeps_it...).
    Nothing of deepseek_r1's is imported: its requirements need not be installed."""
    proc = run_cli("run", str(checkout / "models" / "deepseek_r1"), "--standin", "--tiny", "--yaml",
                   "decode_r1_rank_16_16ep_a8w8.yaml", "--world-size", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip()
    assert "\n" not in line and "'moe_ep_group_mc2' (models/modeling_deepseek.py:" in line, line
    assert not (checkout / "models" / "deepseek_r1" / "res").exists()


# upstream qwen3_moe's FusedMoEGMM takes its EP rank from the comm manager: the next rank's experts loaded instead
QWEN3_MOE_EP_RANK = 'ep_rank=comm_manager.get_rank("moe_ep_group") if self.ep_size > 1 else 0,'


@pytest.mark.slow
@pytest.mark.parametrize("misrouted", [False, True], ids=["ep", "experts_of_the_next_rank"])
def test_qwen3_moe_two_ranks_expert_parallel_runs_mc2_dispatch_and_is_checked_per_step(checkout, misrouted):
    """Upstream's qwen3_moe on its attn4tp8dp YAML at 2 ranks: attention TP 2, moe_tp_size 1, so moe_ep_size 2 —
    its moe_ep_group and MC2 group registered in the comm manager (get_hccl_comm_name), the prefill's all-to-all
    double routing (npu_moe_init_routing_v2, all_to_all_single, npu_moe_re_routing) and the decode's
    npu_moe_distribute_dispatch_v2 / combine_v2 on the stand-in's gloo group. Every step passes against
    transformers with the expert-parallel reference named; each rank holding the next rank's experts (a wrong
    routing: an expert's tokens computed by another rank's expert) fails the check at the prefill."""
    if not (checkout / "models" / "qwen3_moe").is_dir():
        pytest.skip("this upstream snapshot has no models/qwen3_moe (hicann/cann-recipes-infer fbc225d2de31 has it)")
    if misrouted:
        modeling = checkout / "models" / "qwen3_moe" / "models" / "modeling_qwen3_moe.py"
        text = modeling.read_text()
        assert text.count(QWEN3_MOE_EP_RANK) == 1, "upstream's qwen3_moe EP rank line changed"
        modeling.write_text(text.replace(QWEN3_MOE_EP_RANK, QWEN3_MOE_EP_RANK.replace(
            'comm_manager.get_rank("moe_ep_group")', '(comm_manager.get_rank("moe_ep_group") + 1) % self.moe_ep_size')))
    proc, summary = run_standin(checkout, "qwen3_moe", "--yaml", "qwen3_235b_attn4tp8dp.yaml", "--world-size", "2")
    assert "baseline_path" in summary, (proc.stdout + proc.stderr)[-3000:]
    baseline = json.loads(Path(summary["baseline_path"]).read_text())
    kernels = baseline["standin"]["reference_kernels"]
    assert {"npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2", "npu_moe_re_routing",
            "npu_moe_init_routing_v2"} <= set(kernels), kernels
    assert baseline["standin"]["unsupported"] == [] and baseline["standin"]["world_size"] == 2
    parity = baseline["verification"]["parity"]
    assert parity["checked"] and parity["ranks"] == 2 and parity["expert_parallel_split"]["parts"] == 2, parity
    assert "expert-parallel partial sums" in parity["reference_dtypes"][-1]
    if not misrouted:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        assert summary["status"] == "ok" and parity["ok"] and parity["decode_steps_checked"] > 0
        assert kernels["npu_moe_distribute_dispatch_v2"] == kernels["npu_moe_distribute_combine_v2"] > 0
    else:
        assert proc.returncode == 1 and parity["ok"] is False, (proc.stdout + proc.stderr)[-3000:]
        assert parity["first_failing_step"] == "the prefill" and parity["first_divergent_layer"] == 0, parity


def test_standin_process_groups_answer_get_hccl_comm_name(tmp_path):
    """executor/utils/hccl_utils.get_group_name asks the group's npu backend for its HCCL name."""
    import subprocess
    import sys

    from npu_standin.environment import standin_env

    code = ("import torch, torch_npu, torch.distributed as dist\n"
            "dist.init_process_group('hccl', init_method='tcp://127.0.0.1:0', world_size=1, rank=0)\n"
            "name = dist.group.WORLD._get_backend(torch.device('npu')).get_hccl_comm_name(0)\n"
            "print(type(name).__name__, name.startswith('npu-standin-gloo-'))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=standin_env("cpu", record_dir=tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "str True"


def test_an_op_refused_in_a_captured_region_is_named_from_the_evidence(tmp_path):
    """Traced by dynamo the stand-in raises without a record (npu_standin.errors): the op is named from
    the line dynamo reports, as a recorded refusal would be."""
    evidence = ("[rank0]: torch._dynamo.exc.ObservedUnsupportedOpError: raised exception UnsupportedOp('npu stand-in: "
                "torch_npu.npu_moe_distribute_dispatch_v2 has no reference kernel (called at a captured region "
                "(torch.compile)); the stand-in runs only what it can reproduce on the host: run this path on an NPU')\n"
                "[rank0]: torch._dynamo.exc.Unsupported: Observed exception\n")
    assert standin_hooks.unsupported(tmp_path, evidence) == (
        "torch_npu.npu_moe_distribute_dispatch_v2 has no reference kernel in the npu stand-in "
        "(called in a captured region (torch.compile))")
    assert standin_hooks.unsupported(tmp_path, "RuntimeError: something else") is None
