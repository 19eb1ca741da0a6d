"""The multi-token-prediction draft (code/mtp.py), as upstream's models/deepseek_r1 writes it: where the
checkpoint's config says it ships MTP layers (`num_nextn_predict_layers`, stored as model.layers.{num_hidden_layers}.*)
and the architecture is one whose MTP layer upstream / vLLM build as one more decoder layer of the model's own kind
(DeepSeek-V3's and GLM-4.5's: enorm, hnorm, eh_proj, shared_head.norm around it; embed_tokens and the head shared
with the main model), and the checkpoint holds its tensors (`ships_mtp_layer`; agent.recipe.native.decide writes no
draft for a checkpoint without them). model_config.next_n > 0 runs it (the recipe's YAML sets 1); at 0 the file runs
as one without it and its loader skips those tensors by name."""

from __future__ import annotations

import struct
from pathlib import Path

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.part import Match, Part

# model types whose MTP layer is a decoder layer of the main model's kind behind enorm / hnorm / eh_proj
# (vLLM's deepseek_mtp.py and glm4_moe_mtp.py, upstream's deepseek_r1)
MTP_MODEL_TYPES = frozenset({"deepseek_v3", "glm4_moe"})


def _probe(probe, chosen):
    layers = getattr(probe.full_config, "num_nextn_predict_layers", None) or 0
    if not layers or probe.model_type not in MTP_MODEL_TYPES:
        return None
    attention = chosen.get("attention")
    if attention is not None and attention.options.get("CHUNKED"):
        # the verified window may cross a chunk's start, and the decode's block table begins at its last token's chunk
        raise NotNative("mtp", "an MTP draft with chunked local attention: not written")
    return Match(MTP, options={"MTP": True}, facts={"layers": layers})


MTP = Part(
    slot="mtp", name="mtp_draft", code="mtp.py", provides="ModelModelMTP",
    reads=("num_nextn_predict_layers", "num_hidden_layers", "hidden_size", "rms_norm_eps"), probe=_probe,
    options=("MTP",),
    kernels=lambda m: (("MTP draft (next_n): its decoder layer's kernels, npu_rms_norm for enorm / hnorm / "
                        "shared_head.norm; the verified window of next_n + 1 tokens through the decode attention "
                        "with sparse_mode 3",), ()))


# a safetensors header past this is not one a checkpoint writes
MAX_HEADER_BYTES = 1 << 28


def _tensor_names(model_path: Path) -> set[str]:
    """The checkpoint's tensor names: its safetensors index, else each file's header (no tensor is read)."""
    from engine.safe_load import load_json, loads_json

    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        return set((load_json(index).get("weight_map") or {}).keys())
    names: set[str] = set()
    for file in sorted(model_path.glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER_BYTES:
                continue
            names |= set(loads_json(f.read(length).decode("utf-8"), f"{file}: safetensors header",
                                    max_bytes=length + 1)) - {"__metadata__"}
    return names


def ships_mtp_layer(model_path, config: dict) -> bool:
    """The checkpoint at `model_path` holds the MTP layer its config announces (a tensor named
    model.layers.{num_hidden_layers}.eh_proj.*): converted or shrunk copies often drop it."""
    layers, first = config.get("num_nextn_predict_layers") or 0, config.get("num_hidden_layers")
    if not layers or not isinstance(first, int) or not model_path:
        return False
    try:
        names = _tensor_names(Path(model_path))
    except (OSError, ValueError, struct.error):
        return False
    return any(name.startswith(f"model.layers.{first}.eh_proj.") for name in names)


def without_unshipped_mtp(config: dict, model_path) -> dict:
    """`config` as the parts read it: no MTP layers where the checkpoint does not hold them."""
    if (config.get("num_nextn_predict_layers") or 0) and not ships_mtp_layer(model_path, config):
        return {**config, "num_nextn_predict_layers": 0}
    return config
