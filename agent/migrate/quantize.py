"""`--quantize w8a8`: a float checkpoint (bf16 / fp16 / fp32, or one converted to it) written as an int8
W8A8 checkpoint in the compressed-tensors format, with no calibration data: int8 weights, symmetric
per output channel; activations quantized per token at run time (dynamic), so nothing is measured.

The format is what both readers take:
* upstream's loader, cann-recipes-infer module/quantization/compressed_tensors (compressed_tensors.py
  `CompressedTensorsConfig.from_config` -> `is_dynamic_token_w8a8_int8` -> compressed_tensors_w8a8_int8.py
  `CompressedTensorsW8A8Int8LinearMethod`: `weight` int8 [out, in], `weight_scale` [out, 1], format
  "int-quantized", target "Linear", weights channel/static/symmetric, input activations
  token/dynamic/symmetric), as its own converter writes it (models/deepseek_r1/utils/convert_model.py
  `generate_quant_config`, `int_weight_quant`: scale = max|w| / 127, q = clamp(round(w / scale), ±127));
* transformers' compressed-tensors quantizer (`AutoModelForCausalLM.from_pretrained` on CPU), as
  compressed-tensors' own `ModelCompressor` writes it (scales in the weights' dtype, no zero point for
  a symmetric scheme).

What upstream's quantization skill keeps in float stays float (.agents/skills/model-infer-quantization:
SKILL.md 6.1 the output head, quantization-structure-cards.md B "router/topk 通常保持浮点"; its
deepseek converter's `generate_ignore_item`: kv_b_proj, the MoE gate, MTP's eh_proj / shared_head):
the output head, router gates, MLA's kv_b_proj by name (the checkpoint's `ignore` list); embeddings and
norms are no linear layers and are copied as they are, with every other tensor. Which tensors are
linear layers is transformers' own model of the config, built on the meta device.

Streaming: one shard is read (tensor by tensor, memory-mapped) and written at a time: memory is
bounded by the largest output shard, not the model. `quantize_w8a8` is the library function;
`python -m agent.migrate.quantize SRC DEST` the command that redoes it (named in the report).
MoE: the routed experts and the routers stay float (the `ignore` list names the module holding them, as
FusedMoEGMM's prefix is); the grouped matmul's int8 weights and MLA's int8 KV cache (C8) are not written yet.
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agent.errors import InputError
from agent.quantization_formats import is_w8a8  # noqa: F401 - the format this module writes
from agent.migrate.checkpoint_check import read_json_file, weight_files
from agent.recipe.fs_guard import user_tree

SCHEMES = ("w8a8",)
INDEX = "model.safetensors.index.json"
INT8_MAX = 127
# linear layers kept in float, by the last part of their name: the output head, router gates, MLA's kv_b_proj
FLOAT_HEADS = ("lm_head", "embed_out", "output")
FLOAT_GATES = ("gate", "router", "shared_expert_gate", "gating", "gate_linear")
FLOAT_NAMED = ("kv_b_proj",)
EXPERTS_RE = re.compile(r"\.experts\.\d+\.")       # a routed expert's own linear layer (per-expert modules)

WEIGHT_ARGS = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": "channel",
               "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax",
               "observer_kwargs": {}}
ACTIVATION_ARGS = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": "token",
                   "block_structure": None, "dynamic": True, "actorder": None, "observer": "memoryless",
                   "observer_kwargs": {}}
FORMAT = "compressed-tensors int-quantized W8A8 (int8 weights, symmetric per channel; int8 activations, dynamic per token)"


def quantization_config(ignore: list[str]) -> dict:
    """The config.json `quantization_config` of a W8A8 int8 checkpoint (see the module docs)."""
    return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(WEIGHT_ARGS),
                                          "input_activations": dict(ACTIVATION_ARGS), "output_activations": None,
                                          "format": "int-quantized"}},
            "format": "int-quantized", "ignore": sorted(ignore), "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "global_compression_ratio": None, "sparsity_config": {}}


@dataclass
class Plan:
    """What a W8A8 conversion of one checkpoint does: linear layers quantized, linear layers kept in float."""
    source: str
    quantized: list[str] = field(default_factory=list)      # module names: `NAME.weight` -> int8 + NAME.weight_scale
    kept_float: list[str] = field(default_factory=list)     # the checkpoint's `ignore`
    shards: list[str] = field(default_factory=list)


@dataclass
class Written:
    scheme: str
    source: str
    checkpoint: str
    format: str
    quantized_layers: int
    kept_float: list[str]
    shards: int
    bytes_before: int
    bytes_after: int
    seconds: float
    command: str

    def as_dict(self) -> dict:
        return asdict(self)


def redo_command(source: Path, destination: Path) -> str:
    import shlex

    return shlex.join([sys.executable, "-m", "agent.migrate.quantize", str(source), str(destination)])


def _float_moe_modules(model, tensors: dict) -> list[str]:
    """The modules of an MoE model kept float, as they are named in transformers' model and in the framework
    model (FusedMoEGMM's prefix `....experts`, the router's `....gate`): the routed experts (transformers 5
    holds them as one module of stacked 3-D tensors, which no `Linear` target reaches; the checkpoint's
    per-expert tensors are copied as they are) and routers that are no `nn.Linear` (transformers 5's TopK
    routers). Upstream's CompressedTensorsConfig.get_quant_method gives a layer its `ignore` names the float
    method; the grouped matmul's int8 weights (CompressedTensorW8A8Int8MoEGMMMethod) are not written yet."""
    import torch

    holders = {k[:i] for k in tensors for i in [k.find(".experts.")] if i > 0}
    kept = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or not name:
            continue
        if name.endswith(".experts") and name[: -len(".experts")] in holders:
            kept.append(name)
        elif keeps_float(name) and f"{name}.weight" in tensors:
            kept.append(name)
    return kept


def loader_keeps_float_experts() -> bool:
    """Whether the installed transformers loads the float experts of a W8A8 checkpoint of this module (experts
    in `ignore`) with its compressed-tensors quantizer: its own op, run on one float expert tensor. transformers
    5.0 merges the per-expert tensors as stored; later versions run CompressedTensorsDequantize before the
    merge (quantizers/base.py update_weight_conversions), which for an int scheme returns only `weight_packed`
    tensors, so the merge gets none (5.24: "torch.cat(): expected a non-empty list of Tensors")."""
    try:
        from transformers.integrations.compressed_tensors import CompressedTensorsDequantize
    except ImportError:
        return True
    from types import SimpleNamespace

    import torch
    from compressed_tensors.quantization import QuantizationConfig

    scheme = QuantizationConfig.model_validate(quantization_config(["model.layers.0.mlp.experts"]))
    quantizer = SimpleNamespace(compressor=SimpleNamespace(quantization_config=scheme))
    target = "model.layers.0.mlp.experts.down_proj"
    model = SimpleNamespace(get_parameter=lambda name: torch.zeros(1))
    try:
        out = CompressedTensorsDequantize(quantizer).convert(
            {"experts.*.down_proj.weight": [torch.ones(2, 2)]}, source_patterns=["experts.*.down_proj.weight"],
            target_patterns=["experts.down_proj"], full_layer_name=target, model=model)
    except Exception:  # noqa: BLE001 - an op that fails on a float tensor does not load it either
        return False
    return any(isinstance(v, (list, torch.Tensor)) and len(v) for v in out.values())


def keeps_float(name: str) -> bool:
    """A linear layer upstream's quantization keeps in float (see the module docs), by its name."""
    leaf = name.rsplit(".", 1)[-1]
    return (name in FLOAT_HEADS or leaf == "lm_head" or leaf in FLOAT_NAMED or leaf in FLOAT_GATES
            or leaf.endswith("_gate"))


def plan(model_dir: Path, *, checkable: bool = True) -> Plan:
    """Which linear layers of `model_dir` a W8A8 conversion quantizes; InputError (exit 2, one line) for a
    checkpoint it cannot convert: already quantized, weights not in safetensors, an architecture whose
    linear weights are not the checkpoint's tensors of the same name (renamed or fused at load). `checkable`
    (a migration: its verdict and cost load the written checkpoint with the installed transformers): also MoE
    where that transformers' loader drops the float experts (loader_keeps_float_experts)."""
    from agent.migrate.checkpoint_check import _build_on_meta, check_safetensors

    import shlex

    from agent.migrate.quantization import scheme_of

    config = read_json_file(model_dir / "config.json")
    scheme = scheme_of(config, model_dir)
    if scheme is not None:
        if scheme.route == "convert":
            raise InputError(f"--quantize w8a8: {model_dir} is already quantized ({scheme.label}); convert it to "
                             f"bf16 first (`migrator convert {shlex.quote(str(model_dir))} DEST`), then migrate DEST "
                             "with --quantize w8a8")
        raise InputError(f"--quantize w8a8: {model_dir} is already quantized ({scheme.format}); give it the float "
                         "(bf16/fp16/fp32) checkpoint")
    files = weight_files(model_dir)
    if not files or any(p.suffix != ".safetensors" for p in files):
        raise InputError(f"--quantize w8a8: {model_dir} has weights that are not *.safetensors "
                         f"({', '.join(sorted({p.suffix for p in files})) or 'none'}); convert them to safetensors first")
    if config.get("auto_map"):
        raise InputError("--quantize w8a8: the architecture is the repository's own code (auto_map); the "
                         "conversion reads transformers' own class of it, which this model has not")
    from transformers import AutoModelForImageTextToText

    from agent.recipe.text_decoder import auto_class_for

    if auto_class_for(config) is AutoModelForImageTextToText:
        # the W8A8 plan and its cost are a causal LM's; transformers runs this checkpoint as its image-text class
        raise InputError(f"--quantize w8a8: {model_dir} is an image-text checkpoint ({config.get('model_type')}), "
                         "served by its text decoder; --quantize does not convert image-text checkpoints yet: "
                         "migrate it without --quantize")
    tensors: dict[str, tuple[str, list[int]]] = {}
    shards = []
    for path in files:
        header = _header(path)
        shards.append(path.name)
        for name, shape in check_safetensors(path).items():
            tensors[name] = (header[name]["dtype"], shape)
    try:
        model = _build_on_meta(config)
    except Exception as exc:  # noqa: BLE001 - transformers' errors have many classes
        raise InputError(f"--quantize w8a8: transformers cannot build {config.get('model_type')!r} from "
                         f"config.json ({type(exc).__name__}); nothing was written") from None
    import torch

    result = Plan(source=str(model_dir), shards=shards)
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        key = f"{name}.weight"
        if keeps_float(name) or EXPERTS_RE.search(name):
            result.kept_float.append(name)
            continue
        if key not in tensors:
            raise InputError(f"--quantize w8a8: transformers' linear layer {name} has no tensor {key} in the "
                             f"checkpoint (the class renames or fuses it at load); {config.get('model_type')} is "
                             "not supported by --quantize yet")
        dtype, shape = tensors[key]
        if dtype not in ("BF16", "F16", "F32") or len(shape) != 2:
            raise InputError(f"--quantize w8a8: {key} is {dtype} {shape}, not a float matrix; give it the float "
                             "checkpoint")
        result.quantized.append(name)
    # MoE: the routed experts and the routers stay float, named in `ignore` by the module that holds them
    moe = _float_moe_modules(model, tensors)
    result.kept_float.extend(moe)
    if any(name.endswith(".experts") for name in moe):
        if checkable and not loader_keeps_float_experts():
            import transformers

            raise InputError(f"--quantize w8a8: {config.get('model_type')}'s MoE experts stay float in the W8A8 "
                             f"checkpoint, and transformers {transformers.__version__}'s compressed-tensors loader "
                             "drops float experts (CompressedTensorsDequantize keeps only packed ones), so nothing "
                             "could check the run; migrate with transformers 5.0 (upstream's pin), or without "
                             "--quantize")
    if not result.quantized:
        raise InputError(f"--quantize w8a8: {model_dir} has no linear layer to quantize")
    return result


def _header(path: Path) -> dict:
    import struct

    from engine.safe_load import loads_json

    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return loads_json(f.read(length).decode("utf-8"), f"{path}: safetensors header", max_bytes=length + 1)


def quantize_weight(weight):
    """(int8 [out, in], scale [out, 1] in the weight's float dtype): symmetric per output channel, scale =
    max|w| / 127 in that dtype (compressed-tensors stores it so), q = clamp(round(w / scale), -127, 127) with
    the stored scale (upstream's `int_weight_quant`). A row of zeros gets scale 1 (q is 0 whatever it is)."""
    import torch

    w = weight.float()
    stored = weight.dtype if weight.dtype in (torch.bfloat16, torch.float16) else torch.float32
    scale = (w.abs().amax(dim=1, keepdim=True) / INT8_MAX).to(stored)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(w / scale.float()).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_w8a8(model_dir: str | Path, destination: str | Path, *, tree=None, log=None) -> Written:
    """Write `model_dir` as a W8A8 checkpoint in `destination`, one shard at a time; `tree`: the UserTree of
    the folder it lies in (default: `destination` itself, which must be new or empty). Returns Written."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    model_dir, destination = Path(model_dir).resolve(), Path(destination).absolute()
    started = time.monotonic()
    layout = plan(model_dir, checkable=False)        # a migration checks it first (plan), with what loads it
    quantized = set(layout.quantized)
    if tree is None:        # a folder the user named: new, empty, or a W8A8 checkpoint written before (redone)
        if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
            if not _written_before(destination):
                raise InputError(f"{destination} exists and is not an empty folder or a W8A8 checkpoint; name a new one")
            tree = user_tree(destination, "the quantized checkpoint")
            for old in destination.iterdir():
                if old.is_file() or old.is_symlink():
                    tree.unlink(old)
        tree = tree or user_tree(destination, "the quantized checkpoint", create=True)
    tree.mkdir(destination)
    weight_map: dict[str, str] = {}
    total = 0
    for shard in layout.shards:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(model_dir / shard), framework="pt") as reader:
            for name in reader.keys():
                tensor = reader.get_tensor(name)
                module = name[: -len(".weight")] if name.endswith(".weight") else None
                if module in quantized:
                    q, scale = quantize_weight(tensor)
                    out[name], out[f"{module}.weight_scale"] = q, scale
                else:
                    out[name] = tensor
        for name, tensor in out.items():
            weight_map[name] = shard
            total += tensor.numel() * tensor.element_size()
        tree.write_with(destination / shard, lambda tmp, out=out: save_file(out, tmp, metadata={"format": "pt"}))
        del out
        if log:
            log(f"[migrator] --quantize w8a8: {shard} written")
    config = read_json_file(model_dir / "config.json")
    config["quantization_config"] = quantization_config(layout.kept_float)
    tree.write_text(destination / "config.json", json.dumps(config, indent=2) + "\n")
    tree.write_text(destination / INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": dict(
        sorted(weight_map.items()))}, indent=2) + "\n")
    skip = {*layout.shards, "config.json", INDEX, "pytorch_model.bin.index.json"}
    for path in sorted(model_dir.iterdir()):
        if path.name not in skip and path.is_file() and not path.name.endswith((".safetensors", ".bin", ".pt")):
            tree.copy(path, destination / path.name)
    return Written(scheme="w8a8", source=str(model_dir), checkpoint=str(destination), format=FORMAT,
                   quantized_layers=len(layout.quantized), kept_float=sorted(layout.kept_float),
                   shards=len(layout.shards), bytes_before=sum((model_dir / s).stat().st_size for s in layout.shards),
                   bytes_after=sum((destination / s).stat().st_size for s in layout.shards),
                   seconds=round(time.monotonic() - started, 2), command=redo_command(model_dir, destination))


def for_migration(scheme: str, model_dir: Path, recipe_dir: Path, output_dir: Path) -> dict:
    """`migrator run CKPT --quantize SCHEME`: the checkpoint written beside the recipe's state
    (agent.recipe.targets.state_dir: `.migrator/checkpoints/`, `res/.migrator/checkpoints/` in a checkout,
    never the user's source folder). The report's `quantization` (the workflow adds its cost:
    agent.measure.quant_cost.of_written)."""
    from agent.recipe.targets import run_checkpoints_dir

    if scheme not in SCHEMES:
        raise InputError(f"--quantize {scheme}: choose one of {', '.join(SCHEMES)}")
    model_dir, recipe_dir = Path(model_dir).resolve(), Path(recipe_dir)
    destination = run_checkpoints_dir(recipe_dir) / f"{model_dir.name}-{scheme}"
    tree = user_tree(Path(output_dir), "the output folder")
    tree.rmtree(destination)            # a run that stopped half way wrote it: written again, whole
    print(f"[migrator] --quantize {scheme}: writing {destination}", file=sys.stderr, flush=True)
    written = quantize_w8a8(model_dir, destination, tree=tree,
                            log=lambda line: print(line, file=sys.stderr, flush=True))
    return {**written.as_dict(), "source": str(model_dir)}


def _written_before(folder: Path) -> bool:
    try:
        return (folder / INDEX).is_file() and is_w8a8(read_json_file(folder / "config.json"))
    except InputError:
        return False


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m agent.migrate.quantize",
                                     description="write a float checkpoint as a W8A8 int8 compressed-tensors one")
    parser.add_argument("source", help="the float (bf16/fp16/fp32) checkpoint folder")
    parser.add_argument("destination", help="the folder to write (replaced if it exists)")
    args = parser.parse_args(argv)
    source = Path(args.source).expanduser()
    if not (source / "config.json").is_file():
        print(f"error: {args.source}: no config.json (give a checkpoint folder)", file=sys.stderr)
        return 2
    try:
        written = quantize_w8a8(source, Path(args.destination).expanduser(),
                                log=lambda line: print(line, file=sys.stderr))
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(written.as_dict(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

