"""Quantized checkpoints as their publishers upload them (SPEC §9): which format a checkpoint is in, every
tensor of it accounted for, and what the NPU does with it.

`scheme_of(config, model_dir)` reads the format from `config.json`'s `quantization_config` (or ModelSlim's
`quant_model_description.json`) — one row of FORMATS; `account(scheme, tensors)` sorts every tensor of the
safetensors headers into a quantized weight (its packed data, scales, zeros, group index), a tensor kept as
published (float), or one dropped by the conversion (a static activation scale, a packed shape); any other
tensor is an InputError naming it. Nothing is loaded: headers only.

The route of a format on Atlas A2/A3 (upstream's module/quantization at fbc225d: compressed-tensors W8A8
int8 runs there, by npu_quant_matmul; its fp8 / mxfp4 / mxfp8 paths use float8 matmuls the A2/A3 cube units
do not have):
* `convert`: dequantized to bf16 at migration (agent.migrate.convert), the checkpoint the recipe runs;
* `native`: runs quantized through upstream's module/quantization — not yet threaded through the generated
  model (refused with that line until it is);
* a format the migrator reads but cannot serve is refused with its reason.

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
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from agent.errors import InputError, UnsupportedModelError

FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
MODELSLIM_DESCRIPTION = "quant_model_description.json"


@dataclass(frozen=True)
class Scheme:
    """One checkpoint's quantization, read from its config: `format` a FORMATS key, `route` convert /
    native / refused, `label` what the user reads, `params` what the layout rules need."""
    format: str
    route: str
    label: str
    why: str
    params: dict = field(default_factory=dict)


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
        raise InputError(f"{Path(model_dir) / MODELSLIM_DESCRIPTION}: must be a JSON object of tensor name -> "
                         "quantization type; re-download it")
    return data


# ---- the formats: how each is read from its config ------------------------------------------------
def _fp8(q: dict) -> Scheme:
    block = q.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise InputError(f"config.json: quantization_config.weight_block_size must be two positive integers, got {block!r}")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        return Scheme("fp8", "refused", f"fp8 ({fmt})", f"fp8 {fmt} weights: transformers' fine-grained fp8 "
                      "reads e4m3 only")
    label = f"fp8 e4m3, {block[0]}x{block[1]} blocks" if block else "fp8 e4m3, per tensor"
    return Scheme("fp8", "convert", label, "no fp8 matmul on Atlas A2/A3: dequantized to bf16",
                  {"block": block, "activation_scheme": q.get("activation_scheme", "dynamic")})


def _mxfp4(q: dict) -> Scheme:
    return Scheme("mxfp4", "convert", "mxfp4 (e2m1 blocks of 32, e8m0 scales)",
                  "no fp4 matmul on Atlas A2/A3: dequantized to bf16 (exact: e2m1 x 2^k is a bf16 value)", {})


def _ct_args(group: dict, key: str) -> dict | None:
    args = group.get(key)
    return args if isinstance(args, dict) else None


def _compressed_tensors(q: dict) -> Scheme:
    fmt = q.get("format")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
        raise InputError("config.json: quantization_config (compressed-tensors) has no config_groups; re-download it")
    kinds = set()
    for name, group in groups.items():
        weights, acts = _ct_args(group, "weights"), _ct_args(group, "input_activations")
        if weights is None:
            raise InputError(f"config.json: compressed-tensors group {name!r} has no 'weights' arguments")
        bits, kind = weights.get("num_bits"), weights.get("type", "int")
        group_fmt = group.get("format") or fmt
        if kind == "int" and bits == 8 and acts is not None and acts.get("type", "int") == "int" \
                and acts.get("num_bits") == 8:
            strategy = "dynamic" if acts.get("dynamic") else "static"
            kinds.add(("w8a8-int8", strategy, str(group_fmt)))
        elif kind == "int" and bits in (4, 8) and acts is None:
            kinds.add((f"w{bits}a16-int", str(weights.get("strategy")), str(group_fmt)))
        elif kind == "float" and bits == 8:
            kinds.add(("fp8", str(weights.get("strategy")), str(group_fmt)))
        else:
            return Scheme("compressed-tensors", "refused", f"compressed-tensors {kind}{bits} weights",
                          f"group {name!r}: {kind} {bits}-bit weights"
                          f"{' with ' + str(acts.get('type')) + str(acts.get('num_bits')) + ' activations' if acts else ''}"
                          " are not a scheme the migrator reads (int8 W8A8, int4/int8 weight-only, fp8)")
    if any(k[0] == "w8a8-int8" for k in kinds):
        if len(kinds) > 1:
            return Scheme("compressed-tensors", "refused", "compressed-tensors, mixed schemes",
                          f"groups of different schemes ({sorted(k[0] for k in kinds)})")
        strategy = next(iter(kinds))[1]
        return Scheme("compressed-tensors", "native", f"compressed-tensors int8 W8A8 ({strategy} activations)",
                      "upstream's module/quantization runs it on Atlas A2/A3 (npu_quant_matmul); the generated "
                      "model does not pass quant_config to its linears yet, so it cannot load these weights",
                      {"config": q})
    label = ", ".join(sorted({f"{k[0]} ({k[2]})" for k in kinds}))
    return Scheme("compressed-tensors", "convert", f"compressed-tensors {label}",
                  "no route on Atlas A2/A3 in upstream's module/quantization: dequantized to bf16", {"config": q})


def _awq(q: dict) -> Scheme:
    version = str(q.get("version", "gemm")).lower()
    bits, group = q.get("bits", q.get("w_bit", 4)), q.get("group_size", q.get("q_group_size", 128))
    if version != "gemm" or bits != 4 or not isinstance(group, int) or group <= 0:
        return Scheme("awq", "refused", f"awq {version} {bits}-bit", f"AWQ {version} with {bits}-bit weights: the "
                      "migrator reads AutoAWQ's GEMM layout of 4-bit weights with a positive group size")
    return Scheme("awq", "convert", f"awq gemm int4, groups of {group}",
                  "no AWQ route in upstream's module/quantization: dequantized to bf16",
                  {"bits": bits, "group_size": group, "zero_point": q.get("zero_point", True)})


def _gptq(q: dict) -> Scheme:
    bits, group = q.get("bits", 4), q.get("group_size", 128)
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    if bits not in (2, 4, 8) or fmt not in ("gptq", "gptq_v2") or not isinstance(group, int) or (group <= 0 and group != -1):
        return Scheme("gptq", "refused", f"gptq {fmt} {bits}-bit", f"GPTQ {fmt} with {bits}-bit weights: the "
                      "migrator reads checkpoint_format gptq / gptq_v2 with 2, 4 or 8 bits")
    return Scheme("gptq", "convert", f"gptq int{bits}, groups of {group if group > 0 else 'the whole row'}"
                  f"{', act-order' if q.get('desc_act') else ''}",
                  "no GPTQ route in upstream's module/quantization: dequantized to bf16",
                  {"bits": bits, "group_size": group, "v1": fmt == "gptq"})


FORMATS = {"fp8": _fp8, "mxfp4": _mxfp4, "compressed-tensors": _compressed_tensors, "awq": _awq, "gptq": _gptq}


def scheme_of(config: dict, model_dir: Path | None = None) -> Scheme | None:
    """The checkpoint's quantization (None: not quantized). A quantization_config that is no object, or one
    of a method the migrator does not read, is a Scheme with route "refused"."""
    description = _description(model_dir)
    if description is not None and config.get("quantization_config") is None:
        kind = str(description.get("model_quant_type", "unknown"))
        return Scheme("modelslim", "refused", f"ModelSlim {kind}",
                      f"ModelSlim {kind} weights ({MODELSLIM_DESCRIPTION}): vLLM-Ascend's loader runs them; upstream's "
                      "module/quantization reads compressed-tensors only, and the migrator does not convert ModelSlim yet",
                      {"description": description})
    q = config.get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", "unknown")).lower() if isinstance(q, dict) else "unknown"
    reader = FORMATS.get(method)
    if reader is None:
        return Scheme(method, "refused", f"{method}",
                      f"quant_method {method!r} is not one the migrator reads ({', '.join(FORMATS)}, ModelSlim)")
    return reader(q)


def refusal(scheme: Scheme | None, arch: str) -> str | None:
    """The one line for a quantized checkpoint the migrator cannot serve (None: it can, maybe converted)."""
    if scheme is None or scheme.route == "convert":
        return None
    if scheme.route == "native":
        return f"{arch}: weights are {scheme.label}; {scheme.why}; until it does, migrate the bf16 checkpoint it was quantized from"
    return f"{arch}: weights are {scheme.label}; {scheme.why}"


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


def _ct_ignored(module: str, ignore: list) -> bool:
    for entry in ignore or []:
        if isinstance(entry, str) and entry.startswith("re:"):
            if re.match(entry[3:], module):
                return True
        elif module == entry or module.endswith("." + str(entry)):
            return True
    return False


def _account_ct(scheme, tensors):
    config = scheme.params["config"]
    groups = config["config_groups"]
    weights = next(iter(groups.values()))["weights"]
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


MODELSLIM_PARTS = ("weight_scale", "weight_offset", "input_scale", "input_offset", "quant_bias", "deq_scale")


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


def check_quantized(model_dir: Path, config: dict, arch: str) -> tuple[Scheme, Accounting] | None:
    """The input step's look at a quantized checkpoint: every tensor accounted for (exit 2 naming one that is
    not), then refused (exit 3, one line) when it cannot be served. None: not quantized."""
    scheme = scheme_of(config, model_dir)
    if scheme is None:
        return None
    accounting = None
    if scheme.format in ("fp8", "mxfp4", "compressed-tensors", "awq", "gptq", "modelslim") \
            and not (scheme.route == "refused" and scheme.format != "modelslim"):
        accounting = account(scheme, read_tensors(model_dir))
        if not accounting.quantized and scheme.format != "modelslim":
            raise InputError(f"{model_dir}: config.json says the weights are {scheme.label}, but no tensor is; "
                             "use the config.json that came with these weights")
    line = refusal(scheme, arch)
    if line:
        raise UnsupportedModelError(line)
    return scheme, accounting
