"""agent/recipe/targets.py, the targets as rows: what differs by target is a column of its row or a method on it
(the walk that holds every other module to it: tests/lint/test_target_names.py); the row of a folder that is
no recipe; the default target by the output folder."""

from __future__ import annotations

import pytest

from agent.errors import InputError
from agent.recipe.recipe import Recipe
from agent.recipe.targets import (NOT_A_RECIPE, REGISTRY, TARGETS, choose_target, default_target, state_dir,
                                  target_of)


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
    assert standalone.recipe_checks == ("vendored_code",) and legacy.recipe_checks == framework.recipe_checks == ()
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


def test_default_target_follows_the_output_dir(tmp_path):
    fake = tmp_path / "co"
    (fake / REGISTRY).parent.mkdir(parents=True)
    (fake / REGISTRY).write_text("_specs = {}\n")
    (fake / "models").mkdir()
    assert default_target(tmp_path / "out") == "standalone"
    assert default_target(fake / "models") == "framework"
    assert choose_target(None, fake / "models") == "framework"
    assert choose_target("standalone", fake / "models") == "standalone"
    with pytest.raises(InputError, match="inside a cann-recipes-infer checkout"):
        choose_target("framework", tmp_path / "out")
    with pytest.raises(InputError, match="models/ folder"):
        choose_target("framework", fake)
    assert choose_target("legacy", fake / "models") == "legacy"
    with pytest.raises(InputError, match="inside a cann-recipes-infer checkout"):
        choose_target("legacy", tmp_path / "out")
    # where our state goes: .migrator/ outside a checkout, res/.migrator/ (ignored upstream) inside
    assert state_dir(tmp_path / "out" / "m") == tmp_path / "out" / "m" / ".migrator"
    assert state_dir(fake / "models" / "m") == fake / "models" / "m" / "res" / ".migrator"


def test_every_rendered_target_has_its_templates():
    from agent.paths import templates_dir

    for target in TARGETS.values():
        for template in target.files():
            assert (templates_dir() / template).is_file(), (target.name, template)


def one_row_flags(rows) -> list[str]:
    """The boolean columns true for exactly one row: that row's name under another name."""
    from dataclasses import fields

    from agent.recipe.targets import Target

    flags = [f.name for f in fields(Target) if isinstance(getattr(rows[0], f.name), bool)]
    return [flag for flag in flags if sum(bool(getattr(row, flag)) for row in rows) == 1]


def test_no_boolean_column_is_one_rows_name_under_another_name():
    """What only one target does is that row's behaviour (a function or data on it), not a flag read elsewhere;
    the check finds a planted one."""
    from dataclasses import fields, replace

    from agent.recipe.targets import Target

    rows = list(TARGETS.values())
    assert one_row_flags(rows) == []
    booleans = [f.name for f in fields(Target) if isinstance(getattr(rows[0], f.name), bool)]
    assert booleans and set(booleans) <= {"inside_checkout", "standin_runnable", "is_recipe"}, booleans
    planted = [replace(rows[0], inside_checkout=True), *(replace(row, inside_checkout=False) for row in rows[1:])]
    assert one_row_flags(planted) == ["inside_checkout"]


def test_what_one_target_does_is_its_rows_behaviour(tmp_path):
    """The framework row adds a registry line, refuses a checkpoint without a chat template and names the old flat
    YAML keys its executor ignores, and its recipes run under their folder's name; the standalone row renders the
    family's runner; the others do none of it."""
    import pytest

    from agent.errors import InputError
    from agent.recipe.recipe import Recipe
    from agent.recipe.routing import FAMILIES

    standalone, legacy, framework = TARGETS["standalone"], TARGETS["legacy"], TARGETS["framework"]
    ctx = {"model_name": "tiny", "native_model": True, "config_class": "LlamaConfig"}
    assert framework.registry_entry(ctx)[0] == ("models.tiny.models.modeling_tiny", "TinyForCausalLM")
    assert standalone.registry_entry is None and legacy.registry_entry is None
    family = FAMILIES["standard"]
    assert standalone.family_files("tiny", family) == {"runner_tiny.py": family.runner_template}
    assert framework.family_files("tiny", family) == legacy.family_files("tiny", family) == {}
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "tokenizer_config.json").write_text("{}")
    with pytest.raises(InputError, match="no chat template"):
        framework.check_checkpoint(checkpoint)
    standalone.check_checkpoint(checkpoint), legacy.check_checkpoint(checkpoint)     # plain prompts: accepted
    (checkpoint / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    framework.check_checkpoint(checkpoint)
    yaml = tmp_path / "flat.yaml"
    yaml.write_text("model_name: tiny\nworld_size: 1\n")
    assert standalone.ignored_yaml_keys(yaml, None, "flat.yaml") == legacy.ignored_yaml_keys(yaml, None, "x") == []
    # a framework recipe whose runner file names it otherwise still runs as its folder
    folder = tmp_path / "models" / "folder_name"
    folder.mkdir(parents=True)
    (folder / "runner_other.py").write_text("")
    assert Recipe("framework", folder).model_name == "folder_name"
    assert Recipe("legacy", folder).model_name == Recipe("standalone", folder).model_name == "other"


@pytest.mark.parametrize("experts,native,moe_tp", [(8, True, 1), (6, True, 2), (8, False, 4), (None, True, 1)],
                         ids=["moe-native-ep4", "moe-native-6-experts-tp2-ep2", "moe-adapter-tp", "dense-native"])
def test_a_fresh_n_card_framework_yaml_lays_a_native_moe_models_experts_out_expert_parallel(tmp_path, experts, native,
                                                                                           moe_tp):
    """`migrator run CKPT --world-size 4`: the rendered N-card YAML of a native MoE model is upstream's expert-parallel
    layout (moe_ep_size = world_size // moe_tp_size dividing the routed experts), the PD pair too; the adapter's
    vendored code splits experts by its own tensor-parallel plan, a dense model has no experts."""
    import json

    from agent.recipe.render import template_context
    from agent.recipe.routing import route
    from agent.recipe.targets import TARGETS

    config = {"model_type": "qwen3_moe" if experts else "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "intermediate_size": 128}
    if experts:
        config.update(num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=32)
    (tmp_path / "config.json").write_text(json.dumps(config))
    ctx = {"model_name": "tiny", "model_path": str(tmp_path), "world_size": 4, "input_max_len": 64, "max_new_tokens": 8,
           "native_decision": {"native": native, "parts": {}}, "native_source": "# the file" if native else None}
    out = template_context(ctx, route(config), TARGETS["framework"])
    for settings in (out["settings"], out["pd_settings"]["decode"], out["pd_settings"]["prefill"]):
        parallel = settings["parallel_config"]
        assert (parallel["world_size"], parallel["attn_tp_size"], parallel["moe_tp_size"]) == (4, 4, moe_tp), parallel
    assert ("experts expert parallel over" in out["yaml_list"]) == bool(experts and native)
