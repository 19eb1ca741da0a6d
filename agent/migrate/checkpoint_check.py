"""Checks on a local checkpoint before anything is written or run (SPEC §6: checkpoints are untrusted).

`check_checkpoint(model_dir)` reads `config.json`, the tokenizer files and the weight headers, and
raises one-line InputErrors (exit 2) naming the file, the field and what to do: a config that is not
a JSON object, fields of the wrong type or out of range, identifiers that are not Python names, a
UTF-8 BOM or bytes that are not UTF-8, empty or broken tokenizer files, missing, truncated or corrupt
weight files. Nothing here imports or runs code from the checkpoint.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any

from agent.errors import InputError
from agent.recipe.render import is_identifier

MAX_DIM = 2**31 - 1
# Sizes a model's shapes are built from: non-negative integers (or lists of them) when present.
POSITIVE_INTS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "vocab_size", "max_position_embeddings", "head_dim", "n_positions", "n_embd", "n_layer", "n_head",
    "n_inner", "d_model", "num_layers", "num_heads", "ffn_dim", "moe_intermediate_size", "num_experts",
    "num_local_experts", "num_experts_per_tok", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "v_head_dim", "max_sequence_length", "n_routed_experts", "n_shared_experts",
    "shared_expert_intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
)
OPTIONAL_POSITIVE_INTS = ("sliding_window",)   # null means "no sliding window"
# Sizes no model can have zero of.
CORE_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "n_embd", "n_layer",
              "n_head", "d_model", "max_position_embeddings", "n_positions")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
FLOATS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta", "initializer_range")
BOOLS = ("tie_word_embeddings", "is_decoder", "is_encoder_decoder", "use_cache")
DICTS = ("quantization_config", "rope_scaling", "rope_parameters", "auto_map", "text_config")
STRINGS = ("model_type", "torch_dtype", "dtype", "hidden_act", "transformers_version")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tokenizer_config.json")
JSON_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SAFETENSORS_DTYPES = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3",
                      "F8_E5M2", "U16", "U32", "U64", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64"}
MAX_HEADER_BYTES = 100 * 2**20   # safetensors' own limit


def read_json_file(path: Path, what: str | None = None) -> Any:
    """A JSON file of the checkpoint, with one-line errors for every way it can be broken."""
    what = what or path.name
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if raw.startswith(b"\xef\xbb\xbf"):
        raise InputError(f"{path}: starts with a UTF-8 byte-order mark, which transformers cannot read; "
                         "save it as UTF-8 without BOM")
    if not raw.strip():
        raise InputError(f"{path}: the file is empty; re-download {what}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start}); re-save {what} as UTF-8") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        where = f" at line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else ""
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise InputError(f"{path}: not valid JSON ({msg}{where}); re-download {what}") from None
    except RecursionError:
        raise InputError(f"{path}: JSON nested too deeply; re-download {what}") from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def check_config(config: Any, where: str = "config.json") -> dict:
    """The config as a dict, after checking the fields the migrator and the recipe rely on."""
    if not isinstance(config, dict):
        raise InputError(f"{where}: must be a JSON object of settings, got a JSON {_json_kind(config)}; "
                         "point at a Hugging Face model directory")
    _check_fields(config, where)
    text_config = config.get("text_config")
    if isinstance(text_config, dict):
        _check_fields(text_config, f"{where}: text_config")
    archs = config.get("architectures")
    if archs is not None:
        if not isinstance(archs, list) or not archs:
            raise InputError(f"{where}: 'architectures' must be a non-empty list of class names, got "
                             f"{_shown(archs)}")
        for i, arch in enumerate(archs):
            if not is_identifier(arch):
                raise InputError(f"{where}: architectures[{i}] = {_shown(arch)} is not a Python class name")
    model_type = config.get("model_type")
    if model_type is None:
        raise InputError(f"{where}: no 'model_type'; it is not a transformers checkpoint")
    if (not model_type or len(model_type) > 100 or not
                                   all(c.isascii() and (c.isalnum() or c in "_-") for c in model_type)):
        raise InputError(f"{where}: model_type {_shown(model_type)} is not a model type name")
    auto_map = config.get("auto_map")
    if isinstance(auto_map, dict):
        for key, ref in auto_map.items():
            refs = ref if isinstance(ref, list) else [ref]
            if not all(r is None or isinstance(r, str) for r in refs):
                raise InputError(f"{where}: auto_map.{key} must be 'module.ClassName', got {_shown(ref)}")
    return config


def _json_kind(value: Any) -> str:
    return {list: "array", str: "string", type(None): "null", bool: "boolean"}.get(type(value), "number")


def _check_fields(config: dict, where: str) -> None:
    for key in POSITIVE_INTS + OPTIONAL_POSITIVE_INTS:
        value = config.get(key)
        if value is None:
            continue   # absent or null: transformers fills the default, or the feature is off
        # Some families give per-layer sizes as a list.
        values = value if isinstance(value, list) and value else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise InputError(f"{where}: '{key}' must be an integer, got {_shown(value)} ({_type_name(value)}); "
                             "fix config.json")
        low = 1 if key in CORE_SIZES else 0
        bad = next((v for v in values if not low <= v <= MAX_DIM), None)
        if bad is not None:
            raise InputError(f"{where}: '{key}' = {bad} is out of range ({low} .. {MAX_DIM}); fix config.json")
    for key in TOKEN_IDS:
        value = config.get(key)
        ids = value if isinstance(value, list) else [value]
        if any(v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_DIM)
               for v in ids):
            raise InputError(f"{where}: '{key}' must be a token id (integer >= 0) or a list of them, got "
                             f"{_shown(value)}")
    for key in FLOATS:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise InputError(f"{where}: '{key}' must be a non-negative number, got {_shown(value)}")
    for key in BOOLS:
        if key in config and config[key] is not None and not isinstance(config[key], bool):
            raise InputError(f"{where}: '{key}' must be true or false, got {_shown(config[key])}")
    for key in DICTS:
        if key in config and config[key] is not None and not isinstance(config[key], dict):
            raise InputError(f"{where}: '{key}' must be a JSON object, got {_shown(config[key])}")
    for key in STRINGS:
        if key in config and config[key] is not None and not isinstance(config[key], str):
            raise InputError(f"{where}: '{key}' must be a string, got {_shown(config[key])}")


def check_tokenizer(model_dir: Path) -> None:
    present = [name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
    present += [p.name for p in model_dir.glob("*.tiktoken")]
    if not present:
        raise InputError(f"{model_dir}: no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, …); "
                         "copy the model's tokenizer into the directory")
    for name in present:
        path = model_dir / name
        if path.stat().st_size == 0:
            raise InputError(f"{path}: the tokenizer file is empty; re-download it")
        if name in JSON_TOKENIZER_FILES:
            if not isinstance(read_json_file(path), dict):
                raise InputError(f"{path}: must be a JSON object; re-download it")


def weight_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.iterdir() if p.name.endswith(WEIGHT_SUFFIXES) and not p.is_dir())


def check_safetensors(path: Path) -> dict[str, list[int]]:
    """The header parses and the tensors it lists fit the file exactly (a truncated download does not).
    Returns tensor name -> shape."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InputError(f"{path}: truncated weights file ({size} bytes); re-download it")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise InputError(f"{path}: not a safetensors file, or truncated (header of {header_len} bytes in a "
                             f"{size}-byte file); re-download it")
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise InputError(f"{path}: corrupt safetensors header; re-download it") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupt safetensors header; re-download it")
    data_len, end = size - 8 - header_len, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, stop) = info["dtype"], info["shape"], info["data_offsets"]
            ok = dtype in SAFETENSORS_DTYPES and all(isinstance(d, int) and d >= 0 for d in shape) \
                and isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise InputError(f"{path}: corrupt entry for tensor {_shown(name)} in the safetensors header; "
                             "re-download it")
        end = max(end, stop)
    if end != data_len:
        state = "truncated" if end > data_len else "longer than its header says"
        raise InputError(f"{path}: {state} (tensors need {end} bytes of data, the file holds {data_len}); "
                         "re-download it")
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


LAYER_INDEX_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layers_the_code_builds(config: dict) -> int | None:
    """How many decoder layers transformers' own class for this config builds (on the meta device:
    no memory, no weights), or None when it cannot say (remote code, a config it rejects)."""
    if config.get("auto_map"):
        return None     # remote code runs only with --trust-remote-code, never in a check
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        fields = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields))
    except Exception:  # noqa: BLE001 - unknown type or invalid config: the name-based check stands
        return None
    indices = {int(m.group(1)) for name in model.state_dict() for m in [LAYER_INDEX_RE.search(name)] if m}
    return max(indices) + 1 if indices else None


def check_weights_match_config(model_dir: Path, config: dict, shapes: dict[str, list[int]]) -> None:
    """The weights (`shapes`: tensor name -> shape, from the safetensors headers) are the config's
    model: no fewer embedding rows than vocab_size, and no fewer decoder layers than
    num_hidden_layers (a config of another size gives shape errors deep in loading). More rows than
    vocab_size are not refused here: some models build them (moshi: vocab_size + 1)."""
    if isinstance(config.get("text_config"), dict) or not shapes:
        return   # multimodal wrappers name their weights by their own scheme
    vocab = config.get("vocab_size")
    for name, shape in shapes.items():
        if name.endswith(("model.embed_tokens.weight", "transformer.wte.weight")) and isinstance(vocab, int) \
                and len(shape) == 2 and shape[0] < vocab:
            raise InputError(f"{model_dir}: the weights do not match config.json: {name} has {shape[0]} rows, "
                             f"config.json says vocab_size {vocab}; use the config.json that came with "
                             "these weights")
    layers = config.get("num_hidden_layers")
    found = {int(m.group(1)) for name in shapes for m in [LAYER_INDEX_RE.search(name)] if m}
    if isinstance(layers, int) and found and max(found) + 1 < layers:
        # num_hidden_layers is a name, not the model: some build another count from it (dory's
        # layer_types and loop counts). Where transformers' own code can be asked, it decides.
        built = layers_the_code_builds(config)
        if built is not None and max(found) + 1 >= built:
            return
        raise InputError(f"{model_dir}: the weights do not match config.json: they hold {max(found) + 1} decoder "
                         f"layers, config.json says num_hidden_layers {layers}; use the config.json that came "
                         "with these weights")


def check_weights(model_dir: Path) -> dict[str, list[int]]:
    """Weight files present, whole and indexed consistently; returns the safetensors tensor shapes."""
    from agent.migrate.acquire import WEIGHT_INDEXES

    files = weight_files(model_dir)
    for index_name, _ in WEIGHT_INDEXES:
        index = model_dir / index_name
        if index.is_file():
            data = read_json_file(index)
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise InputError(f"{index}: no valid 'weight_map'; re-download it")
            for shard in sorted(set(weight_map.values())):
                shard_path = (model_dir / shard)
                if Path(shard).is_absolute() or ".." in Path(shard).parts:
                    raise InputError(f"{index}: shard {_shown(shard)} is outside the model directory")
                if not shard_path.is_file():
                    raise InputError(f"{index}: shard {shard} is missing from {model_dir}; download it")
    if not files:
        raise InputError(f"{model_dir}: no weight files (*.safetensors / *.bin); download them into the "
                         "directory or pass --weights PATH")
    shapes: dict[str, list[int]] = {}
    for path in files:
        if path.stat().st_size == 0:
            raise InputError(f"{path}: the weights file is empty; re-download it")
        if path.suffix == ".safetensors":
            shapes.update(check_safetensors(path))
    return shapes


def check_output_outside(model_dir: Path, output_dir: Path, shown: str) -> None:
    """Nothing is written into a checkpoint: an output directory inside it is refused (exit 2)."""
    model_dir, output_dir = Path(model_dir).expanduser().resolve(), Path(output_dir).expanduser().resolve()
    if output_dir == model_dir or model_dir in output_dir.parents:
        raise InputError(f"--output-dir {shown} is inside the checkpoint {model_dir}; nothing is written into "
                         "a checkpoint: choose an output directory outside it")


def check_checkpoint(model_dir: Path, trust_remote_code: bool = False) -> dict:
    """Everything above, in the order a user would fix it; returns the config. An architecture
    that cannot be served is refused (exit 3) before its tokenizer and weights are looked at."""
    from agent.migrate.vendor import locate_source

    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise InputError(f"{model_dir}: no config.json — point at a Hugging Face model directory "
                         "(the folder that holds config.json and the weights)")
    config = check_config(read_json_file(config_file), str(config_file))
    locate_source(config, model_dir, trust_remote_code=trust_remote_code)   # reads code, runs none
    check_tokenizer(model_dir)
    check_weights_match_config(model_dir, config, check_weights(model_dir))
    return config
