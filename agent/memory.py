"""Memory estimate: weight bytes from safetensors headers (no tensor loaded) + KV cache bytes."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
TORCH_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def weight_bytes(model_dir: Path, dtype: str | None = None) -> int:
    """Sum of tensor sizes over *.safetensors headers; re-scaled to `dtype` if given."""
    total = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        for key, meta in safetensors_header(file).items():
            if key == "__metadata__":
                continue
            numel = math.prod(meta["shape"]) if meta["shape"] else 1
            size = TORCH_DTYPE_BYTES[dtype] if dtype in TORCH_DTYPE_BYTES and meta["dtype"].startswith(("F", "BF")) \
                else DTYPE_BYTES.get(meta["dtype"], 4)
            total += numel * size
    return total


def kv_cache_bytes(config: dict, batch_size: int, seq_len: int, dtype: str = "bfloat16") -> int:
    """KV cache for batch x seq tokens. MLA caches the latent + rope key; sliding layers cap at window."""
    config = config.get("text_config") or config
    elt = TORCH_DTYPE_BYTES.get(dtype, 2)
    layers = config.get("num_hidden_layers") or config.get("n_layer") or 0
    if config.get("kv_lora_rank"):
        per_token_layer = config["kv_lora_rank"] + config.get("qk_rope_head_dim", 0)
        return batch_size * seq_len * layers * per_token_layer * elt
    heads = config.get("num_attention_heads") or config.get("n_head")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads)
    layer_types = config.get("layer_types") or ["full_attention"] * layers
    window = config.get("sliding_window")
    total = 0
    for kind in layer_types[:layers]:
        # A sliding layer keeps the last window-1 tokens (the new token completes the window).
        tokens = min(seq_len, window - 1) if window and "sliding" in str(kind) else seq_len
        total += 2 * batch_size * tokens * kv_heads * head_dim * elt
    return total


# Memory a process uses before the model: framework, allocator pools, (on NPU) CANN workspace.
RUNTIME_BYTES = {"cpu": 512 * 2**20, "cuda": 1 * 2**30, "npu": 2 * 2**30}


def estimate(model_dir: Path, config: dict, dtype: str, batch_size: int, seq_len: int,
             device_bytes: int | None, device: str = "cpu", slack: float = 1.2) -> dict:
    """Weights + KV cache (x slack for activations and fragmentation) against one card's memory
    minus the runtime's own share; cards rounded up to a power of two (a valid world_size)."""
    weights = weight_bytes(model_dir, dtype)
    kv = kv_cache_bytes(config, batch_size, seq_len, dtype)
    runtime = RUNTIME_BYTES.get(device, RUNTIME_BYTES["cpu"])
    model_share = int((weights + kv) * slack)
    cards = None
    if device_bytes:
        usable = max(device_bytes - runtime, 1)
        cards = max(1, math.ceil(model_share / usable))
        cards = 1 << (cards - 1).bit_length()
    needed = model_share + runtime
    return {"weights_bytes": weights, "kv_cache_bytes": kv, "runtime_bytes": runtime, "needed_bytes": needed,
            "needed_gib": needed / 2**30, "device": device, "device_bytes": device_bytes,
            "batch_size": batch_size, "seq_len": seq_len, "dtype": dtype,
            "cards_needed": cards, "suggested_world_size": cards}


def process_memory_limit() -> int | None:
    """The run's own cap (ulimit -d / -v), inherited by infer.sh: memory it may really use."""
    import resource

    limits = []
    for which in (resource.RLIMIT_DATA, resource.RLIMIT_AS):
        soft, _ = resource.getrlimit(which)
        if soft not in (resource.RLIM_INFINITY, -1):
            limits.append(soft)
    return min(limits) if limits else None


def estimate_for_recipe(recipe_dir: Path, env: dict) -> dict:
    import yaml

    yaml_file = sorted((recipe_dir / "config").glob("*.yaml"))[0]
    settings = yaml.safe_load(yaml_file.read_text())
    model_dir = Path(settings["model_path"])
    config = json.loads((model_dir / "config.json").read_text())
    data = settings["data_config"]
    device = env.get("device", "cpu")
    device_bytes = env.get("device_memory_bytes")
    if device == "cpu":
        limit = process_memory_limit()
        device_bytes = min(filter(None, [device_bytes, limit]), default=None)
    return estimate(model_dir, config, settings["model_config"]["dtype"], data["batch_size"],
                    data["input_max_len"] + data["max_new_tokens"], device_bytes, device)
