"""Upstream's docs/common/new_model_checklist.md as a test (issue #35.7): every item a program can check
(agent/recipe/checklist.py) on every framework recipe this file migrates (stop_after="render", as
tests/e2e/test_framework_target.py does: a tiny llama and one checkpoint per family of the routing table).

Items another change delivers are strict xfails naming it (they turn into failures once it lands, to be
unmarked). The items left to a person are checklist.PERSON."""

from __future__ import annotations

import re
import shutil

import pytest
import yaml

from agent.recipe import checklist
from framework_recipes import FAMILIES, family_checkout, migrate_family, migrated  # noqa: F401
from upstream_checkout import _git, copy_checkout  # noqa: F401
from locations import REPO_ROOT

# checklist items whose fix is another part of issue #35 (on another branch when this was written)
PENDING: dict[str, str] = {}
RECIPES = ["llama", *(p.values[0] for p in FAMILIES)]


@pytest.fixture(scope="module")
def recipes(request, migrated, family_checkout):
    out = {"llama": migrated["recipe"]}
    for param in FAMILIES:
        model_type, overrides, family = param.values
        out[model_type] = migrate_family(family_checkout, model_type, overrides, family)[0]
    return out


@pytest.fixture(scope="module")
def results(recipes):
    return {name: checklist.check_recipe(path) for name, path in recipes.items()}


@pytest.mark.parametrize("item", [pytest.param(item, marks=pytest.mark.xfail(reason=PENDING[item], strict=True))
                                  if item in PENDING else item for item in checklist.ITEMS])
@pytest.mark.parametrize("recipe", RECIPES)
def test_framework_recipe_passes_the_checklist_item(results, recipe, item):
    problems = results[recipe][item]
    assert problems == [], f"{checklist.ITEMS[item][0]}: {problems}"


def test_every_item_of_upstreams_checklist_is_checked_or_left_to_a_person():
    """The checklist's own sections, each covered by a check or a PERSON line (a new section upstream fails here)."""
    text = (REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer" / "docs"
            / "common" / "new_model_checklist.md")
    if not text.is_file():
        pytest.skip("no upstream snapshot")
    sections = re.findall(r"^# ([一二])、.*$|^## (\d+)\. ", text.read_text(), re.M)
    covered, part = set(), None
    for big, small in sections:
        if big:
            part = big
        else:
            covered.add(f"{part}.{small}")
    ids = {".".join(i.split(".")[:2]) for i in (*checklist.ITEMS, *(p for p, _ in checklist.PERSON))}
    assert covered == ids, (sorted(covered - ids), sorted(ids - covered))
    assert len(re.findall(r"^- \[ \]", text.read_text(), re.M)) == 30     # the items this module was written from


def _mutations():
    def yaml_edit(fn):
        def edit(recipe):
            path = recipe / "config" / f"{recipe.name}.yaml"
            data = yaml.safe_load(path.read_text())
            fn(data)
            path.write_text(yaml.safe_dump(data))
        return edit

    def text_edit(rel, fn):
        def edit(recipe):
            path = recipe / rel.format(name=recipe.name)
            path.write_text(fn(path.read_text()))
        return edit

    framework = "models/modeling_{name}.py"          # llama's framework model: the native one
    return {
        "一.1.files": lambda r: (r / "models" / f"configuration_{r.name}.py").unlink(),
        "一.1.yaml_keys": yaml_edit(lambda d: d["scheduler_config"].pop("max_prefill_tokens")),
        "一.2.kv_cache": text_edit(framework, lambda t: t.replace("def get_cache_info(", "def cache_info_gone(")),
        "一.5.pd_yamls": lambda r: (r / "config" / f"{r.name}_pd" / "decode.yaml").unlink(),
        "一.4.npugraph_ex_yaml": yaml_edit(lambda d: d["model_config"].update(exe_mode="eager")),
        "二.4.few_yamls": lambda r: (r / "config" / f"{r.name}_eager.yaml").write_text(
            (r / "config" / f"{r.name}.yaml").read_text().replace('exe_mode: "npugraph_ex"', 'exe_mode: "eager"')),
        "二.4.placeholder_paths": yaml_edit(lambda d: d["model_config"].update(model_path="/data/models/tiny_llama")),
        "二.1.versions": text_edit("requirements.txt", lambda t: re.sub(r"^torch==.*$", "torch>=2.4", t, flags=re.M)
                                   + "tiktoken==0.9.0\n"),
        "二.2.environment_variables": text_edit(framework, lambda t: t + "\nimport os\nSWITCH = os.environ.get('MY_SWITCH')\n"),
        "二.3.readme": text_edit("README.md", lambda t: t.replace("## 环境准备", "## Setup")),
        "二.4.custom_params": yaml_edit(lambda d: d["data_config"].update(my_flag=True)),
        "二.5.quantization": yaml_edit(lambda d: d["model_config"].update(quant_mode="w8a8")),
        "二.6.naming": yaml_edit(lambda d: d["model_config"].update(model_name="TinyLlama")),
        "二.7.public_code": lambda r: (r.parent.parent / "executor" / "extra.py").write_text("x = 1\n"),
        "二.8.logging": text_edit(framework, lambda t: t + "\nlogging.basicConfig()\n"),
        "一.1.interface_contract": text_edit(framework, lambda t: t.replace("def load_weights(", "def _load_w(")),
    }


@pytest.mark.parametrize("item", sorted(_mutations()))
def test_each_check_finds_its_fault(migrated, tmp_path, item):
    """A copy of the llama recipe with one fault per item: that item reports it (no check that cannot fail)."""
    checkout = copy_checkout(tmp_path)
    recipe = checkout / "models" / migrated["recipe"].name
    shutil.copytree(migrated["recipe"], recipe)
    shutil.copy2(migrated["checkout"] / checklist.REGISTRY, checkout / checklist.REGISTRY)
    before = checklist.check_recipe(recipe)
    assert before[item] == [], before[item]
    _mutations()[item](recipe)
    assert checklist.check_recipe(recipe)[item], item
