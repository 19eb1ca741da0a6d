"""Targets as data (agent/recipe/targets.py): what differs by target is a column of its row, so no code
outside targets.py compares anything with a target's name, tests membership in a set of them, keys a
dict by them or looks a row up by a literal name. Walks every module of the product with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from agent.recipe.recipe import Recipe
from agent.recipe.targets import NOT_A_RECIPE, TARGETS, target_of
from locations import REPO_ROOT

ROOT = REPO_ROOT
PACKAGES = ("agent", "engine", "npu_standin", "scripts")
OWNER = ROOT / "agent" / "recipe" / "targets.py"
NAMES = frozenset(TARGETS) | {NOT_A_RECIPE.name}


def _names_in(node: ast.AST) -> set[str]:
    """The target names among the string constants directly in `node` (a tuple/list/set of them too)."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {item.value for item in items if isinstance(item, ast.Constant) and item.value in NAMES}


def target_name_branches(path: Path, root: Path = ROOT) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Compare):
            hits = set().union(*(_names_in(n) for n in (node.left, *node.comparators)))
        elif isinstance(node, ast.Dict):
            hits = set().union(*(_names_in(k) for k in node.keys if k is not None))
        elif isinstance(node, ast.Subscript):
            hits = _names_in(node.slice)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get" and node.args:
            hits = _names_in(node.args[0]) | set().union(*(_names_in(a) for a in node.args[1:]))
        else:
            continue
        found += [f"{path.relative_to(root)}:{node.lineno}: {name!r}" for name in sorted(hits)]
    return found


def test_no_code_outside_targets_py_branches_on_a_target_name():
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py")) if p != OWNER]
    assert len(files) > 50
    found = [hit for path in files for hit in target_name_branches(path)]
    assert found == []


def test_the_walk_finds_each_form_of_branch(tmp_path):
    """The checker itself: each form a branch on a name takes is reported (so the test above can fail)."""
    probe = tmp_path / "probe.py"
    probe.write_text('if kind == "framework": pass\n'
                     'if kind in ("standalone", "legacy"): pass\n'
                     'x = {"legacy": 1}\n'
                     'row = TARGETS["standalone"]\n'
                     'row = TARGETS.get(kind, TARGETS["standalone"])\n'
                     'ok = kind == "checkpoint"\n')
    found = target_name_branches(probe, tmp_path)
    assert [line.split(":", 1)[1] for line in found] == [
        "1: 'framework'", "2: 'legacy'", "2: 'standalone'", "3: 'legacy'", "4: 'standalone'",
        "5: 'standalone'"]


@pytest.mark.parametrize("make", ["checkpoint", "readme_only", "nothing"])
def test_a_folder_that_is_no_recipe_gets_the_not_a_recipe_row(tmp_path, make):
    folder = tmp_path / "f"
    folder.mkdir()
    if make == "checkpoint":
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"")
    elif make == "readme_only":
        (folder / "README.md").write_text("# a model\n")
    found = Recipe.at(folder)
    assert found.target is NOT_A_RECIPE and not found.is_recipe and target_of(found.kind) is NOT_A_RECIPE
    with pytest.raises(Exception, match="not a recipe"):
        found.target.launch(found, folder / "x.yaml")
    # a YAML it holds is still read, in either schema (a repair reads it)
    assert NOT_A_RECIPE.schema.world_size({"parallel_config": {"world_size": 2}}) == 2
    assert NOT_A_RECIPE.schema.world_size({"world_size": 4}) == 4


def test_each_row_answers_what_differs_by_target():
    """The columns that replaced the branches: a change of one row's value is a change of behaviour."""
    standalone, legacy, framework = TARGETS["standalone"], TARGETS["legacy"], TARGETS["framework"]
    assert standalone.code_check and not legacy.code_check and not framework.code_check
    assert framework.log_style == "executor" and legacy.log_style == standalone.log_style == "runner"
    assert legacy.standin_runnable and framework.standin_runnable and not standalone.standin_runnable
    assert standalone.runs_own_infer_sh and legacy.runs_own_infer_sh and not framework.runs_own_infer_sh
    assert framework.model_path_placeholder == legacy.model_path_placeholder == "your_model_path"
    assert standalone.model_path_placeholder is None           # a standalone recipe runs by itself, anywhere
    data = {"model_config": {"model_path": "your_model_path"}, "parallel_config": {"world_size": 2},
            "scheduler_config": {"max_new_tokens": 8}, "data_config": {"input_truncated_len": 64}}
    assert framework.schema.settings(data)["max_new_tokens"] == 8 and framework.schema.world_size(data) == 2
    assert standalone.schema.settings(data)["max_new_tokens"] is None      # the flat schema has none there
    assert legacy.schema.settings(data)["max_new_tokens"] == 8             # a legacy folder's YAML: either schema
    assert framework.schema.set({}, "model_path", "/w") == {"model_config": {"model_path": "/w"}}
    assert standalone.schema.set({}, "model_path", "/w") == {"model_path": "/w"}
    # either schema keeps a YAML's own form: the key where it is, else where its section is
    assert legacy.schema.set({"model_path": "x", "model_config": {"dtype": "bf16"}}, "model_path", "/w") == \
        {"model_path": "/w", "model_config": {"dtype": "bf16"}}
    assert legacy.schema.set({"data_config": {}}, "input_len", 8) == {"data_config": {"input_truncated_len": 8}}
    assert legacy.schema.set({"model_config": {"model_name": "m"}}, "model_path", "/w") == \
        {"model_config": {"model_name": "m", "model_path": "/w"}}


def test_the_launch_line_a_person_is_told_is_the_targets_own(tmp_path):
    """The out-of-memory message and README (agent.measure.memory.out_of_memory) give Target.launch_line:
    a framework recipe is run by the checkout's entry point from the checkout's root, never by the
    standalone `bash infer.sh`."""
    from types import SimpleNamespace

    checkout = tmp_path / "checkout"
    recipe = SimpleNamespace(path=checkout / "models" / "m", repo_root=checkout, yaml=None)
    assert TARGETS["framework"].launch_line(recipe, "m_rank_2_2tp.yaml") == \
        f"cd {checkout} && bash executor/scripts/infer.sh --model m --yaml m_rank_2_2tp.yaml"
    assert TARGETS["legacy"].launch_line(recipe, "m_rank_2_2tp.yaml") == \
        f"cd {checkout} && YAML_FILE=config/m_rank_2_2tp.yaml bash models/m/infer.sh"
    own = SimpleNamespace(path=tmp_path / "ours", repo_root=None, yaml=None)
    assert TARGETS["standalone"].launch_line(own, "ours_2card_eager.yaml") == \
        f"cd {tmp_path / 'ours'} && YAML_FILE=config/ours_2card_eager.yaml bash infer.sh"
