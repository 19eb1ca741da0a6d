"""Framework and legacy recipes migrated (up to the rendered recipe) into a copy of the snapshot, shared by the
tests of the targets, the checklist, requirements and off-NPU answers; the checks of a native model file and
the two-prompt YAML."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from agent.recipe.recipe import Recipe
from agent.recipe.targets import REGISTRY
from agent.measure import reference as upstream
from upstream_checkout import copy_checkout


PROMPTS = ["An attention function can be described as mapping a query and a set of key-value pairs to an "
           "output, where the query, keys, values, and output are all vectors. The output is",
           "The capital of France is"]


MAX_NEW_TOKENS = 8


# The recipes here are vendored from the installed transformers (the tested newest release; `make test-tf50`
# runs them on 5.0.0); tests/e2e/test_recipe_on_transformers_5_0.py vendors from the checkout's pin.
INSTALLED = {"transformers_source": "installed"}


# ---- the framework target on a copy of the snapshot ---------------------------------------------
@pytest.fixture(scope="module")
def migrated(tmp_path_factory):
    """A tiny llama migrated into a copy of the snapshot up to the rendered recipe (no run)."""
    from agent.workflow.run import run_migration

    root = tmp_path_factory.mktemp("framework")
    checkout = copy_checkout(root)
    registry_before = (checkout / REGISTRY).read_bytes()
    checkpoint = upstream.tiny_checkpoint("llama", root / "tiny_llama_ckpt")
    summary = run_migration({"target": str(checkpoint), "output_dir": str(checkout / "models"), "name": "tiny_llama",
                             "device": "cpu", "max_new_tokens": MAX_NEW_TOKENS, "max_rounds": 0, "world_size": 1,
                             "recipe_target": None, **INSTALLED}, stop_after="render")
    assert summary["recipe_dir"] == str(checkout / "models" / "tiny_llama")
    return {"checkout": checkout, "checkpoint": checkpoint, "recipe": checkout / "models" / "tiny_llama",
            "registry_before": registry_before, "root": root}


FORBIDDEN_RUNTIME = ("PreTrainedModel", "GenerationMixin", "DynamicCache", "create_causal_mask",
                     "ALL_ATTENTION_FUNCTIONS", "use_kernel_forward_from_hub", "GradientCheckpointingLayer")


def check_native_model(path: Path) -> None:
    """A native framework model: transformers imported only for activations and rope initialisation,
    none of its runtime classes named, upstream's module.linear layers and the kvcache kernels."""
    import ast

    text = path.read_text()
    tree = ast.parse(text)
    transformers_imports = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                            and (node.module or "").startswith("transformers")}
    assert transformers_imports <= {"transformers.activations", "transformers.modeling_rope_utils"}, transformers_imports
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} | \
        {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not names & set(FORBIDDEN_RUNTIME), names & set(FORBIDDEN_RUNTIME)
    assert "Cache" not in names and "past_key_values" not in text
    # MLA writes its latent cache and rope in one kernel; the others project q/k/v and scatter into the cache
    attention = ("npu_kv_rmsnorm_rope_cache_v2", "npu_interleave_rope") if "npu_kv_rmsnorm_rope_cache_v2" in text \
        else ("QKVParallelLinear", "npu_scatter_nd_update_", "npu_apply_rotary_pos_emb")
    for needed in (*attention, "MergedColumnParallelLinear", "RowParallelLinear", "ColumnParallelLinear",
                   "npu_rms_norm", "npu_add_rms_norm",
                   "def get_cache_info", "def load_weights", "def process_weights_after_loading", "cache_entries",
                   '"attn_tp_group"', '"lmhead_tp_group"', "Adapted from"):
        assert needed in text, needed


def two_prompt_yaml(recipe: Path, tmp_path: Path, world_size: int, checkpoint: Path, exe_mode: str = "eager") -> str:
    """The recipe's YAML (N cards: as `Recipe.yaml_for` writes it) on `checkpoint` (its model_path is
    upstream's placeholder) in `exe_mode`, on a batch of two prompts of unequal length (upstream's
    data_config.dataset_path: a folder with default_prompt.json)."""
    prompts = tmp_path / "prompts"
    prompts.mkdir(exist_ok=True)
    (prompts / "default_prompt.json").write_text(json.dumps({"text": PROMPTS}))
    source = Recipe.at(recipe).yaml_for(world_size, write=True)
    data = yaml.safe_load(source.read_text())
    assert data["model_config"]["model_path"] == "your_model_path"
    data["model_config"].update(model_path=str(checkpoint), exe_mode=exe_mode)
    data["data_config"]["dataset_path"] = str(prompts)
    data["scheduler_config"]["batch_size"] = 2
    name = f"{source.stem}_{exe_mode}_two_prompts.yaml"
    (recipe / "config" / name).write_text(yaml.safe_dump(data, sort_keys=False))
    return name


# ---- the other families of the routing table ---------------------------------------------------
FAMILIES = [
    pytest.param("qwen3_moe", {}, "moe", id="moe-qwen3_moe"),
    # as DeepSeek-V3's own config (128 / 128): transformers' sdpa GQA packing assumes num_key_value_heads
    # key heads, which MLA's expanded keys do not have, so a padded batch fails with 4 heads over 2
    pytest.param("deepseek_v3", {"num_key_value_heads": 4}, "mla", id="mla-deepseek_v3"),
    pytest.param("mistral", {"sliding_window": 16}, "sliding_window", id="sliding_window-mistral"),  # < the prompts
]


@pytest.fixture(scope="module")
def family_checkout(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {"root": root, "checkout": copy_checkout(root), "migrated": {}}


def migrate_family(family_checkout, model_type: str, overrides: dict, family: str) -> tuple[Path, Path]:
    from agent.workflow.run import run_migration

    if model_type not in family_checkout["migrated"]:
        root, checkout = family_checkout["root"], family_checkout["checkout"]
        checkpoint = upstream.tiny_checkpoint(model_type, root / f"ckpt_{model_type}", **overrides)
        name = f"tiny_{family}"
        run_migration({"target": str(checkpoint), "output_dir": str(checkout / "models"), "name": name,
                       "device": "cpu", "max_new_tokens": MAX_NEW_TOKENS, "max_rounds": 0, "world_size": 1,
                       "recipe_target": "framework", **INSTALLED}, stop_after="render")
        family_checkout["migrated"][model_type] = (checkout / "models" / name, checkpoint)
    return family_checkout["migrated"][model_type]


# ---- architectures the native generator does not write: the adapter -----------------------------
# scripts/native_coverage.py's fall-backs, one per layer kind the maintainers' report (2026-12-05) found
# failing: the recipe keeps the vendored transformers model behind models/modeling_NAME_framework.py.
# Every earlier example (nanochat, minimax, beam, modernbert-decoder) is native now. Of the fall-backs left on
# transformers 5.24.0, measured 2026-12-06: axk2 (an indexer key cache), inkling_text (a conv state), longcat_flash
# (its rotary widths) and cpmant stop in the adapter's run; doge, jetmoe and hrm_text run, npugraph_ex, compiled
# once, but their text is not transformers'. doge stands for them: everything but its text is held as for any
# adapter, and its text must differ (ADAPTER_TEXT_DIFFERS) until the adapter serves it, when the test says so.
ADAPTER_TEXT_DIFFERS = {"doge"}         # not yet diagnosed
ADAPTERS = [
    # its own residual weights and a dynamic attention mask
    pytest.param("doge", "decoder layer", id="residual_weights-doge"),
]


def migrate_adapter(family_checkout, model_type: str) -> tuple[Path, Path]:
    """`model_type` migrated into the families' checkout up to the rendered recipe (`ad_<type>`); its
    report says the native generator fell back."""
    from agent.workflow.run import run_migration

    key = f"adapter:{model_type}"
    if key not in family_checkout["migrated"]:
        root, checkout = family_checkout["root"], family_checkout["checkout"]
        checkpoint = upstream.tiny_checkpoint(model_type, root / f"ckpt_{model_type}")
        name = f"ad_{model_type.replace('-', '_')}"       # the recipe name the migrator writes
        run_migration({"target": str(checkpoint), "output_dir": str(checkout / "models"), "name": name,
                       "device": "cpu", "max_new_tokens": MAX_NEW_TOKENS, "max_rounds": 0, "world_size": 1,
                       "recipe_target": "framework", **INSTALLED}, stop_after="render")
        family_checkout["migrated"][key] = (checkout / "models" / name, checkpoint)
    return family_checkout["migrated"][key]


# ---- the legacy target: a ModelRunner recipe as models/pangu_7b ---------------------------------
@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    from agent.workflow.run import run_migration

    root = tmp_path_factory.mktemp("legacy")
    checkout = copy_checkout(root)
    checkpoint = upstream.tiny_checkpoint("llama", root / "ckpt")
    run_migration({"target": str(checkpoint), "output_dir": str(checkout / "models"), "name": "leg_llama",
                   "device": "cpu", "max_new_tokens": MAX_NEW_TOKENS, "max_rounds": 0, "world_size": 1,
                   "recipe_target": "legacy", **INSTALLED}, stop_after="render")
    return {"checkout": checkout, "checkpoint": checkpoint, "recipe": checkout / "models" / "leg_llama"}
