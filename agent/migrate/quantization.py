"""A quantized checkpoint in one true line, until the migrator serves them (SPEC §9): the quantization its
quantization_config states (quant_method and what it says of the format), and the converter of
cann-recipes-infer that turns it into a bf16 checkpoint where upstream has one — its own
models/deepseek_r1/utils/convert_model.py (block-FP8, DeepSeek-V3 / R1 and Kimi-K2's layout) and
models/gpt_oss/converter/convert.py (gpt-oss's MXFP4) — with the command as upstream's READMEs run it.
Publishers of such checkpoints (DeepSeek-V3, Kimi-K2, gpt-oss) release no unquantized original, so the line
never sends the user to one that may not exist."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

_NAME = re.compile(r"^[A-Za-z0-9_.+-]{1,40}$")


def _word(value) -> str | None:
    """A config value fit for the line: a short plain name, else None (the config is untrusted)."""
    return value if isinstance(value, str) and _NAME.match(value) else None


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 20 else None


def describe(quant: dict) -> str:
    """The quantization in a few words, e.g. `block-FP8 (quant_method fp8, weight_block_size 128x128)`."""
    method = _word(quant.get("quant_method"))
    if method is None:
        return "a quant_method this line does not show"
    if method == "fp8":
        block = quant.get("weight_block_size")
        if isinstance(block, list) and len(block) == 2 and all(_count(b) for b in block):
            return f"block-FP8 (quant_method fp8, weight_block_size {block[0]}x{block[1]})"
        return "FP8 (quant_method fp8, per tensor or channel)"
    if method == "mxfp4":
        return "MXFP4 (quant_method mxfp4)"
    if method in ("awq", "gptq"):
        bits, group = _count(quant.get("bits")), _count(quant.get("group_size"))
        detail = ", ".join(part for part in (f"int{bits} weights" if bits else None,
                                             f"group size {group}" if group else None) if part)
        return f"{method.upper()} (quant_method {method}{', ' + detail if detail else ''})"
    if method == "compressed-tensors":
        schemes = sorted({scheme for group in (quant.get("config_groups") or {}).values() if isinstance(group, dict)
                          for scheme in [_scheme(group)] if scheme})
        fmt = _word(quant.get("format"))
        detail = ", ".join(schemes + ([f"format {fmt}"] if fmt else []))
        return f"compressed-tensors ({detail})" if detail else "compressed-tensors"
    if method == "bitsandbytes":
        kind = "4-bit " + (_word(quant.get("bnb_4bit_quant_type")) or "") if quant.get("load_in_4bit") else \
            "8-bit" if quant.get("load_in_8bit") else ""
        return f"bitsandbytes ({kind.strip()})" if kind.strip() else "bitsandbytes"
    return f"quant_method {method}"


def _scheme(group: dict) -> str | None:
    """compressed-tensors' config group as W{bits}A{bits} with the weights' number type, e.g. `int8 W8A8`."""
    weights, inputs = group.get("weights"), group.get("input_activations")
    if not isinstance(weights, dict) or not _count(weights.get("num_bits")):
        return None
    kind = {"int": "int", "float": "fp"}.get(weights.get("type"), "")
    act = _count(inputs.get("num_bits")) if isinstance(inputs, dict) else None
    return f"{kind}{weights['num_bits']} W{weights['num_bits']}A{act or 16}"


def converter(config: dict, quant: dict, checkpoint: str) -> str | None:
    """Upstream's command that writes a bf16 copy of the checkpoint at `checkpoint` (a path, or how to get one),
    run from a cann-recipes-infer checkout's root; None when no converter of upstream reads this checkpoint. The
    conditions are what each script reads: convert_model.py dequantizes `*_scale_inv` blocks of 128 (its
    default) and reads num_hidden_layers and num_nextn_predict_layers from config.json; convert.py decodes
    `*_blocks` / `*_scales` pairs of MXFP4."""
    method = quant.get("quant_method")
    out = shlex.quote(f"{checkpoint.rstrip('/')}-bf16")
    source = shlex.quote(checkpoint)
    layers = [config.get(key) for key in ("num_hidden_layers", "num_nextn_predict_layers")]
    if method == "fp8" and quant.get("weight_block_size") == [128, 128] \
            and all(type(count) is int and count >= 0 for count in layers):
        return f"python3 models/deepseek_r1/utils/convert_model.py --input_fp8_hf_path {source} --output_hf_path {out}"
    if method == "mxfp4":
        return f"python3 models/gpt_oss/converter/convert.py --input {source} --output {out}"
    return None


def refusal(config: dict, model_dir: Path | str | None = None, download: str | None = None) -> str:
    """Why a checkpoint with a quantization_config is refused, and what to do, in one line. `download`: the
    command that fetches the weights into DIR (a hub link whose weights are not here)."""
    quant = config.get("quantization_config")
    quant = quant if isinstance(quant, dict) else {}
    what = describe(quant)
    # absolute: the command runs from the checkout's root
    checkpoint = "DIR" if download else str(Path(model_dir).expanduser().resolve()) if model_dir is not None \
        else "CHECKPOINT"
    command = converter(config, quant, checkpoint)
    if command is not None:
        out = command.rsplit(" ", 1)[1]
        fetch = f"download it (`{download}`), then " if download else ""
        return (f"weights are quantized: {what}, which the migrator does not serve yet; {fetch}convert it to bf16 "
                f"with cann-recipes-infer's own converter, from the checkout's root: `{command}`, then migrate {out}")
    return (f"weights are quantized: {what}, which the migrator does not serve yet and no converter of "
            "cann-recipes-infer reads; migrate an unquantized (bf16 / fp16 / fp32) release of the model where its "
            "publisher has one")
