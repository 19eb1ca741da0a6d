"""Tiny checkpoints in the quantized formats their publishers upload, made from a tiny bf16/fp32 checkpoint:
DeepSeek-V3's block-FP8 (float8_e4m3fn weights with a `weight_scale_inv` per 128x128 block, quant_method fp8) and
gpt-oss's MXFP4 (the experts as `*_blocks` of packed e2m1 pairs and `*_scales` of power-of-two exponents, quant_method
mxfp4), each with a sharded-style model.safetensors.index.json as the hub's have."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0                   # float8_e4m3fn's largest finite value
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])      # mxfp4's magnitudes (sign: the nibble's bit 3)


def _copy_with(source: Path, out: Path, tensors: dict, quantization_config: dict, **config_changes) -> Path:
    shutil.copytree(source, out)
    (out / "model.safetensors").unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
         "weight_map": {name: "model.safetensors" for name in tensors}}))
    config = json.loads((out / "config.json").read_text())
    config.update(quantization_config=quantization_config, **config_changes)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def block_fp8(source: Path, out: Path, block: int = 128) -> Path:
    """DeepSeek-V3's FP8 checkpoint of `source`: every projection weight float8_e4m3fn, its scale (the block's
    amax / 448) as `<name>_scale_inv` in float32; embeddings, norms, the router and lm_head as they were."""
    tensors = {}
    for name, weight in load_file(str(source / "model.safetensors")).items():
        if weight.ndim != 2 or not name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            tensors[name] = weight
            continue
        rows, cols = weight.shape
        scale = torch.empty(-(-rows // block), -(-cols // block))
        quantized = torch.empty_like(weight, dtype=torch.float8_e4m3fn)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                part = weight[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
                scale[i, j] = part.abs().max().clamp(min=1e-12) / FP8_MAX
                quantized[i * block:(i + 1) * block, j * block:(j + 1) * block] = (part / scale[i, j]).to(torch.float8_e4m3fn)
        tensors[name] = quantized
        tensors[name + "_scale_inv"] = scale
    return _copy_with(source, out, tensors, {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [block, block]}, num_nextn_predict_layers=0)


def _mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of a [E, rows, cols] tensor in gpt-oss's layout: 32 values per block along cols, two per
    byte (the even one in the low nibble), each block's exponent + 127 in a byte."""
    *lead, cols = weight.shape
    groups = weight.float().reshape(*lead, cols // 32, 32)
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.ldexp(torch.ones_like(exponent), exponent.int())[..., None]
    index = (scaled.abs()[..., None] - E2M1).abs().argmin(-1) | ((scaled < 0).long() << 3)
    blocks = (index[..., 0::2] | (index[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def mxfp4_gpt_oss(source: Path, out: Path) -> Path:
    """gpt-oss's MXFP4 checkpoint of `source`: the experts' gate_up_proj / down_proj as *_blocks / *_scales of
    their transposes ([E, out, in/32, 16] and [E, out, in/32]), everything else as it was."""
    tensors = {}
    for name, weight in load_file(str(source / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = _mxfp4(weight.transpose(1, 2).contiguous())
        else:
            tensors[name] = weight
    return _copy_with(source, out, tensors, {"modules_to_not_convert": ["model.layers.*.self_attn",
                                                                        "model.layers.*.mlp.router",
                                                                        "model.embed_tokens", "lm_head"],
                                             "quant_method": "mxfp4"})
