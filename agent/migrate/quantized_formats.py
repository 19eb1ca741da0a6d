"""Quantized checkpoint formats the migrator recognises from config.json alone (no imports: read by the
servability check, agent.migrate.vendor, and the writer, agent.migrate.quantize)."""

from __future__ import annotations


def is_w8a8(config: dict) -> bool:
    """The checkpoint is compressed-tensors W8A8 int8 as upstream's loader runs it on the NPU (upstream's
    `is_dynamic_token_w8a8_int8`: 8-bit int weights by channel or tensor, static, symmetric; 8-bit int
    activations by token, dynamic), in an activation-quantization format."""
    quant = config.get("quantization_config") or config.get("compression_config")
    if not isinstance(quant, dict) or quant.get("quant_method") not in ("compressed-tensors", "compressed_tensors"):
        return False
    if quant.get("format") not in ("int-quantized", "naive-quantized", "float-quantized", "pack-quantized"):
        return False
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return False
    for group in groups.values():
        weights = (group or {}).get("weights") or {}
        acts = (group or {}).get("input_activations") or {}
        if not (weights.get("num_bits") == 8 and weights.get("type", "int") == "int" and not weights.get("dynamic")
                and weights.get("symmetric", True) and weights.get("strategy") in ("channel", "tensor")
                and acts.get("num_bits") == 8 and acts.get("type", "int") == "int" and acts.get("dynamic")
                and acts.get("strategy") == "token"):
            return False
    return True
