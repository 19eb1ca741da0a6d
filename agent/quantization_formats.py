"""The quantization formats' readers: what a checkpoint's config.json says about its quantization
(`quantization_config`, compressed-tensors' older `compression_config`), read from the config alone — pure functions,
never a file. One home below the packages that ask (agent.migrate.quantization decides a checkpoint's route and
accounts its tensors from these; agent.recipe.native.preflight asks for a quantized KV cache), which may not import
each other (tests/lint/test_import_cycles.py FORBIDDEN).

Every config value a line shows passes `_word` / `_count` first: the config is untrusted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from agent.errors import InputError

# compressed-tensors' formats that store quantized weights (dense / sparse formats store none the migrator reads)
CT_FORMATS = ("naive-quantized", "int-quantized", "float-quantized", "pack-quantized")
READ = "fp8, mxfp4, compressed-tensors, AWQ, GPTQ"

_NAME = re.compile(r"^[A-Za-z0-9_.+-]{1,40}$")


def _word(value) -> str | None:
    """A config value fit for a line: a short plain name, else None (the config is untrusted)."""
    return value if isinstance(value, str) and _NAME.match(value) else None


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 20 else None


@dataclass(frozen=True)
class Scheme:
    """One checkpoint's quantization, read from its config: `format` a FORMATS key (or "modelslim", or the
    unread method), `route` native / convert / refused, `label` what the user reads (`describe`), `why` the
    route's reason, `params` what the layout rules need."""
    format: str
    route: str
    label: str
    why: str
    params: dict = field(default_factory=dict)


def quantization_config(config: dict) -> dict | None:
    """The checkpoint's quantization_config (compressed-tensors' older `compression_config` too), or None."""
    quant = config.get("quantization_config") or config.get("compression_config")
    return quant if quant else None


def kv_cache_scheme(config: dict):
    """The checkpoint's quantized KV cache (compressed-tensors' `kv_cache_scheme`, upstream's C8), or None."""
    quant = quantization_config(config)
    return quant.get("kv_cache_scheme") if isinstance(quant, dict) else None


# ---- what the user reads ------------------------------------------------------------------------
def describe(quant: dict) -> str:
    """The quantization in a few words, e.g. `block-FP8 (quant_method fp8, weight_block_size 128x128)`."""
    method = _word(quant.get("quant_method"))
    if method is None:
        return "a quant_method this line does not show"
    if method == "fp8":
        block = quant.get("weight_block_size")
        fmt = _word(quant.get("fmt"))
        kind = f", fmt {fmt}" if fmt and fmt != "e4m3" else ""
        if isinstance(block, list) and len(block) == 2 and all(_count(b) for b in block):
            return f"block-FP8 (quant_method fp8{kind}, weight_block_size {block[0]}x{block[1]})"
        return f"FP8 (quant_method fp8{kind}, per tensor or channel)"
    if method == "mxfp4":
        return "MXFP4 (quant_method mxfp4)"
    if method in ("awq", "gptq"):
        bits, group = _count(quant.get("bits", quant.get("w_bit"))), quant.get("group_size", quant.get("q_group_size"))
        # the layout, where it is not the method's usual one (AWQ's GEMM, GPTQ's gptq)
        version = _word(quant.get("version" if method == "awq" else "checkpoint_format"))
        version = None if version is None or version.lower() == {"awq": "gemm", "gptq": "gptq"}[method] else version
        detail = ", ".join(part for part in (f"{'version' if method == 'awq' else 'checkpoint_format'} {version}"
                                             if version else None,
                                             f"int{bits} weights" if bits else None,
                                             f"group size {group}" if _count(group) else
                                             "one group per row" if group == -1 else None,
                                             "act-order" if method == "gptq" and quant.get("desc_act") is True else None)
                           if part)
        return f"{method.upper()} (quant_method {method}{', ' + detail if detail else ''})"
    if method in ("compressed-tensors", "compressed_tensors"):
        schemes = sorted({scheme for group in (quant.get("config_groups") or {}).values() if isinstance(group, dict)
                          for scheme in [_ct_scheme(group)] if scheme})
        fmt = _word(quant.get("format"))
        detail = ", ".join(schemes + ([f"format {fmt}"] if fmt else []))
        return f"compressed-tensors ({detail})" if detail else "compressed-tensors"
    if method == "bitsandbytes":
        kind = "4-bit " + (_word(quant.get("bnb_4bit_quant_type")) or "") if quant.get("load_in_4bit") else \
            "8-bit" if quant.get("load_in_8bit") else ""
        return f"bitsandbytes ({kind.strip()})" if kind.strip() else "bitsandbytes"
    return f"quant_method {method}"


def _ct_scheme(group: dict) -> str | None:
    """compressed-tensors' config group as W{bits}A{bits} with the weights' number type, e.g. `int8 W8A8`, and
    how the activations are quantized where the group says (`dynamic per token`, `static per tensor`)."""
    weights, inputs = group.get("weights"), group.get("input_activations")
    if not isinstance(weights, dict) or not _count(weights.get("num_bits")):
        return None
    kind = {"int": "int", "float": "fp"}.get(weights.get("type", "int"), "")
    act = _count(inputs.get("num_bits")) if isinstance(inputs, dict) else None
    how = ""
    if act and isinstance(inputs.get("dynamic"), bool):
        strategy = _word(inputs.get("strategy"))
        how = f" {'dynamic' if inputs['dynamic'] else 'static'}{' per ' + strategy if strategy else ''}"
    return f"{kind}{weights['num_bits']} W{weights['num_bits']}A{act or 16}{how}"


# ---- the native route ---------------------------------------------------------------------------
def _dynamic_token_w8a8_int8(quant: dict) -> bool:
    """upstream's `is_dynamic_token_w8a8_int8` over every config group: 8-bit int weights by channel or tensor,
    static, symmetric; 8-bit int activations by token, dynamic — in a format that stores quantized weights."""
    if quant.get("format") not in CT_FORMATS:
        return False
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return False
    for group in groups.values():
        if not isinstance(group, dict):
            return False
        weights, acts = group.get("weights") or {}, group.get("input_activations") or {}
        if not (isinstance(weights, dict) and isinstance(acts, dict)):
            return False
        if not (weights.get("num_bits") == 8 and weights.get("type", "int") == "int" and not weights.get("dynamic")
                and weights.get("symmetric", True) and weights.get("strategy") in ("channel", "tensor")
                and acts.get("num_bits") == 8 and acts.get("type", "int") == "int" and acts.get("dynamic") is True
                and acts.get("strategy") == "token"):
            return False
    return True


def is_w8a8(config: dict) -> bool:
    """The checkpoint is compressed-tensors W8A8 int8 as upstream's loader runs it on the NPU (route `native`;
    what agent.migrate.quantize writes). Never raises: the config is only asked."""
    quant = quantization_config(config)
    return isinstance(quant, dict) and quant.get("quant_method") in ("compressed-tensors", "compressed_tensors") \
        and _dynamic_token_w8a8_int8(quant)


# ---- the formats: how each is read from its config ------------------------------------------------
CONVERTED = "dequantized to bf16 at migration"


def _fp8(q: dict) -> Scheme:
    label = describe(q)
    block = q.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2 and all(_count(b) for b in block)):
        raise InputError("config.json: quantization_config.weight_block_size must be two positive integers; "
                         "use the config.json that came with these weights")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        return Scheme("fp8", "refused", label, f"fp8 {_word(fmt) or 'of another kind'} weights: the migrator "
                      "dequantizes e4m3 only, the fp8 transformers' fine-grained fp8 reads")
    return Scheme("fp8", "convert", label, f"no fp8 matmul on Atlas A2/A3: {CONVERTED}",
                  {"block": block, "activation_scheme": q.get("activation_scheme", "dynamic")})


def _mxfp4(q: dict) -> Scheme:
    return Scheme("mxfp4", "convert", describe(q),
                  f"no fp4 matmul on Atlas A2/A3: {CONVERTED} (exact: e2m1 x 2^k is a bf16 value)")


def _compressed_tensors(q: dict) -> Scheme:
    label = describe(q)
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
        raise InputError("config.json: quantization_config (compressed-tensors) has no config_groups; use the "
                         "config.json that came with these weights")
    if _dynamic_token_w8a8_int8(q):
        return Scheme("compressed-tensors", "native", label, "upstream's module/quantization runs it on Atlas A2/A3 "
                      "(npu_dynamic_quant + npu_quant_matmul): served as published", {"config": q})
    schemes = set()
    for name, group in groups.items():
        weights, acts = group.get("weights"), group.get("input_activations")
        if not isinstance(weights, dict):
            raise InputError(f"config.json: compressed-tensors group {_word(name) or ''!r} has no 'weights' "
                             "arguments; use the config.json that came with these weights")
        acts = acts if isinstance(acts, dict) else None
        bits, kind = weights.get("num_bits"), weights.get("type", "int")
        fmt = group.get("format") or q.get("format")
        if fmt not in CT_FORMATS:
            return Scheme("compressed-tensors", "refused", label, f"format {_word(fmt) or 'of another kind'}: the "
                          f"migrator reads quantized weights stored {', '.join(CT_FORMATS)}")
        weights_only = acts is None
        int8_acts = acts is not None and acts.get("type", "int") == "int" and acts.get("num_bits") == 8
        fp8_acts = acts is not None and acts.get("type") == "float" and acts.get("num_bits") == 8
        if not ((kind == "int" and bits in (4, 8) and weights_only) or (kind == "int" and bits == 8 and int8_acts)
                or (kind == "float" and bits == 8 and (weights_only or fp8_acts))):
            return Scheme("compressed-tensors", "refused", label,
                          f"group {_word(name) or ''!r}: {_ct_scheme(group) or 'its weights'} is not a scheme the "
                          "migrator reads (int8 W8A8, int4/int8 weight-only, fp8)")
        schemes.add((kind, bits, weights.get("strategy"), weights.get("group_size"), fmt))
    if len(schemes) > 1:
        # one dequantization for the whole checkpoint: which group a module belongs to is not read
        return Scheme("compressed-tensors", "refused", label, "config groups of different weight schemes")
    return Scheme("compressed-tensors", "convert", label,
                  f"no route for it on Atlas A2/A3 in upstream's module/quantization: {CONVERTED}", {"config": q})


def _awq(q: dict) -> Scheme:
    label = describe(q)
    version = str(q.get("version", "gemm")).lower()
    bits, group = q.get("bits", q.get("w_bit", 4)), q.get("group_size", q.get("q_group_size", 128))
    if version != "gemm" or bits != 4 or not _count(group):
        return Scheme("awq", "refused", label, "the migrator reads AutoAWQ's GEMM layout of 4-bit weights with a "
                      "positive group size")
    return Scheme("awq", "convert", label, f"no AWQ route in upstream's module/quantization: {CONVERTED}",
                  {"bits": bits, "group_size": group, "zero_point": q.get("zero_point", True)})


def _gptq(q: dict) -> Scheme:
    label = describe(q)
    bits, group = q.get("bits", 4), q.get("group_size", 128)
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    if bits not in (2, 4, 8) or fmt not in ("gptq", "gptq_v2") or not (_count(group) or group == -1):
        return Scheme("gptq", "refused", label, "the migrator reads checkpoint_format gptq / gptq_v2 with 2, 4 or "
                      "8 bits and a positive group size (or -1)")
    return Scheme("gptq", "convert", label, f"no GPTQ route in upstream's module/quantization: {CONVERTED}",
                  {"bits": bits, "group_size": group, "v1": fmt == "gptq"})


FORMATS = {"fp8": _fp8, "mxfp4": _mxfp4, "compressed-tensors": _compressed_tensors,
           "compressed_tensors": _compressed_tensors, "awq": _awq, "gptq": _gptq}
