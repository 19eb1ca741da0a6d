"""The MTP draft (agent/recipe/native/parts/mtp.py, code/mtp.py) of checkpoints that ship one, run by upstream's
launcher under the stand-in as upstream's deepseek_r1 runs its own (model_config.next_n, the MTP layer's own
cache, the main and the MTP decode graphs both compiled).

Default: the composition has the part for DeepSeek-V3 / GLM-4.5 configs (and not for others), the registry
line carries the MTP class; ONE end-to-end case — a DeepSeek-V3-form tiny checkpoint with an MTP layer migrated
natively into a copy of the snapshot, one run with next_n 1: every accepted token held to transformers per step,
the acceptance rate in the baseline.
`-m slow` (default-path case: test_deepseek_v3_mtp_run_holds_every_accepted_token_to_transformers): next_n 0 and 1
give identical greedy text; with a wrong MTP weight the text is still identical and the acceptance rate lower; a
main model whose verification of the drafts attends to the unverified ones (the decode window's causal mask
dropped) is caught; the same for the GLM-4.5 (glm4_moe) form.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from mtp_checkpoint import add_mtp_layer, repetitive

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


@pytest.mark.parametrize("stored, ships", [
    (["model.layers.0.mlp.down_proj.weight", "model.layers.2.eh_proj.weight"], True),
    (["model.layers.0.mlp.down_proj.weight"], False),                   # a copy that dropped the MTP layer
    (["model.layers.1.eh_proj.weight"], False),                         # not at num_hidden_layers
])
@pytest.mark.parametrize("index", [False, True])
def test_the_draft_is_written_only_for_a_checkpoint_that_holds_its_tensors(tmp_path, stored, ships, index):
    import torch
    from safetensors.torch import save_file

    from agent.recipe.native.parts.mtp import ships_mtp_layer, without_unshipped_mtp

    config = {"num_hidden_layers": 2, "num_nextn_predict_layers": 1}
    if index:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: "a.safetensors" for n in stored}}))
    else:
        save_file({n: torch.zeros(1) for n in stored}, str(tmp_path / "model.safetensors"))
    assert ships_mtp_layer(tmp_path, config) is ships
    assert without_unshipped_mtp(config, tmp_path)["num_nextn_predict_layers"] == (1 if ships else 0)
    assert ships_mtp_layer(tmp_path, {**config, "num_nextn_predict_layers": 0}) is False


def test_a_checkpoint_whose_header_is_not_safetensors_ships_no_draft(tmp_path):
    from agent.recipe.native.parts.mtp import ships_mtp_layer

    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    assert ships_mtp_layer(tmp_path, {"num_hidden_layers": 2, "num_nextn_predict_layers": 1}) is False
    (tmp_path / "model.safetensors").write_bytes(b"\x01")
    assert ships_mtp_layer(tmp_path, {"num_hidden_layers": 2, "num_nextn_predict_layers": 1}) is False


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
    add_mtp_layer(repetitive(checkpoint), "copy")
    run_migration({"target": str(checkpoint), "output_dir": str(checkout / "models"), "name": name,
                   "device": "cpu", "max_new_tokens": 12, "max_rounds": 0, "world_size": 1,
                   "recipe_target": "framework", "transformers_source": "installed"}, stop_after="render")
    return {"root": root, "checkout": checkout, "recipe": checkout / "models" / name, "checkpoint": checkpoint,
            "name": name, "model_type": model_type}


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
    return [(r["text"], r["tokens"]) for r in sorted(run["baseline"]["verification"]["parity"]["per_request"],
                                                     key=lambda r: r["request"])]


def _same_text(drafted: dict, plain: dict) -> bool:
    """Each request's tokens with drafts begin with its tokens without them (a request that finishes early is
    decoded on while another runs: more steps, each held to transformers by the per-step check), and the text
    the run logs begins with the one logged without drafts (an MTP step may accept one token past
    max_new_tokens: upstream's executor stops a request after the step that reaches it)."""
    pairs = list(zip(_texts(drafted), _texts(plain)))
    logged = [run["baseline"]["performance"]["output_text"] for run in (drafted, plain)]
    return len(pairs) == len(_texts(plain)) > 0 and all(
        base and text.startswith(base) and tokens >= base_tokens for (text, tokens), (base, base_tokens) in pairs) \
        and logged[0].startswith(logged[1])


# the decode attention's causal mask over the verified window (MLA; fused GQA), and the fault that drops it
UNMASKED = {
    "deepseek_v3": (("atten_mask=forward_metadata.attention_mask if window else None,", "atten_mask=None,"),
                    ("sparse_mode=3 if window else 0,", "sparse_mode=0,")),
    "glm4_moe": (("            mask, sparse_mode = forward_metadata.attention_mask, 3\n",
                  "            mask, sparse_mode = None, 0\n"),),
}


def _mtp_checks(info: dict) -> dict:
    """next_n 0 and 1 on the same checkpoint, next_n 1 with a wrong MTP weight, and a main model whose
    verification attends to the drafts it has not accepted yet: each run's baseline."""
    import shutil

    off = _run(info, _yaml(info, 0))
    on = _run(info, _yaml(info, 1))
    wrong_ckpt = info["root"] / "ckpt_wrong_mtp"
    shutil.copytree(info["checkpoint"], wrong_ckpt)
    add_mtp_layer(wrong_ckpt, "wrong")
    wrong = _run(info, _yaml(info, 1, wrong_ckpt, "_wrong"))
    model = info["recipe"] / "models" / f"modeling_{info['name']}.py"
    correct = model.read_text()
    unmasked_text = correct
    for causal, none in UNMASKED[info["model_type"]]:
        assert correct.count(causal) == 1, f"{causal} is not where the fault expects it"
        unmasked_text = unmasked_text.replace(causal, none)
    model.write_text(unmasked_text)
    try:
        unmasked = _run(info, _yaml(info, 1, tag="_fault"))
    finally:
        model.write_text(correct)
    return {"off": off, "on": on, "wrong": wrong, "unmasked": unmasked}


def _assert_mtp(runs: dict, family: str) -> None:
    off, on, wrong, unmasked = runs["off"], runs["on"], runs["wrong"], runs["unmasked"]
    # MTP off: today's run, held to transformers per step; no speculation figures
    assert off["rc"] == 0 and off["baseline"]["verification"]["parity"]["ok"] is True, off["out"][-2000:]
    assert "speculation" not in off["baseline"]["performance"]
    # MTP on: every token the executor accepted (drafts included) held to transformers, the same text
    parity = on["baseline"]["verification"]["parity"]
    assert on["rc"] == 0 and parity["ok"] is True, on["out"][-2000:]
    assert _same_text(on, off), (_texts(on), _texts(off), on["baseline"]["performance"]["output_text"],
                                 off["baseline"]["performance"]["output_text"])
    spec = on["baseline"]["performance"]["speculation"]
    assert spec["next_n"] == 1 and spec["draft_tokens"] > 0 and spec["accept_rate"] > 0.3, spec
    standin = on["baseline"]["standin"]
    compiled = {key: entry for key, entry in standin["compiles"].items() if "decode" in key}
    assert any(k.endswith("main_decode [npugraph_ex]") for k in compiled) and \
        any(k.endswith("mtp_decode [npugraph_ex]") for k in compiled), standin["compiles"]
    assert all(entry["recompiles"] == 0 for entry in compiled.values()), standin["compiles"]
    # a wrong MTP weight only drafts worse: the same text, a lower acceptance
    assert wrong["rc"] == 0 and wrong["baseline"]["verification"]["parity"]["ok"] is True, wrong["out"][-2000:]
    assert _same_text(wrong, off), (_texts(wrong), _texts(off))
    wrong_spec = wrong["baseline"]["performance"]["speculation"]
    assert wrong_spec["accept_rate"] < spec["accept_rate"], (wrong_spec, spec)
    # a verification that sees drafts it has not accepted (no causal mask over the window) is caught
    assert unmasked["baseline"]["verification"]["parity"]["ok"] is False and unmasked["rc"] != 0
    print(f"MTP-TABLE {family} next_n=1 texts_equal=True accept_rate={spec['accept_rate']:.4f} "
          f"accept_length={spec.get('accept_length')} drafts={spec['draft_tokens']} accepted={spec['accepted_tokens']} "
          f"wrong_mtp_accept_rate={wrong_spec['accept_rate']:.4f} unmasked_caught=True "
          f"unmasked_reason={unmasked['baseline']['verification']['parity'].get('reason')!r}")


def _deepseek_v3(tmp_path_factory) -> dict:
    """DeepSeek-V3 form (MLA, layer 1 and the MTP layer sparse-MoE), migrated; its registry line and YAML checked."""
    info = _migrated(tmp_path_factory, "deepseek_v3", "nat_mtp", first_k_dense_replace=1)
    registry = (info["checkout"] / "executor" / "core" / "support_models.py").read_text()
    assert '"NatMtpModelMTP"' in registry
    # the recipe's own YAML drafts one token per step (checklist 一.4: a registered MTP model has a YAML enabling it)
    from agent.recipe import checklist

    assert yaml.safe_load((info["recipe"] / "config" / "nat_mtp.yaml").read_text())["model_config"]["next_n"] == 1
    assert checklist.check_recipe(info["recipe"])["一.4.mtp"] == []
    return info


def test_deepseek_v3_mtp_run_holds_every_accepted_token_to_transformers(tmp_path_factory):
    """The default end-to-end case, one launcher run with next_n 1: every token the executor accepted (drafts
    included) held to transformers per step, the acceptance figures in the baseline, the main and MTP decode graphs
    each compiled once. The text equal to next_n 0's and the faults (a wrong MTP weight, an unmasked verification):
    `-m slow`, below."""
    info = _deepseek_v3(tmp_path_factory)
    on = _run(info, _yaml(info, 1))
    parity = on["baseline"]["verification"]["parity"]
    assert on["rc"] == 0 and parity["ok"] is True, on["out"][-2000:]
    spec = on["baseline"]["performance"]["speculation"]
    assert spec["next_n"] == 1 and spec["draft_tokens"] > 0 and 0 < spec["accepted_tokens"] <= spec["draft_tokens"]
    compiled = {key: entry for key, entry in on["baseline"]["standin"]["compiles"].items() if "decode" in key}
    assert any(k.endswith("main_decode [npugraph_ex]") for k in compiled) and \
        any(k.endswith("mtp_decode [npugraph_ex]") for k in compiled), compiled
    assert all(entry["recompiles"] == 0 for entry in compiled.values()), compiled


@pytest.mark.slow
def test_deepseek_v3_mtp_drafts_without_changing_the_text(tmp_path_factory):
    """DeepSeek-V3 form: next_n 0 and 1 give the same text, a wrong MTP weight drafts worse, an unmasked
    verification is caught (default-path case: test_deepseek_v3_mtp_run_holds_every_accepted_token_to_transformers)."""
    _assert_mtp(_mtp_checks(_deepseek_v3(tmp_path_factory)), "deepseek_v3")


@pytest.mark.slow
def test_glm4_moe_mtp_drafts_without_changing_the_text(tmp_path_factory):
    """GLM-4.5 form (glm4_moe: fused GQA attention, partial rotary, sparse-MoE from layer 1)."""
    info = _migrated(tmp_path_factory, "glm4_moe", "nat_glm_mtp", first_k_dense_replace=1)
    _assert_mtp(_mtp_checks(info), "glm4_moe")
