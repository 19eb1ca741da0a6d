"""Fault injection into a recipe's files and layout (agent/repair/rules/files.py): a working recipe broken as
people break it, `migrator run RECIPE` repairs it in a round, `migrator rollback` restores the injected files.
The rules' matchers and fixes in-process: tests/unit/agent/repair/rules/test_files.py."""

from __future__ import annotations

import pytest
from migrator_cli import assert_repaired, repair_run, run_cli

from agent.recipe.backup import recipe_files


def test_models_init_shadowing_the_package_is_removed(working_recipe):
    # In practice: an __init__.py copied from another recipe, importing modules this one lacks.
    init = working_recipe / "models" / "__init__.py"
    init.write_text("from .modeling_deepseek import DeepseekV3ForCausalLM  # copied from another recipe\n")
    injected = {"models/__init__.py": init.read_bytes()}
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "models_init_shadows_package", injected)
    assert not init.exists()


@pytest.mark.slow  # end-to-end round; re-vendoring, models/__init__ shadowing and rollback stay by default
# ---- fault injection (a real `migrator run` on a broken recipe) ---------------------------
def test_infer_sh_without_pythonpath_gets_the_export_back(working_recipe):
    # In practice: an infer.sh written by hand, run where the script dir is not on sys.path
    # (PYTHONSAFEPATH=1, a hardened environment).
    infer_sh = working_recipe / "infer.sh"
    lines = [ln for ln in infer_sh.read_text().splitlines(keepends=True) if not ln.startswith("export PYTHONPATH=")]
    lines.insert(lines.index("set -eo pipefail\n") + 1, "export PYTHONSAFEPATH=1\n")
    infer_sh.write_text("".join(lines))
    injected = {"infer.sh": infer_sh.read_bytes()}
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "infer_sh_no_pythonpath", injected)
    assert "No module named 'models'" in report["rounds"][0]["diagnosis"]["error"]
    after = infer_sh.read_text().splitlines(keepends=True)
    added = [ln for ln in after if ln not in lines]
    assert added == ['export PYTHONPATH="$SCRIPT_DIR${PYTHONPATH:+:$PYTHONPATH}"\n']      # one line, nothing else
    assert after[after.index(added[0]) + 1].startswith("exec ")                            # right before the exec


@pytest.mark.slow  # end-to-end round; rollback and models/__init__ shadowing stay by default
def test_deleted_vendored_modeling_file_is_re_vendored(working_recipe):
    modeling = working_recipe / "models" / "modeling_fi.py"
    original = modeling.read_bytes()
    configuration = (working_recipe / "models" / "configuration_fi.py").read_bytes()
    modeling.unlink()
    injected = {"models/modeling_fi.py": None}
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "vendored_module_missing", injected)
    assert modeling.read_bytes() == original                      # same transformers: same vendored file
    assert (working_recipe / "models" / "configuration_fi.py").read_bytes() == configuration
    assert report["rounds"][0]["diff"].count("+++ ") == 1         # only the missing file


@pytest.mark.slow  # end-to-end round; re-vendoring, models/__init__ shadowing and rollback stay by default
def test_truncated_infer_py_is_re_rendered(working_recipe):
    # In practice: a copy interrupted halfway, or an editor that saved half a file.
    infer_py = working_recipe / "infer.py"
    original = infer_py.read_bytes()
    infer_py.write_bytes(original[: len(original) // 2])
    injected = {"infer.py": infer_py.read_bytes()}
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "generated_file_missing_or_corrupt", injected)
    # Cut at a line end the rest still parses and the run prints nothing; elsewhere it is a SyntaxError.
    assert report["rounds"][0]["diagnosis"]["error"].startswith(("SyntaxError", "no output"))
    assert infer_py.read_bytes() == original
    assert report["rounds"][0]["diff"].count("+++ ") == 1


@pytest.mark.slow  # end-to-end round; re-vendoring, models/__init__ shadowing and rollback stay by default
def test_deleted_model_setting_is_re_rendered(working_recipe):
    model_setting = working_recipe / "models" / "model_setting.py"
    original = model_setting.read_bytes()
    model_setting.unlink()
    injected = {"models/model_setting.py": None}
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "generated_file_missing_or_corrupt", injected)
    assert model_setting.read_bytes() == original
    assert report["rounds"][0]["diff"].count("+++ ") == 1


@pytest.mark.slow  # end-to-end round; re-vendoring, models/__init__ shadowing and rollback stay by default
def test_infer_py_without_warm_up_gets_it_inserted(working_recipe):
    # In practice: someone "cleaned up" infer.py and dropped the warm-up generation.
    infer_py = working_recipe / "infer.py"
    original = infer_py.read_text()
    warm_up = "    runner.model_generate(prompts, warm_up=True)\n"
    infer_py.write_text(original.replace(warm_up, ""))
    injected = {"infer.py": infer_py.read_bytes()}
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "infer_py_without_warm_up", injected)
    assert report["rounds"][0]["diagnosis"]["error"].startswith("BaselineError")
    assert infer_py.read_text() == original          # the line is back, right before the formal call


@pytest.mark.slow  # end-to-end round; re-vendoring, models/__init__ shadowing and rollback stay by default
def test_stray_yaml_py_shadowing_pyyaml_is_moved_aside(working_recipe):
    # In practice: a helper script named after the format it handles, dropped in the recipe dir.
    stray = working_recipe / "yaml.py"
    stray.write_text('"""Pretty-print the recipe YAML."""\nimport sys\n\n\ndef show(path):\n'
                     '    print(open(path).read())\n')
    injected = {"yaml.py": stray.read_bytes()}
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "recipe_file_shadows_stdlib_or_package", injected)
    assert not stray.exists()
    assert (working_recipe / "yaml.py.shadowing").read_bytes() == injected["yaml.py"]


def test_rollback_after_a_repair_restores_the_injected_files(working_recipe):
    runner = working_recipe / "runner_fi.py"
    text = runner.read_text()
    cut = len(text) // 3
    while _compiles(text[:cut]):        # a cut that leaves valid Python is another failure
        cut += 5
    runner.write_text(text[:cut])
    before = {rel: path.read_bytes() for rel, path in recipe_files(working_recipe).items()}
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "generated_file_missing_or_corrupt",
                    {"runner_fi.py": before["runner_fi.py"]})
    assert runner.read_bytes() != before["runner_fi.py"]
    proc = run_cli("rollback", str(working_recipe))
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = {rel: path.read_bytes() for rel, path in recipe_files(working_recipe).items()}
    # byte for byte, no file added or lost; the migrator's own records (the report, the summary, the
    # README's status block) are rewritten by each run, not by a repair, and are not rolled back
    records = ("migration_report.json", "migration_summary.md", "README.md")
    assert {k: v for k, v in after.items() if k not in records} == {k: v for k, v in before.items() if k not in records}


def _compiles(code: str) -> bool:
    try:
        compile(code, "<cut>", "exec")
        return True
    except SyntaxError:
        return False
