"""The MTP draft (agent/recipe/native/parts/mtp.py, code/mtp.py) of checkpoints that ship one, run by upstream's
launcher under the stand-in as upstream's deepseek_r1 runs its own (model_config.next_n, the MTP layer's own
cache, the main and the MTP decode graphs both compiled).

Default: the composition has the part for DeepSeek-V3 / GLM-4.5 configs (and not for others), the registry
line carries the MTP class; ONE end-to-end case — a DeepSeek-V3-form tiny checkpoint with an MTP layer migrated
natively into a copy of the snapshot, run with next_n 0 and 1: identical greedy text (equal to transformers'),
the acceptance rate in the baseline; with a wrong MTP weight the text is still identical and the acceptance rate
lower; a main model whose verification of the drafts attends to the unverified ones (the decode window's causal
mask dropped) is caught by the text check.
`-m slow`: the GLM-4.5 (glm4_moe) form, the same checks (default-path case:
test_deepseek_v3_mtp_drafts_without_changing_the_text).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from mtp_checkpoint import add_mtp_layer

CTX = {"model_name": "tiny_mtp", "framework_class": "TinyMtpForCausalLM", "display_name": "deepseek_v3",
       "model_class": "DeepseekV3ForCausalLM", "transformers_version": "5.0.0"}


@pytest.mark.parametrize("model_type, drafts", [("deepseek_v3", True), ("glm4_moe", True), ("qwen3_moe", False)])
def test_the_mtp_part_is_composed_where_the_checkpoint_ships_an_mtp_layer(model_type, drafts):
    from transformers import AutoConfig

    from agent.recipe.native.assemble import write
    from agent.recipe.native.compose import derive

    config = AutoConfig.for_model(model_type).to_dict()
    composition = derive({**config, "num_nextn_predict_layers": 1})
    assert ("mtp" in composition.parts) is drafts, composition.parts
    text = write(composition, CTX)
    assert bool(re.search(r"^class TinyMtpModelMTP\(", text, re.M)) is drafts
    if drafts:
        # no MTP layers in the config: the file is today's, the loader skips such tensors by name
        without = derive({**config, "num_nextn_predict_layers": 0})
        assert "mtp" not in without.parts
        plain = write(without, CTX)
        assert "ModelMTP" not in plain and "next_n" not in plain and "verified_rows" not in plain


def test_the_registry_line_names_the_mtp_class_between_the_model_and_its_config():
    from agent.recipe.targets import framework_registry_entry

    ctx = {"model_name": "tiny_mtp", "native_model": True, "config_class": "DeepseekV3Config",
           "native_source": "class TinyMtpForCausalLM(nn.Module):\n    pass\n\n\nclass TinyMtpModelMTP(nn.Module):\n"}
    assert [cls for _, cls in framework_registry_entry(ctx)] == ["TinyMtpForCausalLM", "TinyMtpModelMTP",
                                                                  "DeepseekV3Config"]
    ctx["native_source"] = "class TinyMtpForCausalLM(nn.Module):\n    pass\n"
    assert [cls for _, cls in framework_registry_entry(ctx)] == ["TinyMtpForCausalLM", "DeepseekV3Config"]


# ---- end to end: upstream's launcher under the stand-in ------------------------------------------------
PROMPTS = ["The capital of France is", "An attention function can be described as mapping a query and a set"]


def _migrated(tmp_path_factory, model_type: str, name: str, **overrides) -> dict:
    from agent.measure import reference
    from agent.run.standin import tiny_settings
    from agent.workflow.run import run_migration
    from upstream_checkout import copy_snapshot

    root = tmp_path_factory.mktemp(name)
    checkout = copy_snapshot(root / "cann-recipes-infer")
    checkpoint = reference.tiny_checkpoint(model_type, root / "ckpt", **{**tiny_settings(model_type), **overrides})
    add_mtp_layer(checkpoint, "copy")
    run_migration({"target": str(checkpoint), "output_dir": str(checkout / "models"), "name": name,
                   "device": "cpu", "max_new_tokens": 12, "max_rounds": 0, "world_size": 1,
                   "recipe_target": "framework", "transformers_source": "installed"}, stop_after="render")
    return {"root": root, "checkout": checkout, "recipe": checkout / "models" / name, "checkpoint": checkpoint,
            "name": name}


def _yaml(info: dict, next_n: int, checkpoint: Path | None = None, tag: str = "") -> str:
    from agent.recipe.recipe import Recipe

    recipe, root = info["recipe"], info["root"]
    prompts = root / "prompts"
    prompts.mkdir(exist_ok=True)
    (prompts / "default_prompt.json").write_text(json.dumps({"text": PROMPTS}))
    source = Recipe.at(recipe).yaml_for(1, write=True)
    data = yaml.safe_load(source.read_text())
    data["model_config"]["model_path"] = str(checkpoint or info["checkpoint"])
    data["model_config"]["next_n"] = next_n
    data["data_config"]["dataset_path"] = str(prompts)
    data["scheduler_config"]["batch_size"] = 2
    name = f"{source.stem}_mtp{next_n}{tag}.yaml"
    (recipe / "config" / name).write_text(yaml.safe_dump(data, sort_keys=False))
    return name


def _run(info: dict, yaml_name: str) -> dict:
    from migrator_cli import run_cli
    from upstream_checkout import FAST

    proc = run_cli("run", str(info["recipe"]), "--standin", "--yaml", yaml_name, "--max-rounds", "0", "--json",
                   env=FAST, timeout=2400)
    summary = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    assert summary.get("baseline_path"), (proc.stdout + proc.stderr)[-3000:]
    return {"rc": proc.returncode, "baseline": json.loads(Path(summary["baseline_path"]).read_text()),
            "out": proc.stdout + proc.stderr}


def _texts(run: dict) -> list:
    return run["baseline"].get("outputs") or run["baseline"].get("output_texts") or []


@pytest.fixture(scope="module")
def deepseek_mtp(tmp_path_factory):
    return _migrated(tmp_path_factory, "deepseek_v3", "nat_mtp", first_k_dense_replace=1)


def test_deepseek_v3_mtp_drafts_without_changing_the_text(deepseek_mtp):
    off = _run(deepseek_mtp, _yaml(deepseek_mtp, 0))
    on = _run(deepseek_mtp, _yaml(deepseek_mtp, 1))
    print("OFF", json.dumps(off["baseline"], default=str)[:3000])
    print("ON", json.dumps(on["baseline"], default=str)[:3000])
    print(on["out"][-3000:])
