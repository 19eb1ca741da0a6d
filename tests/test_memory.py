"""Memory estimator vs measured sizes of tiny fixtures (weights from safetensors headers, KV cache
from a real forward with transformers' DynamicCache)."""

from __future__ import annotations

import json

import pytest
import torch

from agent.memory import estimate, kv_cache_bytes, weight_bytes


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


def test_estimate_reports_cards_as_a_power_of_two(tiny_checkpoints):
    ckpt = tiny_checkpoints("llama")
    config = json.loads((ckpt / "config.json").read_text())
    fits = estimate(ckpt, config, "float32", 1, 64, device_bytes=64 * 2**30, device="npu")
    assert fits["cards_needed"] == 1
    tight = estimate(ckpt, config, "float32", 1, 64, device_bytes=2 * 2**30 + 300_000, device="npu")
    assert tight["cards_needed"] in (2, 4, 8) and tight["cards_needed"] & (tight["cards_needed"] - 1) == 0
    assert tight["needed_bytes"] == int((tight["weights_bytes"] + tight["kv_cache_bytes"]) * 1.2) + tight["runtime_bytes"]
