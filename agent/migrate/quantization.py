"""A checkpoint's quantization, in one place (SPEC §9): the format its publisher uploaded it in, every tensor
of it accounted for, and what the migration does with it. Nothing is imported or loaded: config.json,
ModelSlim's quant_model_description.json and the safetensors headers only.

`scheme_of(config, model_dir)` reads the format from `quantization_config` (compressed-tensors' older
`compression_config` too; ModelSlim's description file) — by the format readers of agent.quantization_formats
(FORMATS, their one home) — as a Scheme: its `label`
(what the user reads, `describe`), its `route` and `why`. `account(scheme, tensors)` sorts every tensor of the
headers into a quantized weight (its packed data, scales, zeros, group index), a tensor kept as published
(float), or one a conversion drops (a static activation scale); any other tensor is an InputError naming it.

The routes on Atlas A2/A3 (upstream's module/quantization at fbc225d: compressed-tensors W8A8 int8 runs
there, by npu_quant_matmul; its fp8 / mxfp4 / mxfp8 paths use float8 matmuls the A2/A3 cube units lack):
* `native`: compressed-tensors W8A8 int8 as upstream's loader runs it (`is_w8a8`; what `--quantize w8a8`
  writes): served as published — the recipe runs the checkpoint and its `quantization_config`;
* `convert`: fp8 (block / per tensor), mxfp4, AWQ, GPTQ and compressed-tensors' other schemes, dequantized to
  bf16 at migration (agent.migrate.convert) into the recipe's state folder, which the recipe runs;
* `refused`: one true line (`refusal`): the quantization, why the migrator neither serves nor converts it,
  and cann-recipes-infer's own converter where one reads the checkpoint (models/deepseek_r1/utils/
  convert_model.py, models/gpt_oss/converter/convert.py: `converter`), else what to migrate. Publishers of
  such checkpoints (DeepSeek-V3, Kimi-K2, gpt-oss) release no unquantized original, so the line never sends
  the user to one that may not exist.

The formats' published definitions, which the layouts below follow:
* fp8 (transformers' FineGrainedFP8, DeepSeek-V3's `inference/kernel.py` weight_dequant): e4m3 `weight` and
  fp32 `weight_scale_inv` per (block_m x block_n) block of the weight, ceil-divided (the last block may be
  partial), or one scale per tensor without `weight_block_size`; `activation_scale` for static activations.
* mxfp4 (OCP Microscaling v1.0, gpt-oss's `gpt_oss/torch/weights.py`): `X_blocks` uint8, two e2m1 values
  per byte (low nibble first), 16 bytes = 32 values per block; `X_scales` uint8 e8m0 exponents (2^(s-127)).
* compressed-tensors (its compressors: naive/int/float-quantized `weight` + `weight_scale` [+
  `weight_zero_point`, `weight_g_idx`]; pack-quantized `weight_packed` int32 + `weight_shape`; static
  activations `input_scale` [+ `input_zero_point`]).
* AWQ GEMM (AutoAWQ `awq/utils/packing_utils.py`): `qweight` int32 (in, out/8) in AWQ's nibble order,
  `qzeros` int32 (in/group, out/8), `scales` (in/group, out).
* GPTQ (AutoGPTQ / GPTQModel torch kernels): `qweight` int32 (in*bits/32, out), `qzeros` int32
  (groups, out*bits/32; stored minus one in checkpoint_format gptq, as is in gptq_v2), `scales`, `g_idx`.
* ModelSlim (msModelSlim's `quant_model_description.json`: each tensor's type, W8A8 / W8A8_DYNAMIC / FLOAT).

Every config value a line shows passes `_word` / `_count` (agent.quantization_formats) first: the config is
untrusted.
"""

from __future__ import annotations

import math
import shlex
import struct
from dataclasses import dataclass, field
from pathlib import Path

from agent.errors import InputError, UnsupportedModelError
from agent.quantization_formats import FORMATS, READ, Scheme, _word, describe, quantization_config

FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
MODELSLIM_DESCRIPTION = "quant_model_description.json"


@dataclass
class QuantizedTensor:
    """A tensor of the converted checkpoint made from quantized parts: `output` its name, `parts` role ->
    source tensor name (weight, scale, zero, g_idx, shape), `shape` its shape, `kind` the dequantization."""
    output: str
    kind: str
    parts: dict[str, str]
    shape: list[int]
    params: dict = field(default_factory=dict)


@dataclass
class Accounting:
    """Every tensor of the checkpoint: made into `quantized` outputs, `kept` as published, or `dropped`
    (name -> why: a static activation scale a bf16 checkpoint does not need)."""
    scheme: Scheme
    quantized: list[QuantizedTensor]
    kept: list[str]
    dropped: dict[str, str]

    def output_shapes(self, tensors: dict[str, "TensorInfo"]) -> dict[str, list[int]]:
        """name -> shape of the checkpoint after conversion (the model transformers builds holds these)."""
        shapes = {q.output: q.shape for q in self.quantized}
        shapes.update({name: tensors[name].shape for name in self.kept})
        return shapes

    def counts(self) -> dict[str, int]:
        return {"quantized": len(self.quantized), "kept": len(self.kept), "dropped": len(self.dropped)}


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str
    shape: list[int]

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1


# ---- reading ------------------------------------------------------------------------------------
def read_tensors(model_dir: Path) -> dict[str, TensorInfo]:
    """name -> (file, dtype, shape) over the checkpoint's safetensors headers (checked by checkpoint_check)."""
    from engine.safe_load import loads_json

    tensors: dict[str, TensorInfo] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = loads_json(f.read(length).decode("utf-8"), f"{path}: safetensors header",
                                max_bytes=100 * 2**20)
        for name, info in header.items():
            if name != "__metadata__":
                tensors[name] = TensorInfo(path.name, info["dtype"], list(info["shape"]))
    return tensors


def _description(model_dir: Path | None) -> dict | None:
    if model_dir is None or not (Path(model_dir) / MODELSLIM_DESCRIPTION).is_file():
        return None
    from agent.recipe.fs_guard import JSON_LIMIT, read_bytes
    from engine.safe_load import LoadError, loads_json

    path = Path(model_dir) / MODELSLIM_DESCRIPTION
    try:
        data = loads_json(read_bytes(path, JSON_LIMIT).decode("utf-8"), str(path), max_bytes=JSON_LIMIT)
    except (OSError, UnicodeDecodeError, LoadError) as exc:
        raise InputError(f"{path}: cannot be read as JSON ({exc}); re-download it") from None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values() if not isinstance(v, (int, float))):
        raise InputError(f"{path}: must be a JSON object of tensor name -> quantization type; re-download it")
    return data


def scheme_of(config: dict, model_dir: Path | None = None) -> Scheme | None:
    """The checkpoint's quantization (None: not quantized). `model_dir`: where ModelSlim's description is
    looked for. InputError (exit 2) for a quantization_config that contradicts itself."""
    description = _description(model_dir)
    q = quantization_config(config)
    if description is not None and q is None:
        kind = _word(str(description.get("model_quant_type"))) or "weights"
        return Scheme("modelslim", "refused", f"ModelSlim {kind} ({MODELSLIM_DESCRIPTION})",
                      "vLLM-Ascend's loader runs ModelSlim weights; upstream's module/quantization reads "
                      "compressed-tensors, and the migrator does not convert ModelSlim yet",
                      {"description": description})
    if q is None:
        return None
    if not isinstance(q, dict):
        raise InputError("config.json: quantization_config must be a JSON object; use the config.json that came "
                         "with these weights")
    method = q.get("quant_method")
    reader = FORMATS.get(method) if isinstance(method, str) else None
    if reader is None:
        return Scheme(_word(method) or "unknown", "refused", describe(q),
                      f"not a format the migrator reads or converts ({READ})")
    return reader(q)


# ---- the refusal --------------------------------------------------------------------------------
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


def refusal(config: dict, model_dir: Path | str | None = None, download: str | None = None,
            scheme: Scheme | None = None) -> str | None:
    """Why a quantized checkpoint is refused, and what to do, in one line; None when it is served (native) or
    converted. `download`: the command that fetches the weights into DIR (a hub link whose weights are not
    here); `scheme`: scheme_of(config, model_dir), when the caller has it."""
    scheme = scheme or scheme_of(config, Path(model_dir) if model_dir is not None else None)
    if scheme is None or scheme.route != "refused":
        return None
    quant = quantization_config(config)
    quant = quant if isinstance(quant, dict) else {}
    # absolute: the command runs from the checkout's root
    checkpoint = "DIR" if download else str(Path(model_dir).expanduser().resolve()) if model_dir is not None \
        else "CHECKPOINT"
    command = converter(config, quant, checkpoint)
    head = f"weights are quantized: {scheme.label}, which the migrator neither serves nor converts ({scheme.why})"
    if command is not None:
        out = command.rsplit(" ", 1)[1]
        fetch = f"download it (`{download}`), then " if download else ""
        return (f"{head}; {fetch}convert it to bf16 with cann-recipes-infer's own converter, from the checkout's "
                f"root: `{command}`, then migrate {out}")
    return (f"{head}, and no converter of cann-recipes-infer reads it; migrate an unquantized (bf16 / fp16 / fp32) "
            "release of the model where its publisher has one")


# ---- accounting ---------------------------------------------------------------------------------
def _unknown(name: str, info: TensorInfo, scheme: Scheme, what: str = "") -> InputError:
    return InputError(f"{info.file}: tensor {name} ({info.dtype} {info.shape}) is not part of the {scheme.label} layout"
                      f"{what or ' (not a quantized weight, its scale, zero point or group index, nor a float tensor)'}; "
                      "the checkpoint does not match its quantization_config: re-download it")


def account(scheme: Scheme, tensors: dict[str, TensorInfo]) -> Accounting:
    """Every tensor sorted by the format's layout; an unknown one is an InputError naming it (exit 2)."""
    rules = {"fp8": _account_fp8, "mxfp4": _account_mxfp4, "compressed-tensors": _account_ct,
             "awq": _account_awq, "gptq": _account_gptq, "modelslim": _account_modelslim}
    quantized, dropped, claimed = rules[scheme.format](scheme, tensors)
    kept = []
    for name, info in tensors.items():
        if name in claimed:
            continue
        if info.dtype not in FLOAT_DTYPES:
            raise _unknown(name, info, scheme)
        kept.append(name)
    return Accounting(scheme, quantized, kept, dropped)


def _claim(claimed: set[str], *names: str) -> None:
    claimed.update(n for n in names if n)


def _shape_error(name: str, info: TensorInfo, scheme: Scheme, expected, of: str) -> InputError:
    return InputError(f"{info.file}: {name} is {info.shape}, the {scheme.label} layout makes it {list(expected)} "
                      f"for {of}; the checkpoint does not match its quantization_config: re-download it")


def _account_fp8(scheme, tensors):
    block = scheme.params.get("block")
    quantized, dropped, claimed = [], {}, set()
    for name, info in tensors.items():
        if name.endswith("weight_scale_inv") and name[: -len("_scale_inv")] not in tensors:
            raise _unknown(name, info, scheme, f" (a scale whose weight {name[: -len('_scale_inv')]} is missing)")
        if name.endswith(("activation_scale", "input_scale")) and info.dtype in FLOAT_DTYPES and info.numel == 1:
            dropped[name] = "static activation scale (a bf16 checkpoint computes without it)"
            claimed.add(name)
        if not info.dtype.startswith("F8_"):
            continue
        scale = f"{name}_scale_inv"
        if info.dtype != "F8_E4M3" or not name.endswith(".weight") or scale not in tensors:
            raise _unknown(name, info, scheme, f" (an fp8 tensor without {scale})" if info.dtype == "F8_E4M3" else "")
        s = tensors[scale]
        if block:
            if len(info.shape) < 2:
                raise _unknown(name, info, scheme, " (a block-quantized weight must be a matrix)")
            want = [*info.shape[:-2], -(-info.shape[-2] // block[0]), -(-info.shape[-1] // block[1])]
            if s.shape != want:
                raise _shape_error(scale, s, scheme, want, f"{name} {info.shape} in {block[0]}x{block[1]} blocks")
        elif s.numel != 1:
            raise _shape_error(scale, s, scheme, [1], f"{name} (one scale per tensor)")
        quantized.append(QuantizedTensor(name, "fp8", {"weight": name, "scale": scale}, info.shape, {"block": block}))
        _claim(claimed, name, scale)
    return quantized, dropped, claimed


def _account_mxfp4(scheme, tensors):
    quantized, claimed = [], set()
    for name, info in tensors.items():
        if name.endswith("_scales") and name[: -len("_scales")] + "_blocks" not in tensors:
            raise _unknown(name, info, scheme, f" (scales whose {name[: -len('_scales')]}_blocks are missing)")
        if not name.endswith("_blocks"):
            continue
        base = name[: -len("_blocks")]
        scales = f"{base}_scales"
        if info.dtype != "U8" or scales not in tensors or tensors[scales].dtype != "U8":
            raise _unknown(name, info, scheme, f" (mxfp4 blocks are uint8 with uint8 {scales})")
        if len(info.shape) != 4 or info.shape[-1] != 16:
            raise _unknown(name, info, scheme, " (mxfp4 expert blocks are [experts, rows, groups, 16 bytes], the "
                                               "layout transformers' Mxfp4 reads)")
        if tensors[scales].shape != info.shape[:-1]:
            raise _shape_error(scales, tensors[scales], scheme, info.shape[:-1], f"{name} {info.shape}")
        experts, rows, groups, _ = info.shape
        quantized.append(QuantizedTensor(base, "mxfp4", {"blocks": name, "scales": scales},
                                         [experts, groups * 32, rows]))
        _claim(claimed, name, scales)
    return quantized, {}, claimed


def _account_ct(scheme, tensors):
    config = scheme.params["config"]
    groups = config["config_groups"]
    weights = next(iter(groups.values()))["weights"]     # one weight scheme for every group (_compressed_tensors)
    bits = weights.get("num_bits")
    quantized, dropped, claimed = [], {}, set()
    for name, info in tensors.items():
        for suffix in ("weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape"):
            if name.endswith("." + suffix):
                module = name[: -len(suffix) - 1]
                if f"{module}.weight" not in tensors and f"{module}.weight_packed" not in tensors:
                    raise _unknown(name, info, scheme, f" (a {suffix} whose weight {module}.weight is missing)")
        if name.endswith((".input_scale", ".input_zero_point")):
            dropped[name] = "static activation quantization parameter (a bf16 checkpoint computes without it)"
            claimed.add(name)
            continue
        packed = name.endswith(".weight_packed")
        if not (packed or (name.endswith(".weight") and info.dtype in ("I8", "F8_E4M3"))):
            continue
        module = name[: -len(".weight_packed" if packed else ".weight")]
        scale = f"{module}.weight_scale"
        if scale not in tensors:
            raise _unknown(name, info, scheme, f" (a quantized weight without {scale})")
        parts = {"weight": name, "scale": scale}
        for role, suffix in (("zero", "weight_zero_point"), ("g_idx", "weight_g_idx"), ("shape", "weight_shape")):
            if f"{module}.{suffix}" in tensors:
                parts[role] = f"{module}.{suffix}"
        if packed:
            if info.dtype != "I32" or "shape" not in parts:
                raise _unknown(name, info, scheme, " (pack-quantized weights are int32 with a weight_shape)")
            shape = [info.shape[0], info.shape[1] * (32 // (bits or 4))]    # padded; weight_shape trims it
        else:
            shape = info.shape
        quantized.append(QuantizedTensor(f"{module}.weight", "compressed-tensors", parts, shape,
                                         {"bits": bits, "packed": packed, "float": info.dtype.startswith("F8"),
                                          "group_size": weights.get("group_size")}))
        _claim(claimed, *parts.values())
    return quantized, dropped, claimed


def _account_packed_int(scheme, tensors, kind):
    """AWQ and GPTQ: `qweight`, `qzeros`, `scales` (+ GPTQ's `g_idx`) per quantized linear."""
    bits = scheme.params["bits"]
    per_int = 32 // bits
    quantized, claimed = [], set()
    for name, info in tensors.items():
        for suffix in ("qzeros", "scales", "g_idx"):
            if name.endswith("." + suffix) and f"{name[: -len(suffix) - 1]}.qweight" not in tensors:
                raise _unknown(name, info, scheme, f" (a {suffix} whose {name[: -len(suffix) - 1]}.qweight is missing)")
        if not name.endswith(".qweight"):
            continue
        module = name[: -len(".qweight")]
        parts = {"weight": name, "zero": f"{module}.qzeros", "scale": f"{module}.scales"}
        if kind == "gptq" and f"{module}.g_idx" in tensors:
            parts["g_idx"] = f"{module}.g_idx"
        missing = [p for p in parts.values() if p not in tensors]
        if info.dtype != "I32" or missing:
            raise _unknown(name, info, scheme, f" (a packed int32 qweight with {', '.join(missing)})" if missing else "")
        scales = tensors[parts["scale"]]
        if kind == "awq":
            rows, out = info.shape[0], info.shape[1] * per_int
        else:
            rows, out = info.shape[0] * per_int, info.shape[1]
        if scales.shape[-1] != out or scales.dtype not in FLOAT_DTYPES:
            raise _shape_error(parts["scale"], scales, scheme, [scales.shape[0], out], f"{name} {info.shape}")
        quantized.append(QuantizedTensor(f"{module}.weight", kind, parts, [out, rows], dict(scheme.params)))
        _claim(claimed, *parts.values())
    return quantized, {}, claimed


def _account_awq(scheme, tensors):
    return _account_packed_int(scheme, tensors, "awq")


def _account_gptq(scheme, tensors):
    return _account_packed_int(scheme, tensors, "gptq")


def _account_modelslim(scheme, tensors):
    description = scheme.params["description"]
    claimed = set()
    for name, info in tensors.items():
        kind = description.get(name)
        if kind is None:
            raise _unknown(name, info, scheme, f" (not described in {MODELSLIM_DESCRIPTION})")
        if kind != "FLOAT":
            claimed.add(name)
    return [], {}, claimed


def check_quantized(model_dir: Path, config: dict, arch: str) -> tuple[Scheme, Accounting | None] | None:
    """The input step's look at a quantized checkpoint: every tensor accounted for (exit 2 naming one that is
    not), then refused (exit 3, the one line of `refusal`) when it is neither served nor converted. None: not
    quantized. A format the migrator does not read has no layout to account by (None in its place)."""
    scheme = scheme_of(config, model_dir)
    if scheme is None:
        return None
    accounting = None
    if scheme.route != "refused" or scheme.format == "modelslim":
        accounting = account(scheme, read_tensors(model_dir))
        if not accounting.quantized and scheme.format != "modelslim":
            raise InputError(f"{model_dir}: config.json says the weights are {scheme.label}, but no tensor is; "
                             "use the config.json that came with these weights")
    line = refusal(config, model_dir, scheme=scheme)
    if line:
        raise UnsupportedModelError(f"{arch}: {line}")
    return scheme, accounting
