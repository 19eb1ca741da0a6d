"""Fault injection: recipe files and layout (agent/repair/rules/files.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from migrator_cli import assert_repaired, repair_run, run_cli

from agent.recipe.backup import recipe_files
from agent.repair.failure import Failure
from agent.repair.diagnose import rule_named
from agent.repair.rules import files
from migrator_cli import first_match_name as _first_match_name


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


# ---- matchers on sample outputs (no model run) --------------------------------------------
@pytest.fixture
def fake_recipe(tmp_path):
    """Recipe layout without a checkpoint: enough for the matchers."""
    recipe = tmp_path / "fi"
    (recipe / "models").mkdir(parents=True)
    (recipe / "config").mkdir()
    (recipe / "runner_fi.py").write_text("from models.modeling_fi import LlamaForCausalLM\n")
    (recipe / "models" / "modeling_fi.py").write_text("class LlamaForCausalLM: ...\n")
    (recipe / "models" / "configuration_fi.py").write_text("class LlamaConfig: ...\n")
    (recipe / "models" / "model_setting.py").write_text("def check_vars(s): ...\n")
    (recipe / "infer.py").write_text(
        '"""fi inference: a warm-up generation, then the formal (measured) one."""\n\n\ndef main():\n'
        "    runner = make()\n    runner.model_generate(prompts, warm_up=True)\n    runner.model_generate(prompts)\n")
    (recipe / "infer.sh").write_text('set -eo pipefail\nSCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"\n'
                                     'PYTHON="${PYTHON:-python3}"\nexec "$PYTHON" -m engine.launch infer.py\n')
    (recipe / "migration_report.json").write_text(json.dumps({
        "model_name": "fi", "rendered": ["infer.py", "infer.sh", "config/fi_1card_eager.yaml",
                                         "models/model_setting.py", "requirements.txt", "README.md", "runner_fi.py"],
        "vendored": {"files": {"modeling": "models/modeling_fi.py", "configuration": "models/configuration_fi.py"}}}))
    return recipe


def _traceback(recipe: Path, file: str, error: str) -> str:
    return (f'Traceback (most recent call last):\n  File "{recipe / file}", line 7, in <module>\n'
            f"    import something\n{error}\n")


def test_pythonpath_matcher(fake_recipe):
    out = _traceback(fake_recipe, "infer.py", "ModuleNotFoundError: No module named 'models'")
    assert _first_match_name(fake_recipe, out) == "infer_sh_no_pythonpath"
    out_runner = _traceback(fake_recipe, "infer.py", "ModuleNotFoundError: No module named 'runner_fi'")
    assert _first_match_name(fake_recipe, out_runner) == "infer_sh_no_pythonpath"
    # not a recipe module: a missing dependency, not PYTHONPATH
    assert rule_named("infer_sh_no_pythonpath").match(
        Failure.from_output(fake_recipe, _traceback(fake_recipe, "infer.py", "ModuleNotFoundError: No module named 'numpy'"))) is None
    # infer.sh already exports the recipe dir: the cause is elsewhere
    sh = fake_recipe / "infer.sh"
    sh.write_text(sh.read_text().replace("exec", 'export PYTHONPATH="$SCRIPT_DIR"\nexec'))
    assert rule_named("infer_sh_no_pythonpath").match(Failure.from_output(fake_recipe, out)) is None


def test_pythonpath_fix_without_script_dir(fake_recipe):
    sh = fake_recipe / "infer.sh"
    sh.write_text("#!/bin/bash\ncd /somewhere\n# run it\npython3 infer.py --yaml-file-path config/x.yaml\n")
    failure = Failure.from_output(fake_recipe, "ModuleNotFoundError: No module named 'models'")
    facts = rule_named("infer_sh_no_pythonpath").match(failure)
    rule_named("infer_sh_no_pythonpath").fix(failure, facts, None)
    lines = sh.read_text().splitlines()
    assert lines[3].startswith('export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)')
    assert lines[4].startswith("python3 infer.py")


def test_vendored_module_matcher(fake_recipe):
    out = _traceback(fake_recipe, "runner_fi.py", "ModuleNotFoundError: No module named 'models.modeling_fi'")
    assert rule_named("vendored_module_missing").match(Failure.from_output(fake_recipe, out)) is None   # the file is there
    (fake_recipe / "models" / "modeling_fi.py").unlink()
    assert _first_match_name(fake_recipe, out) == "vendored_module_missing"
    other = _traceback(fake_recipe, "runner_fi.py", "ModuleNotFoundError: No module named 'models.helpers'")
    assert _first_match_name(fake_recipe, other) is None                 # not something the migrator vendored


def test_generated_file_matcher(fake_recipe):
    missing = f"python3: can't open file '{fake_recipe / 'infer.py'}': [Errno 2] No such file or directory\n"
    assert _first_match_name(fake_recipe, missing) is None               # infer.py is there
    (fake_recipe / "infer.py").unlink()
    assert _first_match_name(fake_recipe, missing) == "generated_file_missing_or_corrupt"
    (fake_recipe / "models" / "model_setting.py").unlink()
    assert _first_match_name(fake_recipe, _traceback(fake_recipe, "infer.py", "ModuleNotFoundError: No module named "
                                                "'models.model_setting'")) == "generated_file_missing_or_corrupt"
    # a syntax error in a file the user wrote is not re-rendered
    (fake_recipe / "helpers.py").write_text("def f(:\n")
    syntax = f'  File "{fake_recipe / "helpers.py"}", line 1\n    def f(:\n          ^\nSyntaxError: invalid syntax\n'
    assert _first_match_name(fake_recipe, syntax) is None
    (fake_recipe / "runner_fi.py").write_text("class FiRunner(\n")
    corrupt = f'  File "{fake_recipe / "runner_fi.py"}", line 1\n    class FiRunner(\n ^\nSyntaxError: "(" was never closed\n'
    assert rule_named("generated_file_missing_or_corrupt").match(Failure.from_output(fake_recipe, corrupt))["file"] == "runner_fi.py"


def test_warm_up_matcher(fake_recipe):
    baseline_error = "ok\nBaselineError: infer.py ran without a warm-up generation (1 prefill in log_0.log)\n"
    assert _first_match_name(fake_recipe, baseline_error) is None          # a warm-up call is there already
    infer_py = fake_recipe / "infer.py"
    infer_py.write_text(infer_py.read_text().replace("    runner.model_generate(prompts, warm_up=True)\n", ""))
    assert _first_match_name(fake_recipe, baseline_error) == "infer_py_without_warm_up"
    assert _first_match_name(fake_recipe, "RuntimeError: something else\n") is None


def test_warm_up_fix_uses_the_call_s_own_names(fake_recipe):
    infer_py = fake_recipe / "infer.py"
    infer_py.write_text("def main(engine, batch):\n    engine.load()\n    # formal, measured run\n"
                        "    texts = engine.model_generate(batch)\n    print(texts)\n")
    failure = Failure.from_output(fake_recipe, "BaselineError: infer.py ran without a warm-up generation (1 prefill)\n")
    rule = rule_named("infer_py_without_warm_up")
    rule.fix(failure, rule.match(failure), None)
    assert infer_py.read_text() == ("def main(engine, batch):\n    engine.load()\n    # formal, measured run\n"
                                    "    engine.model_generate(batch, warm_up=True)\n"
                                    "    texts = engine.model_generate(batch)\n    print(texts)\n")


def test_shadowing_matcher(fake_recipe):
    out = _traceback(fake_recipe, "infer.py", "AttributeError: module 'yaml' has no attribute 'YAMLError'")
    assert _first_match_name(fake_recipe, out) is None                    # no yaml.py in the recipe
    (fake_recipe / "yaml.py").write_text("def show(path): ...\n")
    assert _first_match_name(fake_recipe, out) == "recipe_file_shadows_stdlib_or_package"
    (fake_recipe / "helpers.py").write_text("x = 1\n")               # a recipe module, no package of that name
    own = _traceback(fake_recipe, "infer.py", "AttributeError: module 'helpers' has no attribute 'y'")
    assert rule_named("recipe_file_shadows_stdlib_or_package").match(Failure.from_output(fake_recipe, own)) is None


def test_shadowing_matcher_from_the_import_frame(fake_recipe):
    # a stray transformers.py that is a script: it fails in its own code when the runner imports it
    (fake_recipe / "transformers.py").write_text("import sys\nprint(open(sys.argv[2]).read())\n")
    out = (f'Traceback (most recent call last):\n  File "{fake_recipe / "runner_fi.py"}", line 12, in <module>\n'
           f"    from transformers.cache_utils import DynamicCache\n"
           f'  File "{fake_recipe / "transformers.py"}", line 2, in <module>\n'
           f"    print(open(sys.argv[2]).read())\nIndexError: list index out of range\n")
    assert rule_named("recipe_file_shadows_stdlib_or_package").match(Failure.from_output(fake_recipe, out)) == {
        "file": "transformers.py", "module": "transformers"}
    # the same error raised by a recipe helper the runner imports under its own name is not shadowing
    (fake_recipe / "helpers.py").write_text("raise IndexError\n")
    own = out.replace("transformers.cache_utils import DynamicCache", "helpers import x").replace(
        "transformers.py", "helpers.py")
    (fake_recipe / "transformers.py").unlink()
    assert rule_named("recipe_file_shadows_stdlib_or_package").match(Failure.from_output(fake_recipe, own)) is None
