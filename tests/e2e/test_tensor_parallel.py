"""Tensor parallel on CPU (gloo, torchrun): the vendored classes sharded by the model's own plan give
the single-process logits and greedy tokens; each rank holds 1/N of the sharded weights."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from locations import REPO_ROOT

PROBE = REPO_ROOT / "tests" / "support" / "tp_probe.py"


def vendor_recipe(ckpt: Path, out: Path, name: str) -> Path:
    """Vendor + render a recipe in-process (no trial run): the graph `migrator run` runs, stopped after render."""
    from agent.workflow.run import run_migration

    state = {"target": str(ckpt), "output_dir": str(out), "name": name, "device": "cpu", "max_new_tokens": 6}
    return Path(run_migration(state, stop_after="render")["recipe_dir"])


def run_probe(recipe: Path, out: Path, tp: int, sizes: tuple[int, int] | None = None, timeout: int = 600) -> list[dict]:
    """tp=1: one plain process; tp>1: torchrun with tp ranks. Returns each rank's record."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable] if tp == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}"]
    proc = subprocess.run([*launcher, str(PROBE), str(recipe), str(out), str(tp), *map(str, sizes or ())],
                          capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=recipe)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(tp)]


def assert_tp_parity(tiny_checkpoints, tmp_path, model_type: str, tp: int = 2, sizes=None, **overrides):
    import torch

    recipe = vendor_recipe(tiny_checkpoints(model_type, **overrides), tmp_path, f"tp_{model_type}")
    (single,) = run_probe(recipe, tmp_path / "tp1", 1)
    ranks = run_probe(recipe, tmp_path / f"tp{tp}", tp, sizes)
    reference = torch.tensor(single["logits"])
    for record in ranks:
        delta = (torch.tensor(record["logits"]) - reference).abs().max().item()
        assert delta < 1e-5, (model_type, record["rank"], delta)
        assert record["tokens"] == single["tokens"]
        # Per rank: 1/tp of each sharded weight (+ the replicated rest); the sharded part is most of the model.
        full, local = single["param_bytes"], record["param_bytes"]
        assert local.keys() == full.keys()
        sharded = [name for name in full if local[name] < full[name]]
        sharded_bytes = sum(full[name] for name in sharded)
        if sizes is None:
            assert sharded_bytes > 0.5 * single["held_bytes"], (model_type, sharded)
        for name in sharded:
            assert abs(local[name] * tp - full[name]) <= 0.02 * full[name], (name, local[name], full[name])
        assert record["held_bytes"] == sum(local.values()) < single["held_bytes"]
        assert abs(record["held_bytes"] - (single["held_bytes"] - sharded_bytes * (1 - 1 / tp))) < 0.01 * single["held_bytes"]
        print(f"TP {model_type} tp={tp} rank {record['rank']}: max|dlogits| {delta:.2e}, holds {record['held_bytes']} "
              f"of {single['held_bytes']} bytes ({len(sharded)} sharded weights)")
    return single, ranks


@pytest.mark.parametrize("model_type", [
    "llama",
    pytest.param("qwen3_moe", marks=pytest.mark.slow),   # llama covers the tensor-parallel path by default
    pytest.param("qwen3", marks=pytest.mark.slow),
    pytest.param("mistral", marks=pytest.mark.slow),
    pytest.param("gemma2", marks=pytest.mark.slow),
    pytest.param("mixtral", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", marks=pytest.mark.slow),
])
def test_tp2_matches_single_process_logits_and_greedy_tokens(model_type, tiny_checkpoints, tmp_path):
    assert_tp_parity(tiny_checkpoints, tmp_path, model_type)


@pytest.mark.slow
def test_moe_experts_and_lm_head_kept_whole_with_size_1(tiny_checkpoints, tmp_path):
    """moe_tp_size 1 / lmhead_tp_size 1: attention sharded, experts, embeddings and lm_head whole on each rank."""
    single, ranks = assert_tp_parity(tiny_checkpoints, tmp_path, "qwen3_moe", sizes=(1, 1))
    for record in ranks:
        local, full = record["param_bytes"], single["param_bytes"]
        whole = [n for n in full if "experts" in n or "lm_head" in n or "embed_tokens" in n]
        assert whole and all(local[n] == full[n] for n in whole)
        assert any(local[n] < full[n] for n in full if "self_attn.q_proj" in n)


@pytest.mark.slow
def test_tp4_matches_single_process(tiny_checkpoints, tmp_path):
    assert_tp_parity(tiny_checkpoints, tmp_path, "llama", tp=4, num_key_value_heads=4)


def test_a_family_without_a_plan_is_refused_naming_the_families_that_have_one():
    from transformers import FalconConfig, FalconForCausalLM

    from agent.errors import EXIT_UNSUPPORTED, UnsupportedModelError
    from agent.recipe.parallel import parallel_settings
    from engine.parallel import tensor_parallel_config

    with pytest.raises(UnsupportedModelError) as refused:
        parallel_settings({"model_type": "falcon"}, 2)
    assert refused.value.exit_code == EXIT_UNSUPPORTED
    message = str(refused.value)
    assert "falcon has no tensor-parallel plan" in message and "\n" not in message
    families = message.split("families with one: ")[1].split(", ")
    assert {"llama", "qwen3", "mistral", "gemma2", "qwen3_moe", "mixtral", "deepseek_v3"} <= set(families)
    assert "falcon" not in families
    assert parallel_settings({"model_type": "llama"}, 4) == {"world_size": 4, "attn_tp_size": 4, "moe_tp_size": 4, "lmhead_tp_size": 4}
    assert parallel_settings({"model_type": "falcon"}, 1)["attn_tp_size"] == 1   # one card needs no plan
    # The engine refuses the same way when a YAML asks for it.
    with pytest.raises(ValueError, match=r"falcon has no tensor-parallel plan .* Families with a plan \(\d+\): .*llama"):
        tensor_parallel_config(FalconForCausalLM, FalconConfig(), 2, 1, 2, 2)
    # ...and so does a recipe's check_vars, before any weight is read: one lookup of the plan for all three.
    from transformers import Gemma3Config, LlamaConfig

    from engine.config import check_parallel
    from engine.parallel import tp_plan

    assert tp_plan(FalconConfig) is None and tp_plan(FalconConfig()) is None
    assert tp_plan(LlamaConfig) == tp_plan(LlamaConfig()) and "layers.*.self_attn.q_proj" in tp_plan(LlamaConfig)
    assert tp_plan(Gemma3Config)            # composite: the text sub-configuration's plan
    two = {"world_size": 2, "parallel_config": {"attn_tp_size": 2, "moe_tp_size": 2, "lmhead_tp_size": 2}}
    with pytest.raises(ValueError, match=r"falcon has no tensor-parallel plan"):
        check_parallel(two, FalconConfig)
    check_parallel(two, LlamaConfig)


@pytest.fixture(scope="module")
def llama_recipe(tiny_checkpoints, tmp_path_factory):
    return vendor_recipe(tiny_checkpoints("llama"), tmp_path_factory.mktemp("cv"), "cv")


@pytest.mark.parametrize("world_size,tp,moe,lmhead,error", [
    (4, 2, 2, 1, None),
    (4, 3, 1, 1, "'parallel_config.attn_tp_size' (3) must divide 'world_size' (4)"),
    (4, 2, 4, 2, "'parallel_config.moe_tp_size' is 4; expected 1 or attn_tp_size (2)"),
    (2, 2, 2, 3, "'parallel_config.lmhead_tp_size' is 3; expected 1 or attn_tp_size (2)"),
    (4, 1, 1, 1, "'data_config.batch_size' (2) must be a multiple of world_size / attn_tp_size (4 data-parallel"),
])
def test_check_vars_validates_the_parallel_combination(world_size, tp, moe, lmhead, error, llama_recipe):
    import importlib.util

    recipe = llama_recipe
    sys.path.insert(0, str(recipe))
    try:
        spec = importlib.util.spec_from_file_location("cv_model_setting", recipe / "models" / "model_setting.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        settings = {"world_size": world_size, "data_config": {"batch_size": 2},
                    "parallel_config": {"attn_tp_size": tp, "moe_tp_size": moe, "lmhead_tp_size": lmhead}}
        if error is None:
            module.check_vars(settings)
            assert module.update_vars(settings)["batch_size_per_rank"] == 1   # 2 data-parallel groups of 2
        else:
            with pytest.raises(ValueError, match=re.escape(error)):
                module.check_vars(settings)
    finally:
        sys.path.remove(str(recipe))


@pytest.mark.parametrize("world_size,tp,moe,lmhead,batch,error", [
    (4, 2, 2, 1, 2, None),
    (8, 8, 8, 8, 1, None),
    (4, 3, 1, 1, 4, "'parallel_config.attn_tp_size' (3) must divide 'world_size' (4)"),
    (4, 4, 2, 4, 1, "'parallel_config.moe_tp_size' is 2; expected 1 or attn_tp_size (4)"),
    (4, 2, 2, 2, 3, "'data_config.batch_size' (3) must be a multiple of world_size / attn_tp_size (2 data-parallel groups)"),
])
def test_yaml_validation_names_the_bad_parallel_combination(world_size, tp, moe, lmhead, batch, error):
    from engine.config import ConfigError, validate

    settings = {"model_name": "m", "model_path": "w", "exe_mode": "eager", "world_size": world_size,
                "model_config": {"dtype": "float32"},
                "data_config": {"dataset": "default", "input_max_len": 8, "max_new_tokens": 2, "batch_size": batch},
                "parallel_config": {"attn_tp_size": tp, "moe_tp_size": moe, "lmhead_tp_size": lmhead}}
    if error is None:
        assert validate(settings, "x.yaml") is settings
    else:
        with pytest.raises(ConfigError, match="^x.yaml: " + re.escape(error) + "$"):
            validate(settings, "x.yaml")


def test_torchrun_settings_for_one_and_several_machines():
    from engine.config import ConfigError
    from engine.launch import torchrun_args

    assert torchrun_args(4, {}) == ["--standalone", "--nproc-per-node=4"]
    assert torchrun_args(4, {"NNODES": "1", "MASTER_ADDR": "10.0.0.1"}) == ["--standalone", "--nproc-per-node=4"]
    assert torchrun_args(16, {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6000"}) == [
        "--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=6000", "--nproc-per-node=8"]
    with pytest.raises(ConfigError, match=r"world_size=3 must be a multiple of NNODES=2"):
        torchrun_args(3, {"NNODES": "2"})
    with pytest.raises(ConfigError, match=r"NODE_RANK=2 must be in 0..1"):
        torchrun_args(4, {"NNODES": "2", "NODE_RANK": "2"})


TIED_PROBE = '''
import sys
sys.path.insert(0, sys.argv[1])
from transformers.distributed import DistributedConfig
from engine.parallel import check_tied_lm_head
from models.modeling_tied import LlamaForCausalLM
for plan in ("auto", {"model.embed_tokens": "replicate"}):
    model = LlamaForCausalLM.from_pretrained(sys.argv[2], distributed_config=DistributedConfig(tp_size=2, tp_plan=plan))
    try:
        check_tied_lm_head(model)
        print("RESULT ok", flush=True)
    except RuntimeError as exc:
        print("RESULT refused:", exc, flush=True)
'''


@pytest.mark.slow
def test_tied_lm_head_over_whole_embeddings_is_refused_before_the_narrow_error(tmp_path):
    """The demo model ties lm_head to the embeddings. Sharded by the plan, both are split (ok); with
    the embeddings left whole, lm_head's forward would fail with "narrow unexpectedly changed
    concrete size on dim 2: 1536 -> 768": the engine refuses that layout with the fix instead."""
    demo = REPO_ROOT / "demo" / "tiny-attention-llama"
    recipe = vendor_recipe(demo, tmp_path, "tied")
    (tmp_path / "probe.py").write_text(TIED_PROBE)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(tmp_path / "probe.py"), str(recipe), str(demo)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = re.findall(r"RESULT (.*)", proc.stdout)
    assert results.count("ok") == 2
    assert results.count("refused: lm_head is tied to the input embeddings, which this tensor-parallel plan leaves "
                         "whole, but the plan shards lm_head (colwise_gather_output); set "
                         "parallel_config.lmhead_tp_size: 1") == 2
