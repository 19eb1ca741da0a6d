"""One recipe spec, one YAML schema: the renderer, validation and repair defaults agree (README's key table
and the defaults' one home: tests/lint/test_one_home.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from agent.paths import demo_model_dir
from engine import defaults
from engine.config import KEY, KEYS, OBSOLETE, ConfigError, rendered_keys, validate
from locations import REPO_ROOT

ROOT = REPO_ROOT


def _structure(settings: dict) -> dict:
    """{section or None: [keys in order]} of a YAML mapping."""
    shape = {None: list(settings)}
    shape.update({k: list(v) for k, v in settings.items() if isinstance(v, dict)})
    return shape


def _demo_spec(tmp_path: Path, **options):
    from agent.recipe.routing import route
    from agent.recipe.spec import VENDORED_KEYS, RecipeSpec
    from agent.migrate.vendor import locate_source, read_config

    ckpt = tmp_path / "ckpt"
    shutil.copytree(demo_model_dir(), ckpt)
    config = read_config(ckpt)
    source = locate_source(config, ckpt)
    family = route(config.get("text_config") or config).name
    vendored = {"codemods": {"modeling_demo.py": ["AbsoluteImports"]}, **{k: getattr(source, k) for k in VENDORED_KEYS}}
    return RecipeSpec.for_checkpoint(model_name="demo", model_dir=ckpt, model_source="Org/Demo",
                                     architecture=source.architecture, family=family, vendored=vendored,
                                     config=config, **options), vendored


def _render(recipe: Path, spec) -> list[Path]:
    from agent.recipe.render import render_recipe

    return render_recipe(recipe, spec.context(), spec.family_spec())


def test_rendered_yaml_has_the_schema_keys_in_order_and_validates(tmp_path):
    spec, _ = _demo_spec(tmp_path, device="cpu")
    _render(tmp_path / "demo", spec)
    settings = yaml.safe_load((tmp_path / "demo" / "config" / "demo_1card_eager.yaml").read_text())
    assert _structure(settings) == {section: rendered_keys(section)
                                    for section in (None, "model_config", "data_config", "parallel_config")}
    assert settings == spec.settings()
    validate(settings)
    assert "enable_online_split_weight" not in settings["model_config"]
    assert settings["data_config"]["max_new_tokens"] == defaults.MAX_NEW_TOKENS
    assert settings["world_size"] == defaults.WORLD_SIZE and settings["exe_mode"] == "eager"


def test_old_recipe_yaml_with_an_obsolete_key_still_validates(tmp_path):
    """A recipe rendered by an earlier release wrote model_config.enable_online_split_weight."""
    old = {"model_name": "old", "model_path": "/m", "model_source": "/m", "exe_mode": "eager", "device": "auto",
           "world_size": 1,
           "model_config": {"dtype": "float32", "enable_online_split_weight": False, "attn_implementation": "sdpa"},
           "data_config": {"dataset": "default", "input_max_len": 1024, "max_new_tokens": 32, "batch_size": 1},
           "parallel_config": {"attn_tp_size": 1, "moe_tp_size": 1, "lmhead_tp_size": 1}}
    assert "model_config.enable_online_split_weight" in OBSOLETE
    validate(old)
    old["model_config"]["enable_online_split_weight"] = "yes, please"     # ignored whatever it holds
    validate(old)
    with pytest.raises(ConfigError, match="'model_config.dtype'"):       # the keys that count still do
        validate({**old, "model_config": {"enable_online_split_weight": True}})


def _readers() -> str:
    """Text of what reads a recipe YAML at run time: the engine, the recipe templates, the baseline
    collector (agent/measure/baseline.py, agent/measure/run_log.py)."""
    paths = [p for p in (ROOT / "engine").rglob("*.py") if p.name not in ("config.py", "defaults.py")]
    paths += [p for p in (ROOT / "templates").glob("*.j2") if p.name != "config.yaml.j2"]
    paths += [ROOT / "agent" / "measure" / "baseline.py", ROOT / "agent" / "measure" / "run_log.py"]
    return "\n".join(p.read_text() for p in paths)


@pytest.mark.parametrize("key", [k for k in KEYS if not k.is_section], ids=lambda k: k.name)
def test_every_schema_key_has_a_reader(key):
    # read by its leaf name (settings["leaf"]) or its dotted schema name (setting(settings, "section.leaf"))
    assert re.search(rf"""["'](?:{re.escape(key.name)}|{key.leaf})["']""", _readers()), \
        f"{key.name}: nothing reads it; implement or drop it"


def test_obsolete_keys_have_no_reader():
    for name in OBSOLETE:
        assert name.rpartition(".")[2] not in _readers()


def test_re_render_from_the_recipe_gives_the_same_files(tmp_path):
    """RecipeSpec.from_recipe (repair's re-render) rebuilds the spec node_render rendered from."""
    from agent.recipe.recipe import Recipe
    from agent.repair.recipe_spec import recipe_spec

    spec, vendored = _demo_spec(tmp_path, device="cpu", max_new_tokens=8)
    recipe = tmp_path / "demo"
    written = _render(recipe, spec)
    (recipe / "migration_report.json").write_text(json.dumps(
        {"model_name": "demo", "model_source": "Org/Demo", "architecture": spec.architecture, "family": spec.family,
         "model_dir": spec.model_path, "vendored": vendored, "env": {"device": "cpu"}}))
    rebuilt = recipe_spec(Recipe.at(recipe))
    assert rebuilt.settings() == spec.settings()
    again = tmp_path / "again"
    for path in _render(again, rebuilt):
        assert path.read_text() == (recipe / path.relative_to(again)).read_text(), path.name
    assert len(written) == len(list(again.rglob("*.*")))


def test_repair_defaults_come_from_the_spec_and_fit_the_checkpoint(tmp_path):
    """A YAML with keys missing: the defaults are the spec's, and max_new_tokens fits beside the
    prompt budget the YAML keeps (the checkpoint has 512 positions)."""
    from agent.recipe.recipe import Recipe
    from agent.repair.rules.config import template_defaults

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                  "max_position_embeddings": 512, "torch_dtype": "bfloat16"}))
    recipe = tmp_path / "fi"
    (recipe / "config").mkdir(parents=True)
    (recipe / "config" / "fi_1card_eager.yaml").write_text(yaml.safe_dump(
        {"model_name": "fi", "model_path": str(ckpt), "device": "cuda", "model_config": {"dtype": 7},
         "data_config": {"input_max_len": 500}}))
    found = template_defaults(Recipe.at(recipe))
    assert found["data_config.max_new_tokens"] == 12                  # 512 - 500
    assert found["data_config.input_max_len"] == 500                  # kept
    assert found["model_config.dtype"] == "bfloat16"                  # the checkpoint's (not on CPU: device cuda)
    assert found["model_path"] == str(ckpt.resolve()) and found["device"] == "cuda"
    assert {k: found[k] for k in ("exe_mode", "world_size", "data_config.batch_size", "parallel_config.attn_tp_size")} \
        == {"exe_mode": "eager", "world_size": 1, "data_config.batch_size": 1, "parallel_config.attn_tp_size": 1}
    assert set(found) <= {k.name for k in KEYS}


def test_the_engine_reads_settings_through_the_schema_defaults():
    from engine.config import setting

    settings = {"model_config": {"dtype": "bfloat16"}, "data_config": {"max_new_tokens": 7}}
    assert setting(settings, "model_config.dtype") == "bfloat16"
    assert setting(settings, "data_config.max_new_tokens") == 7
    # Not in the YAML: the schema's default, the one the migrator writes.
    assert setting(settings, "data_config.input_max_len") == KEY["data_config.input_max_len"].default
    assert setting(settings, "exe_mode") == "eager" and setting(settings, "parallel_config.attn_tp_size") == 1
    # A required key the schema has no default for is named, not guessed.
    with pytest.raises(ConfigError, match="model_config.dtype"):
        setting({}, "model_config.dtype")
