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
        tokens = min(seq_len, window) if window and "sliding" in str(kind) else seq_len
        total += 2 * batch_size * tokens * kv_heads * head_dim * elt
    return total


def estimate(model_dir: Path, config: dict, dtype: str, batch_size: int, seq_len: int,
             device_bytes: int | None, overhead: float = 1.2) -> dict:
    weights = weight_bytes(model_dir, dtype)
    kv = kv_cache_bytes(config, batch_size, seq_len, dtype)
    needed = int((weights + kv) * overhead)   # activations, allocator slack, runtime
    cards = max(1, math.ceil(needed / device_bytes)) if device_bytes else None
    if cards and cards > 1:
        cards = 1 << (cards - 1).bit_length()   # world sizes are powers of two
    return {"weights_bytes": weights, "kv_cache_bytes": kv, "needed_bytes": needed,
            "needed_gib": needed / 2**30, "device_bytes": device_bytes, "cards_needed": cards}


def estimate_for_recipe(recipe_dir: Path, env: dict) -> dict:
    import yaml

    yaml_file = sorted((recipe_dir / "config").glob("*.yaml"))[0]
    settings = yaml.safe_load(yaml_file.read_text())
    model_dir = Path(settings["model_path"])
    config = json.loads((model_dir / "config.json").read_text())
    data = settings["data_config"]
    return estimate(model_dir, config, settings["model_config"]["dtype"], data["batch_size"],
                    data["input_max_len"] + data["max_new_tokens"], env.get("device_memory_bytes"))
