"""agent/repair/rules/files.py in-process: the rules on a recipe's files and layout, their matchers on sample
outputs and their fixes. The same faults injected into a working recipe and repaired by `migrator run`:
tests/e2e/test_repair_files_faults.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.repair.failure import Failure
from agent.repair.diagnose import rule_named
from agent.repair.rules import files
from migrator_cli import first_match_name as _first_match_name


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
