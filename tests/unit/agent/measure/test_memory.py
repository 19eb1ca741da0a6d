"""Memory estimator vs measured sizes of tiny fixtures (weights from safetensors headers, KV cache
from a real forward with transformers' DynamicCache)."""

from __future__ import annotations

import json

import pytest
import torch

from agent.measure.memory import estimate, kv_cache_bytes, weight_bytes


def _measured_kv(model, batch: int, seq: int) -> int:
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.randint(3, 100, (batch, seq))
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


@pytest.mark.parametrize("model_type,overrides", [
    ("llama", {}),
    ("gpt_neox", {}),                                  # MHA, other attribute names
    ("qwen2_moe", {}),                                 # MoE: experts in weights, dense KV
    ("deepseek_v3", {}),                               # MLA
    ("gemma2", {"sliding_window": 8}),                 # sliding layers keep a window only
])
def test_estimates_match_measured_tiny_fixtures(model_type, overrides, tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    ckpt = tiny_checkpoints(model_type, **overrides)
    config = json.loads((ckpt / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    measured_weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert weight_bytes(ckpt) == measured_weights
    assert weight_bytes(ckpt, "bfloat16") == measured_weights // 2
    batch, seq = 2, 40
    assert kv_cache_bytes(config, batch, seq, "float32") == _measured_kv(model, batch, seq)


def test_estimate_reports_cards_as_the_smallest_fitting_tp_size(tiny_checkpoints):
    ckpt = tiny_checkpoints("llama")
    config = json.loads((ckpt / "config.json").read_text())
    fits = estimate(ckpt, config, "float32", 1, 64, device_bytes=64 * 2**30, device="npu")
    assert fits["cards_needed"] == 1
    tight = estimate(ckpt, config, "float32", 1, 64, device_bytes=2 * 2**30 + 300_000, device="npu")
    assert tight["cards_needed"] in (2, 4, 8) and tight["cards_needed"] & (tight["cards_needed"] - 1) == 0
    assert tight["needed_bytes"] == int((tight["weights_bytes"] + tight["kv_cache_bytes"]) * 1.2) + tight["runtime_bytes"]
    # The smallest tensor-parallel size whose per-rank share fits the card.
    fitting = [tp for tp, row in tight["per_rank"].items() if row["fits"]]
    assert tight["cards_needed"] == min(fitting) and not tight["per_rank"][1]["fits"]


def _all_cache_bytes(cache) -> int:
    """Every tensor a cache holds: keys/values of attention layers, conv/recurrent states of linear ones."""
    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for value in obj.values():
                yield from tensors(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                yield from tensors(value)

    return sum(t.numel() * t.element_size() for layer in cache.layers for t in tensors(vars(layer)))


def test_hybrid_linear_attention_state_matches_the_cache_the_model_builds(tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    ckpt = tiny_checkpoints("qwen3_next", num_hidden_layers=4)   # 3 linear-attention layers + 1 full
    config = json.loads((ckpt / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.randint(3, 100, (2, 40)), use_cache=True)
    measured = _all_cache_bytes(out.past_key_values)
    assert kv_cache_bytes(config, 2, 40, "float32") == measured
    # The recurrent state does not grow with the sequence: only the one full-attention layer does.
    grown = kv_cache_bytes(config, 2, 80, "float32") - kv_cache_bytes(config, 2, 40, "float32")
    assert grown == 2 * 2 * 40 * config["num_key_value_heads"] * config["head_dim"] * 4


def test_bin_checkpoint_weights_match_safetensors(tiny_checkpoints, tmp_path):
    from safetensors.torch import load_file

    ckpt = tiny_checkpoints("llama")
    state = load_file(ckpt / "model.safetensors")
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert weight_bytes(tmp_path) == weight_bytes(ckpt) > 0
    assert weight_bytes(tmp_path, "bfloat16") == weight_bytes(ckpt) // 2


def test_per_rank_estimate_shards_the_planned_weights(tiny_checkpoints):
    from agent.measure.memory import sharded_bytes

    ckpt = tiny_checkpoints("llama")
    config = json.loads((ckpt / "config.json").read_text())
    weights = weight_bytes(ckpt)
    norms = sum(t.numel() * 4 for k, t in __import__("safetensors.torch", fromlist=["load_file"])
                .load_file(ckpt / "model.safetensors").items() if "norm" in k)
    assert sharded_bytes(ckpt, config) == weights - norms      # everything but the norms is in llama's plan
    memory = estimate(ckpt, config, "float32", 1, 64, device_bytes=None, device="cpu")
    for tp in (1, 2, 4, 8, 16):
        row = memory["per_rank"][tp]
        assert row["weights_bytes"] == norms + -(-(weights - norms) // tp)
        assert row["fits"] is None
    assert memory["per_rank"][2]["kv_cache_bytes"] == memory["kv_cache_bytes"] // 2   # 2 KV heads: split
    assert memory["per_rank"][4]["kv_cache_bytes"] == memory["kv_cache_bytes"]        # not divisible: whole
    # A family without a plan: one card only.
    assert sharded_bytes(ckpt, dict(config, model_type="falcon")) is None


def test_estimate_for_recipe_resolves_a_relative_model_path(tiny_checkpoints, tmp_path):
    import shutil

    import yaml

    from agent.measure.memory import estimate_for_recipe
    from agent.recipe.recipe import Recipe

    recipe = tmp_path / "recipe"
    (recipe / "config").mkdir(parents=True)
    shutil.copytree(tiny_checkpoints("llama"), recipe / "weights")
    settings = {"model_name": "r", "model_path": "weights", "model_config": {"dtype": "float32"},
                "data_config": {"batch_size": 1, "input_max_len": 32, "max_new_tokens": 8}}
    (recipe / "config" / "r_1card_eager.yaml").write_text(yaml.safe_dump(settings))
    memory = estimate_for_recipe(Recipe.at(recipe), {"device": "npu", "device_memory_bytes": 64 * 2**30})
    assert memory["weights_bytes"] == weight_bytes(recipe / "weights")
    assert memory["cards_needed"] == 1 and memory["model_type"] == "llama"


def test_estimate_for_recipe_reads_upstream_yaml_schemas(tiny_checkpoints, tmp_path):
    """An upstream recipe that ran out of memory: its YAML has no model_config.dtype (legacy) or keeps
    the lengths in scheduler_config (framework); the estimate uses the checkpoint's dtype and those."""
    import yaml

    from agent.measure.memory import estimate_for_recipe
    from agent.recipe.recipe import Recipe

    checkpoint = tiny_checkpoints("llama")
    legacy = {"model_name": "l", "model_path": str(checkpoint), "exe_mode": "eager", "world_size": 1,
              "model_config": {"enable_profiler": False},
              "data_config": {"dataset": "default", "input_max_len": 32, "max_new_tokens": 8, "batch_size": 2}}
    framework = {"model_name": "f", "world_size": 1,
                 "model_config": {"model_name": "f", "model_path": str(checkpoint), "exe_mode": "eager"},
                 "data_config": {"dataset": "default", "input_truncated_len": 32},
                 "scheduler_config": {"max_new_tokens": 8, "batch_size": 2}}
    for name, settings in (("legacy", legacy), ("framework", framework)):
        recipe = tmp_path / name
        (recipe / "config").mkdir(parents=True)
        (recipe / "config" / f"{name}.yaml").write_text(yaml.safe_dump(settings))
        memory = estimate_for_recipe(Recipe.at(recipe), {"device": "npu", "device_memory_bytes": 64 * 2**30})
        assert (memory["dtype"], memory["batch_size"], memory["seq_len"]) == ("float32", 2, 40), name
        assert memory["weights_bytes"] == weight_bytes(checkpoint) and memory["cards_needed"] == 1


def test_quantized_weights_count_the_bytes_published_and_a_conversion_the_bytes_it_wrote(tmp_path):
    """The estimate reads what a run loads: quantized data (int8, packed mxfp4 blocks, e8m0 scales) at the bytes
    the checkpoint holds, float tensors at the run dtype; a converted checkpoint at what the conversion wrote.
    Counting fp8 / fp4 data as floats of the run dtype (the rule before) overstates a W8A8 run and, for mxfp4,
    understates a converted one by 4x."""
    import math

    import quantized_checkpoints as forms
    from agent.measure import memory
    from agent.migrate.convert import convert_checkpoint
    from agent.migrate.quantization import read_tensors
    from agent.recipe.fs_guard import user_tree

    w8a8, _ = forms.qwen3_w8a8(tmp_path / "w8a8")
    tensors = read_tensors(w8a8)
    published = sum(math.prod(t.shape) * (2 if t.dtype in ("F32", "F16", "BF16") else memory.DTYPE_BYTES[t.dtype])
                    for t in tensors.values())
    assert memory.weight_bytes(w8a8, "bfloat16") == published
    fp8, _ = forms.qwen3_fp8(tmp_path / "fp8")
    fp8_tensors = read_tensors(fp8)
    e4m3 = sum(math.prod(t.shape) for t in fp8_tensors.values() if t.dtype == "F8_E4M3")
    others = sum(math.prod(t.shape) * (2 if t.dtype in ("F32", "F16", "BF16") else 1)
                 for t in fp8_tensors.values() if t.dtype != "F8_E4M3")
    assert memory.weight_bytes(fp8, "bfloat16") == e4m3 + others      # fp8 data at its published byte
    mxfp4, _ = forms.gpt_oss_mxfp4(tmp_path / "mxfp4")
    record = convert_checkpoint(mxfp4, tmp_path / "bf16", user_tree(tmp_path), log=lambda line: None)
    assert memory.weight_bytes(tmp_path / "bf16", "bfloat16") == record["bytes_written"]
    blocks = sum(math.prod(t.shape) for n, t in read_tensors(mxfp4).items() if n.endswith(("_blocks", "_scales")))
    # the published blocks and scales are 1 byte each; converted, each block byte is two bf16 values
    assert memory.weight_bytes(mxfp4, "bfloat16") < record["bytes_written"]
    assert record["bytes_written"] - memory.weight_bytes(mxfp4, "bfloat16") > 2 * blocks


def test_expert_parallel_per_rank_counts_only_the_local_experts(tiny_checkpoints):
    """A native MoE model on N cards is laid out expert parallel (agent.recipe.native.preflight
    .expert_parallel_layout): rank 0 holds its E / moe_ep_size routed experts (their widths / moe_tp_size), the
    shared expert split by moe_tp_size only, the rest as the tensor-parallel plan shards it — counted here from the
    checkpoint's own tensor names, expert by expert."""
    import math
    import re

    from safetensors import safe_open

    from agent.measure.memory import plan_patterns

    ckpt = tiny_checkpoints("qwen2_moe")
    config = json.loads((ckpt / "config.json").read_text())
    experts = config["num_experts"]
    patterns = plan_patterns(config)
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        tensors = {k: f.get_slice(k).get_shape() for k in f.keys()}
    memory = estimate(ckpt, config, "float32", 1, 64, device_bytes=None, device="cpu", expert_parallel=True)
    tensor_parallel = estimate(ckpt, config, "float32", 1, 64, device_bytes=None, device="cpu")
    for ranks in (2, 4, 8):
        row = memory["per_rank"][ranks]
        moe_tp = row["layout"]["moe_tp_size"]
        ep = ranks // moe_tp
        assert experts % ep == 0 and row["local_experts"] == experts // ep
        assert row["layout"] == {"world_size": ranks, "attn_tp_size": ranks, "moe_tp_size": moe_tp, "embed_tp_size": 1,
                                 "lmhead_tp_size": ranks}
        expected = 0
        for key, shape in tensors.items():
            size = 4 * math.prod(shape)
            routed = re.search(r"\.experts\.(\d+)\.", key)
            if "shared_expert." in key:
                expected += -(-size // moe_tp)
            elif routed:
                expected += -(-size // moe_tp) if int(routed.group(1)) < experts // ep else 0   # rank 0's experts
            elif any(p.search(key) for p in patterns):
                expected += size / ranks
            else:
                expected += size
        assert abs(row["weights_bytes"] - expected) <= len(tensors), (ranks, row["weights_bytes"], expected)
        # every expert on every rank (no expert parallel) would be more by the other ranks' experts
        assert tensor_parallel["per_rank"][1]["weights_bytes"] - row["weights_bytes"] > 0
