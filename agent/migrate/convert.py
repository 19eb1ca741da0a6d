"""Convert a quantized checkpoint the NPU cannot compute into bf16 (SPEC §9), streaming.

`convert_checkpoint(src, dest)` writes, for each safetensors shard of `src`, a shard of the same name in
`dest`: the quantized weights (agent.migrate.quantization's accounting) dequantized, every other tensor copied
byte for byte, the config without `quantization_config`, every other file of the checkpoint (tokenizer, the
repo's code, generation config) copied. Each shard's header is computed first and its tensors written one
after another, each read from the source file by offset (no mmap, nothing loaded whole): what is held at a
time is one tensor's parts, a large weight in row chunks of CHUNK_BYTES of output (vLLM-Ascend's
block-FP8 dequantization on pre-950 NPUs works in bounded CPU chunks the same way). The folder is written
beside its destination and renamed into place once complete.

The dequantization of each format follows its published definition (agent.migrate.quantization) and is held,
tensor by tensor, to transformers' own (FineGrainedFP8's Fp8Dequantize, Mxfp4's convert_moe_packed_tensors)
and compressed-tensors' decompressors in tests/unit/agent/migrate/test_convert.py. The arithmetic is done
in float32 and rounded once to the output dtype, as those references do; AWQ, GPTQ and compressed-tensors
round to the scales' dtype first, as their kernels compute in it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from agent.errors import FilesystemFault, InputError, UnsupportedModelError
from agent.migrate.quantization import (Accounting, QuantizedTensor, TensorInfo, account, converter, read_tensors,
                                        refusal, scheme_of)
from agent.quantization_formats import quantization_config
from engine.safe_load import load_json

CHUNK_BYTES = 16 * 2**20      # output bytes of one piece of a large weight
OUTPUT_DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}
SAFETENSORS_TORCH = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                     "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                     "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8}
WEIGHT_INDEX = "model.safetensors.index.json"
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


# ---- reading a shard by offsets ---------------------------------------------------------------------
class ShardReader:
    """One safetensors file: its header, and tensors (or row ranges of them) read by offset into fresh
    buffers. `reads` counts the bytes of every read (what the streaming test inspects)."""

    def __init__(self, path: Path):
        from engine.safe_load import loads_json

        self.path = Path(path)
        with open(self.path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            self.header = loads_json(f.read(length).decode("utf-8"), f"{path}: safetensors header",
                                     max_bytes=100 * 2**20)
        self.data_start = 8 + length
        self.reads: list[int] = []

    def info(self, name: str) -> dict:
        return self.header[name]

    def raw(self, name: str, start: int = 0, stop: int | None = None) -> bytes:
        begin, end = self.header[name]["data_offsets"]
        stop = end - begin if stop is None else stop
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin + start)
            data = f.read(stop - start)
        self.reads.append(len(data))
        return data

    def tensor(self, name: str, rows: tuple[int, int] | None = None):
        """The tensor, or rows [r0, r1) of its first dimension."""
        import torch

        meta = self.header[name]
        shape = list(meta["shape"])
        dtype = getattr(torch, SAFETENSORS_TORCH[meta["dtype"]])
        row_bytes = (math.prod(shape[1:]) if len(shape) > 1 else 1) * DTYPE_BYTES[meta["dtype"]]
        if rows is None:
            data = self.raw(name)
        else:
            data = self.raw(name, rows[0] * row_bytes, rows[1] * row_bytes)
            shape = [rows[1] - rows[0], *shape[1:]]
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


# ---- the dequantizations ----------------------------------------------------------------------------
def dequant_fp8(weight, scale, block: list[int] | None, out_dtype):
    """fp8 e4m3 x scale_inv: per (bm x bn) block, the last block of a dimension partial (DeepSeek-V3's
    weight_dequant), or one scale for the tensor. Each block times its scale (no weight-sized grid of scales)."""
    import torch

    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if not block:
        return (w * s.reshape(())).to(out_dtype)
    bm, bn = block
    *lead, rows, cols = w.shape
    grid_rows, grid_cols = s.shape[-2:]
    if (rows, cols) != (grid_rows * bm, grid_cols * bn):       # partial blocks: zero-padded to whole ones
        padded = w.new_zeros(*lead, grid_rows * bm, grid_cols * bn)
        padded[..., :rows, :cols] = w
        w = padded
    out = (w.view(*lead, grid_rows, bm, grid_cols, bn) * s.view(*lead, grid_rows, 1, grid_cols, 1))
    return out.view(*lead, grid_rows * bm, grid_cols * bn)[..., :rows, :cols].to(out_dtype)


def dequant_mxfp4(blocks, scales, out_dtype):
    """gpt-oss expert blocks [E, rows, groups, 16] + e8m0 scales [E, rows, groups] -> [E, groups*32, rows]
    (the bf16 checkpoint's layout: transformers' convert_moe_packed_tensors transposes the same way)."""
    import torch

    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    experts, rows, groups, width = blocks.shape
    b = blocks.reshape(-1, width)
    out = torch.empty(b.shape[0], width * 2, dtype=torch.float32)
    out[:, 0::2] = lut[(b & 0x0F).long()]
    out[:, 1::2] = lut[(b >> 4).long()]
    out = torch.ldexp(out, scales.reshape(-1, 1).to(torch.int32) - 127)
    return out.reshape(experts, rows, groups * width * 2).transpose(1, 2).contiguous().to(out_dtype)


def _unpack_rows(packed, bits: int, columns: int):
    """int32 words holding 32/bits values along the last dim, lowest bits first -> [rows, columns]."""
    import torch

    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per)[..., :columns]


def dequant_compressed_tensors(parts: dict, bits: int, packed: bool, out_dtype, group_size=None):
    """compressed-tensors' dequantize: (q - zero_point) x scale per tensor, channel or group, in the
    scale's dtype; pack-quantized words unpacked and shifted back by 2^(bits-1) first."""
    import torch

    scale = parts["scale"]
    if packed:
        shape = [int(v) for v in parts["shape"].tolist()]
        q = _unpack_rows(parts["weight"], bits, shape[1]).to(torch.int32) - (1 << (bits - 1))
    else:
        q = parts["weight"]
    q = q.to(torch.float32)
    zero = parts.get("zero")
    if zero is not None:
        zero = zero.to(torch.float32)
    s = scale.to(torch.float32)
    columns = q.shape[-1]
    if s.numel() == 1:
        grid_s, grid_z = s.reshape(()), zero.reshape(()) if zero is not None else None
    elif s.shape[-1] == 1:
        grid_s, grid_z = s, zero
    else:
        g_idx = parts.get("g_idx")
        if g_idx is not None and not bool((g_idx < 0).any()):
            index = g_idx.long()
        else:
            index = torch.arange(columns) // (group_size or -(-columns // s.shape[-1]))
        grid_s = s[:, index]
        grid_z = zero.reshape(s.shape)[:, index] if zero is not None else None
    value = q - grid_z if grid_z is not None else q
    return (value * grid_s).to(scale.dtype).to(out_dtype)


def dequant_awq(qweight, qzeros, scales, group_size: int, out_dtype):
    """AutoAWQ's dequantize_gemm: nibbles unpacked, AWQ's order reversed, (q - z) x s in the scales'
    dtype -> [in, out]; the linear weight is its transpose [out, in]."""
    import torch

    bits = 4
    order = torch.arange(qweight.shape[-1] * 8).view(-1, 8)[:, list(AWQ_REVERSE_ORDER)].reshape(-1)
    q = _unpack_rows(qweight, bits, qweight.shape[-1] * 8)[:, order]
    z = _unpack_rows(qzeros, bits, qzeros.shape[-1] * 8)[:, order]
    z = z.repeat_interleave(group_size, dim=0)[: q.shape[0]]
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=0)[: q.shape[0]]
    w = ((q - z).to(torch.float32) * s).to(scales.dtype)
    return w.t().contiguous().to(out_dtype)


def dequant_gptq(qweight, qzeros, scales, g_idx, bits: int, group_size: int, v1: bool, out_dtype):
    """GPTQ's torch dequantization: qweight packed along the input dim, qzeros along the output dim (stored
    minus one in checkpoint_format gptq), s x (q - z) by each input row's group (g_idx) -> the [out, in]
    linear weight."""
    import torch

    rows = qweight.shape[0] * (32 // bits)
    q = _unpack_rows(qweight.t().contiguous(), bits, rows).t()            # [in, out]
    z = _unpack_rows(qzeros, bits, scales.shape[-1])                      # [groups, out]
    if v1:
        z = z + 1
    if g_idx is None:
        g_idx = torch.arange(rows) // (group_size if group_size > 0 else rows)
    g = g_idx.long()
    w = ((q - z[g]).to(torch.float32) * scales.to(torch.float32)[g]).to(scales.dtype)
    return w.t().contiguous().to(out_dtype)


# ---- one output tensor -------------------------------------------------------------------------------
@dataclass
class Output:
    """A tensor of the converted shard: its name, safetensors dtype, shape, and where its bytes come from."""
    name: str
    dtype: str
    shape: list[int]
    quantized: QuantizedTensor | None = None      # None: copied as published
    source: str | None = None

    @property
    def nbytes(self) -> int:
        return (math.prod(self.shape) if self.shape else 1) * DTYPE_BYTES[self.dtype]


class Sources:
    """The source shards, opened on demand (a scale stored in another shard than its weight is read there)."""

    def __init__(self, src: Path, tensors: dict[str, TensorInfo]):
        self.src, self.tensors, self.readers = src, tensors, {}

    def reader(self, name: str) -> ShardReader:
        file = self.tensors[name].file
        if file not in self.readers:
            self.readers[file] = ShardReader(self.src / file)
        return self.readers[file]

    def tensor(self, name: str, rows=None):
        return self.reader(name).tensor(name, rows)

    def bytes_read(self) -> list[int]:
        return [n for r in self.readers.values() for n in r.reads]


def _pieces(out: Output, q: QuantizedTensor, sources: Sources, out_dtype) -> Callable:
    """A generator of the output's bytes in pieces of about CHUNK_BYTES (large fp8 weights by row blocks,
    mxfp4 experts a few at a time; the packed integer formats a tensor at once)."""
    import torch

    def as_bytes(t):
        return t.contiguous().view(torch.uint8).numpy().tobytes()

    def generate():
        parts = q.parts
        if q.kind == "fp8":
            block = q.params.get("block")
            shape = q.shape
            if block and len(shape) == 2:
                rows_per = max(block[0], CHUNK_BYTES // max(1, shape[1] * 4) // block[0] * block[0])
                for r0 in range(0, shape[0], rows_per):
                    r1 = min(shape[0], r0 + rows_per)
                    w = sources.tensor(parts["weight"], (r0, r1))
                    s = sources.tensor(parts["scale"], (r0 // block[0], -(-r1 // block[0])))
                    yield as_bytes(dequant_fp8(w, s, block, out_dtype))
            else:
                yield as_bytes(dequant_fp8(sources.tensor(parts["weight"]), sources.tensor(parts["scale"]), block,
                                           out_dtype))
        elif q.kind == "mxfp4":
            # an expert's blocks are [rows, groups, 16]; its output [groups * 32, rows] is the transpose, so a piece
            # is a range of groups (output rows) over all of the expert's rows
            experts, width, rows = q.shape
            groups_per = max(1, CHUNK_BYTES // max(1, rows * 32 * 4))
            for e in range(experts):
                blocks, scales = sources.tensor(parts["blocks"], (e, e + 1)), sources.tensor(parts["scales"], (e, e + 1))
                for g0 in range(0, blocks.shape[2], groups_per):
                    g1 = min(blocks.shape[2], g0 + groups_per)
                    yield as_bytes(dequant_mxfp4(blocks[:, :, g0:g1].contiguous(), scales[:, :, g0:g1].contiguous(),
                                                 out_dtype))
        elif q.kind == "compressed-tensors":
            loaded = {role: sources.tensor(name) for role, name in parts.items()}
            yield as_bytes(dequant_compressed_tensors(loaded, q.params["bits"], q.params["packed"], out_dtype,
                                                      q.params.get("group_size")))
        elif q.kind == "awq":
            yield as_bytes(dequant_awq(sources.tensor(parts["weight"]), sources.tensor(parts["zero"]),
                                       sources.tensor(parts["scale"]), q.params["group_size"], out_dtype))
        elif q.kind == "gptq":
            g_idx = sources.tensor(parts["g_idx"]) if "g_idx" in parts else None
            yield as_bytes(dequant_gptq(sources.tensor(parts["weight"]), sources.tensor(parts["zero"]),
                                        sources.tensor(parts["scale"]), g_idx, q.params["bits"],
                                        q.params["group_size"], q.params["v1"], out_dtype))
        else:
            raise AssertionError(f"no dequantization for {q.kind}")

    return generate


def _copy_pieces(name: str, sources: Sources) -> Callable:
    def generate():
        reader = sources.reader(name)
        begin, end = reader.info(name)["data_offsets"]
        for start in range(0, end - begin, CHUNK_BYTES):
            yield reader.raw(name, start, min(end - begin, start + CHUNK_BYTES))

    return generate


def release_freed_memory() -> None:
    """Hand the memory of the tensors just freed back to the OS (glibc keeps freed heap for reuse: measured on the
    DeepSeek-V3 shapes, 192 MiB of growth over a conversion without it, 72 MiB with it after each piece); nothing elsewhere."""
    import ctypes
    import ctypes.util

    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
            _LIBC = _LIBC if _LIBC and hasattr(_LIBC, "malloc_trim") else False
        except OSError:
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


# ---- the plan and the writer ------------------------------------------------------------------------
def plan_outputs(accounting: Accounting, tensors: dict[str, TensorInfo], sources: Sources,
                 out_dtype: str) -> dict[str, list[Output]]:
    """Source shard file -> the outputs written into the shard of the same name: a quantized tensor goes
    where its weight (or blocks) is, every kept tensor where it was, in the source's order."""
    dtype_name = OUTPUT_DTYPES[out_dtype][0]
    by_part = {q.parts.get("weight") or q.parts["blocks"]: q for q in accounting.quantized}
    kept = set(accounting.kept)
    shards: dict[str, list[Output]] = {}
    for name, info in tensors.items():
        shards.setdefault(info.file, [])
        if name in by_part:
            q = by_part[name]
            shape = list(q.shape)
            if "shape" in q.parts:         # pack-quantized: the true width is the published weight_shape
                shape = [int(v) for v in sources.tensor(q.parts["shape"]).tolist()]
                q.shape = shape
            shards[info.file].append(Output(q.output, dtype_name, shape, quantized=q))
        elif name in kept:
            shards[info.file].append(Output(name, info.dtype, list(info.shape), source=name))
    return shards


def _header(outputs: list[Output], metadata: dict | None = None) -> bytes:
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for out in outputs:
        header[out.name] = {"dtype": out.dtype, "shape": out.shape, "data_offsets": [offset, offset + out.nbytes]}
        offset += out.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)      # safetensors aligns the data to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


def converted_bytes(accounting: Accounting, tensors: dict[str, TensorInfo], out_dtype: str = "bfloat16") -> int:
    """Bytes of the converted checkpoint's tensors (before writing: the disk it needs, the memory it loads into)."""
    size = OUTPUT_DTYPES[out_dtype][1]
    return sum(math.prod(q.shape) * size for q in accounting.quantized) + \
        sum(tensors[n].numel * DTYPE_BYTES.get(tensors[n].dtype, 4) for n in accounting.kept)


class PeakRss:
    """The process's resident memory, sampled every 20 ms while the conversion runs (psutil)."""

    def __init__(self):
        import psutil

        self.process = psutil.Process()
        self.start = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


def redo_command(src: Path, dest: Path, out_dtype: str, trust_remote_code: bool = True) -> str:
    import shlex

    extra = "" if out_dtype == "bfloat16" else f" --dtype {out_dtype}"
    extra += "" if trust_remote_code else " --without-remote-code"
    return f"migrator convert {shlex.quote(str(src))} {shlex.quote(str(dest))}{extra}"


def convert_checkpoint(src: Path, dest: Path, tree, out_dtype: str = "bfloat16",
                       log: Callable[[str], None] | None = None, trust_remote_code: bool = True) -> dict:
    """`src` (a quantized checkpoint the migrator reads: route `convert`, or `native` by hand — compressed-tensors
    W8A8 int8, which a migration serves as published) written converted to `dest` through `tree` (a UserTree
    holding dest's folder). Returns the record migration_report.json keeps (`conversion`)."""
    import torch

    src, dest = Path(src), Path(dest)
    config = load_json(src / "config.json")
    scheme = scheme_of(config, src)
    if scheme is None:
        raise InputError(f"{src}: config.json has no quantization_config; nothing to convert")
    if scheme.route == "refused":
        raise UnsupportedModelError(f"{src}: {refusal(config, src, scheme=scheme)}")
    if out_dtype not in OUTPUT_DTYPES:
        raise InputError(f"--dtype {out_dtype}: the converted checkpoint is one of {', '.join(OUTPUT_DTYPES)}")
    tensors = read_tensors(src)
    accounting = account(scheme, tensors)
    sources = Sources(src, tensors)
    need = converted_bytes(accounting, tensors, out_dtype)
    tree.mkdir(dest.parent)
    free = shutil.disk_usage(dest.parent).free
    if need > free:
        raise FilesystemFault(f"{dest.parent}: the converted checkpoint needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB "
                              "are free; free space or convert elsewhere with `migrator convert SRC DEST`")
    log = log or (lambda line: print(f"[migrator] {line}", file=sys.stderr))
    staging = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    tree.rmtree(staging)
    tree.mkdir(staging)
    shards = plan_outputs(accounting, tensors, sources, out_dtype)
    largest_shard = max((src / f).stat().st_size for f in shards)
    started = time.monotonic()
    weight_map, total = {}, 0
    try:
        with PeakRss() as rss, torch.inference_mode():
            for i, (file, outputs) in enumerate(sorted(shards.items()), 1):
                t0 = time.monotonic()
                with tree.open(staging / file, "wb") as f:
                    f.write(_header(outputs, {"format": "pt"}))
                    for out in outputs:
                        pieces = _pieces(out, out.quantized, sources, getattr(torch, out_dtype)) if out.quantized \
                            else _copy_pieces(out.source, sources)
                        written = 0
                        for piece in pieces():
                            f.write(piece)
                            written += len(piece)
                            del piece
                            release_freed_memory()
                        if written != out.nbytes:
                            raise AssertionError(f"{out.name}: wrote {written} bytes, its header says {out.nbytes}")
                        weight_map[out.name] = file
                        total += out.nbytes
                log(f"convert: shard {i}/{len(shards)} {file} in {time.monotonic() - t0:.1f}s")
            _write_side_files(src, staging, tree, config, out_dtype, weight_map, total, trust_remote_code)
        tree.rmtree(dest)
        tree.replace(staging, dest)
    except BaseException:
        tree.rmtree(staging)
        raise
    return {
        "format": scheme.label, "route": scheme.route, "why": scheme.why, "source": str(src), "path": str(dest),
        "dtype": out_dtype, "command": redo_command(src, dest, out_dtype, trust_remote_code or not _names_code(src)),
        # upstream's own converter of the same checkpoint, where one reads it (NPU hosts have it at hand)
        "upstream_converter": converter(config, quantization_config(config) or {}, str(src)),
        "tensors": accounting.counts(),
        "dropped": sorted(accounting.dropped), "seconds": round(time.monotonic() - started, 3),
        "bytes_written": total, "largest_source_shard_bytes": largest_shard,
        "largest_read_bytes": max(sources.bytes_read(), default=0),
        "peak_rss_bytes": rss.peak, "rss_before_bytes": rss.start,
    }


def _write_side_files(src: Path, staging: Path, tree, config: dict, out_dtype: str, weight_map: dict,
                      total: int, trust_remote_code: bool = True) -> None:
    """config.json without quantization_config (dtype the output's), the index of the new shards, and every
    other regular file of the checkpoint (tokenizer, generation config, the repo's code) as published; without
    `trust_remote_code`, config.json and tokenizer_config.json without their auto_map (without_remote_code)."""
    from agent.migrate.checkpoint_check import WEIGHT_SUFFIXES

    written = dict(config)
    written.pop("quantization_config", None)
    written.pop("compression_config", None)
    written["torch_dtype"] = out_dtype
    if "dtype" in written:
        written["dtype"] = out_dtype
    tree.write_text(staging / "config.json", json.dumps(written, indent=2) + "\n")
    if (src / WEIGHT_INDEX).is_file() or len(set(weight_map.values())) > 1:
        tree.write_text(staging / WEIGHT_INDEX, json.dumps({"metadata": {"total_size": total},
                                                            "weight_map": weight_map}, indent=2) + "\n")
    for path in sorted(src.iterdir()):
        # regular files (a --weights merge links them: followed); folders (gpt-oss's original/) are not the checkpoint
        if path.name in ("config.json", WEIGHT_INDEX) or path.name.endswith(WEIGHT_SUFFIXES) \
                or path.name.endswith(".index.json") or not path.is_file():
            continue
        tree.copy(path, staging / path.name)
    if not trust_remote_code:
        strip_auto_map(staging, tree)


def strip_auto_map(folder: Path, tree) -> list[str]:
    """config.json and tokenizer_config.json of `folder` (written by the migrator) without `auto_map`: upstream's
    executor loads the config, tokenizer and generation config with trust_remote_code=True, so a checkpoint the
    recipe runs must not name the repo's code unless the user consented (--trust-remote-code). Returns the files
    changed."""
    changed = []
    for name in ("config.json", "tokenizer_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        data = load_json(path)
        if isinstance(data, dict) and "auto_map" in data:
            data.pop("auto_map")
            tree.unlink(path)           # a view's link to the user's file: never written through
            tree.write_text(path, json.dumps(data, indent=2) + "\n")
            changed.append(name)
    return changed


CONVERTED_FOLDER = "{dtype}"            # in the recipe's run checkpoints folder (agent.recipe.targets)
VIEW_FOLDER = "without-auto-map"


def for_recipe(model_dir: Path, recipe_dir: Path, out_dtype: str = "bfloat16",
               trust_remote_code: bool = False) -> tuple[Path, dict | None]:
    """The checkpoint a new recipe runs: `model_dir` itself; for a format the NPU cannot compute, its
    conversion in the recipe's state folder (`.migrator/checkpoints/`, inside a checkout `res/.migrator/…`: never
    in the user's source folder) and the record of it; for a repo whose auto_map transformers' own class serves (no
    --trust-remote-code), a view of it there — links to its files, config.json / tokenizer_config.json without
    auto_map — since upstream's executor loads with trust_remote_code=True and would run the repo's code. The
    recipe folder was empty or absent (node_acquire checked): a failure removes what this made. The recipe is
    published around it (agent.workflow.store.publish)."""
    from agent.recipe.fs_guard import user_tree
    from agent.recipe.targets import run_checkpoints_dir, state_parts

    model_dir, recipe_dir = Path(model_dir), Path(recipe_dir)
    config = load_json(model_dir / "config.json")
    scheme = scheme_of(config, model_dir)
    converting = scheme is not None and scheme.route == "convert"
    names_code = _names_code(model_dir)
    if not converting and (trust_remote_code or not names_code):
        return model_dir, None
    tree = user_tree(recipe_dir.parent, "the output folder")
    existed = recipe_dir.exists()         # an empty folder the user made is kept; what we made in it is not
    try:
        if converting:
            dest = run_checkpoints_dir(recipe_dir) / CONVERTED_FOLDER.format(dtype=out_dtype)
            print(f"[migrator] {model_dir.name}: weights are {scheme.label}; {scheme.why} into {dest}", file=sys.stderr)
            return dest, convert_checkpoint(model_dir, dest, tree, out_dtype, trust_remote_code=trust_remote_code)
        dest = run_checkpoints_dir(recipe_dir) / VIEW_FOLDER
        tree.mkdir(dest)
        for path in sorted(model_dir.iterdir()):
            tree.symlink(path.resolve(), dest / path.name)
        changed = strip_auto_map(dest, tree)
        print(f"[migrator] {model_dir.name}: the recipe runs {dest}, links to its files with {' and '.join(changed)} "
              "naming no repo code (its launcher trusts remote code; --trust-remote-code keeps it)", file=sys.stderr)
        return dest, None
    except BaseException:
        tree.rmtree(recipe_dir / state_parts(recipe_dir)[0] if existed else recipe_dir)
        raise


def _names_code(model_dir: Path) -> bool:
    """config.json or tokenizer_config.json names the repo's own code (auto_map)."""
    return any(isinstance(data, dict) and "auto_map" in data
               for data in (load_json(model_dir / "config.json"), _tokenizer_config(model_dir)))


def _tokenizer_config(model_dir: Path) -> dict | None:
    path = model_dir / "tokenizer_config.json"
    try:
        return load_json(path) if path.is_file() else None
    except (OSError, ValueError):
        return None
