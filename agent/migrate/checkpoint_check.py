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
import os
import re
import struct
import sys
from pathlib import Path
from typing import Any

from agent.errors import InputError
from agent.migrate.quantization import check_quantized, read_tensors
from agent.recipe.fs_guard import JSON_LIMIT, check_regular, read_bytes
from agent.recipe.render import is_identifier
from engine.safe_load import LoadError, loads_json

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
JSON_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                        "added_tokens.json")
# files a tokenizer can be built from when there is no tokenizer.json (a slow tokenizer's vocabulary)
VOCAB_FILES = ("tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "sentencepiece.bpe.model", "merges.txt",
               "qwen.tiktoken", "tokenizer.tiktoken")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SAFETENSORS_DTYPES = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3",
                      "F8_E5M2", "U16", "U32", "U64", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64"}
MAX_HEADER_BYTES = 100 * 2**20   # safetensors' own limit


def read_json_file(path: Path, what: str | None = None) -> Any:
    """A JSON file of the checkpoint, with one-line errors for every way it can be broken."""
    what = what or path.name
    try:
        raw = read_bytes(path, JSON_LIMIT)       # a FIFO, a device, a loop: refused by type, never read
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
        return loads_json(text, str(path), allow_nan=False, max_bytes=JSON_LIMIT, hint=f"re-download {what}")
    except LoadError as exc:
        if exc.kind == "syntax":
            where = f" at line {exc.line}" if exc.line else ""
            raise InputError(f"{path}: not valid JSON ({exc.problem}{where}); re-download {what}") from None
        raise InputError(f"{path}: JSON {exc.problem}{f' at line {exc.line}' if exc.line else ''}; "
                         f"re-download {what}") from None


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


def tokenizer_code(model_dir: Path) -> str | None:
    """The repo's own tokenizer code that tokenizer_config.json's auto_map names (Kimi-K2's
    `tokenization_kimi.TikTokenTokenizer`), or None. An entry that is not 'module.Class' of a file inside
    the repo is refused (exit 2); nothing is imported here."""
    config = model_dir / "tokenizer_config.json"
    if not config.is_file():
        return None
    data = read_json_file(config)
    auto_map = data.get("auto_map") if isinstance(data, dict) else None
    refs = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    refs = [r for r in (refs if isinstance(refs, list) else [refs]) if r is not None]
    for ref in refs:
        module, _, cls = ref.rpartition(".") if isinstance(ref, str) else ("", "", "")
        if "--" in str(ref) or not (is_identifier(module) and is_identifier(cls)):
            raise InputError(f"{config}: auto_map.AutoTokenizer entry {_shown(ref)} is not 'module.ClassName' naming a "
                             ".py file of the model repo; only files inside the repo are used")
        path = model_dir / f"{module}.py"
        if not path.is_file() or model_dir.resolve() not in path.resolve().parents:
            raise InputError(f"{path}: named in tokenizer_config.json's auto_map but missing from the model directory "
                             "(or outside it); re-download the tokenizer files")
    return refs[0] if refs else None


def check_tokenizer(model_dir: Path, trust_remote_code: bool = False) -> None:
    """Every tokenizer file the recipe's tokenizer will read, checked before anything is written: present
    (a tokenizer_config.json alone cannot build one), a regular non-empty file, JSON of the shape
    transformers and tokenizers expect (tokenizer.json's `model` an object, special_tokens_map.json an
    object of tokens); one line naming the file, exit 2. A tokenizer that is the repo's own code (an
    auto_map in tokenizer_config.json) loads only with --trust-remote-code (exit 3 without it), where
    transformers' own classes cannot build it."""
    present = [name for name in TOKENIZER_FILES if os.path.lexists(model_dir / name)]   # a link to /dev/zero too
    present += [p.name for p in model_dir.glob("*.tiktoken")]
    if not present:
        raise InputError(f"{model_dir}: no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, …); "
                         "copy the model's tokenizer into the directory")
    checked = sorted(set(present) | {n for n in JSON_TOKENIZER_FILES if os.path.lexists(model_dir / n)})
    for name in checked:
        path = model_dir / name
        if check_regular(path).st_size == 0:
            raise InputError(f"{path}: the tokenizer file is empty; re-download it")
        if name in JSON_TOKENIZER_FILES:
            data = read_json_file(path)
            if not isinstance(data, dict):
                raise InputError(f"{path}: must be a JSON object, got a JSON {_json_kind(data)}; re-download it")
            if name == "tokenizer_config.json":
                check_tokenizer_config(data, path)
            elif name == "tokenizer.json":
                check_tokenizer_json(data, path)
            elif name == "special_tokens_map.json":
                check_special_tokens_map(data, path)
            elif name in ("added_tokens.json", "vocab.json"):
                check_token_ids(data, path)
    generation = model_dir / "generation_config.json"
    if os.path.lexists(generation):
        data = read_json_file(generation)
        if not isinstance(data, dict):
            raise InputError(f"{generation}: must be a JSON object of settings; re-download it")
        check_generation_config(data, generation)
    code = tokenizer_code(model_dir)
    has_vocab = any(os.path.lexists(model_dir / n) for n in ("tokenizer.json", *VOCAB_FILES)) or \
        any(model_dir.glob("*.tiktoken"))
    if not has_vocab and code is None:      # the repo's own code names its vocabulary files (Kimi-K2: tiktoken.model)
        config = model_dir / "tokenizer_config.json"
        cls = None
        if config.is_file():
            cls = (read_json_file(config) or {}).get("tokenizer_class")
        raise InputError(f"{model_dir / 'tokenizer.json'}: missing, and nothing else here holds the vocabulary "
                         f"({'tokenizer_config.json names ' + repr(cls) + ', which needs it' if cls else 'tokenizer_config.json alone builds no tokenizer'}); "
                         "copy the model's tokenizer.json (or its tokenizer.model / vocab files) into the directory")
    _recipe_loads_tokenizer(model_dir, code=code, trust_remote_code=trust_remote_code)


def _recipe_loads_tokenizer(model_dir: Path, code: str | None = None, trust_remote_code: bool = False) -> None:
    """Last, the files are loaded as the recipe loads them (engine.loading.load_tokenizer: transformers,
    no remote code): what transformers itself requires of them (tokenizer.json's `added_tokens`, the
    interplay of tokenizer_config.json and the vocabulary) is its own to say. A tokenizer library this
    environment lacks (sentencepiece, tiktoken) is the environment's business, not the files'. `code`: the
    repo's own tokenizer class, run only with `trust_remote_code` (the user's consent); without it, a
    tokenizer transformers cannot build by itself is exit 3 naming the code."""
    from engine.loading import load_tokenizer

    try:
        load_tokenizer(str(model_dir), trust_remote_code=bool(code and trust_remote_code))
    except ImportError:
        return
    except Exception as exc:  # noqa: BLE001 - transformers and tokenizers raise anything on a bad file
        why = " ".join(str(exc).split())[:300]
        if re.search(r"requires? the \w+ library|pip install|not installed", why, re.IGNORECASE):
            return
        if code and not trust_remote_code:
            from agent.errors import UnsupportedModelError

            raise UnsupportedModelError(
                f"{model_dir}: the tokenizer is the repo's own code ({code.rpartition('.')[0]}.py: "
                f"{code.rpartition('.')[2]}, tokenizer_config.json's auto_map), which transformers' own classes "
                "cannot replace; review it, then re-run with --trust-remote-code") from None
        raise InputError(f"{model_dir}: transformers cannot build the tokenizer from these files "
                         f"({type(exc).__name__}: {why}); re-download the tokenizer files") from None


TOKENIZER_JSON_SECTIONS = ("normalizer", "pre_tokenizer", "post_processor", "decoder", "truncation", "padding")


def check_tokenizer_json(data: dict, path: Path) -> None:
    """tokenizer.json as the `tokenizers` library reads it: `model` an object with a `type` or a `vocab`."""
    model = data.get("model")
    if not isinstance(model, dict):
        raise InputError(f"{path}: 'model' must be a JSON object (the tokenizer's model: BPE, Unigram, WordPiece…), "
                         f"got {_shown(model)}; re-download tokenizer.json")
    if not isinstance(model.get("type"), str) and "vocab" not in model:
        raise InputError(f"{path}: 'model' has neither a 'type' nor a 'vocab'; re-download tokenizer.json")
    if "vocab" in model and not isinstance(model["vocab"], (dict, list)):
        raise InputError(f"{path}: 'model.vocab' must be a JSON object or array, got {_shown(model['vocab'])}; "
                         "re-download tokenizer.json")
    added = data.get("added_tokens")
    if added is not None and (not isinstance(added, list) or not all(
            isinstance(t, dict) and isinstance(t.get("content"), str) and isinstance(t.get("id"), int)
            for t in added)):
        raise InputError(f"{path}: 'added_tokens' must be a list of {{id, content, ...}} objects; re-download "
                         "tokenizer.json")
    for key in TOKENIZER_JSON_SECTIONS:
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise InputError(f"{path}: '{key}' must be a JSON object or null, got {_shown(data[key])}; re-download "
                             "tokenizer.json")
    _tokenizers_reads(data, path)


def _tokenizers_reads(data: dict, path: Path) -> None:
    """The rest of tokenizer.json's schema is the `tokenizers` library's: it builds the tokenizer from the
    parsed file here, as the recipe will (a `version` of null, a merge of three words, an unknown pre-tokenizer)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:           # transformers' tokenizers backend missing: the environment check's business
        return
    try:
        Tokenizer.from_str(json.dumps(data))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for every schema error
        why = re.sub(r" at line \d+ column \d+$", "", " ".join(str(exc).split()))[:300]
        raise InputError(f"{path}: the tokenizers library cannot build a tokenizer from it ({why}); re-download "
                         "tokenizer.json") from None


def check_special_tokens_map(data: dict, path: Path) -> None:
    """special_tokens_map.json: each token text or an AddedToken object; additional_special_tokens a list of them."""
    for key, value in data.items():
        values = value if isinstance(value, list) and key == "additional_special_tokens" else [value]
        if not all(_token(v) and v is not None for v in values):
            raise InputError(f"{path}: '{key}' must be a token (text or {{\"content\": ...}}), got {_shown(value)}; "
                             "fix special_tokens_map.json or re-download it")


def check_token_ids(data: dict, path: Path) -> None:
    """added_tokens.json / vocab.json: token text -> a non-negative integer id (tokenizers sorts and indexes by it)."""
    for token, index in data.items():
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise InputError(f"{path}: the id of {token[:60]!r} must be a non-negative integer, got {_shown(index)}; "
                             f"fix {path.name} or re-download it")


def _token(value) -> bool:
    """A special token as tokenizer_config.json writes it: text, or an AddedToken object."""
    return value is None or isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("content"), str))


# tokenizer_config.json fields transformers reads when the recipe loads its tokenizer
TOKENIZER_FIELDS = {
    **{k: (_token, "a token (text)") for k in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                                                "cls_token", "mask_token")},
    "model_max_length": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
                         "a positive number"),
    "padding_side": (lambda v: v in ("left", "right"), '"left" or "right"'),
    "truncation_side": (lambda v: v in ("left", "right"), '"left" or "right"'),
    "chat_template": (lambda v: v is None or isinstance(v, str) or (isinstance(v, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in v)),
                      "a Jinja template (text) or a list of {name, template}"),
    "tokenizer_class": (lambda v: v is None or (isinstance(v, str) and is_identifier(v)), "a class name"),
    **{k: (lambda v: v is None or isinstance(v, bool), "true or false")
       for k in ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces", "legacy", "use_fast",
                 "do_lower_case", "add_prefix_space", "split_special_tokens")},
    "added_tokens_decoder": (lambda v: isinstance(v, dict) and all(isinstance(t, dict) for t in v.values()),
                             "a JSON object of token id -> token"),
    "additional_special_tokens": (lambda v: v is None or (isinstance(v, list) and all(_token(t) for t in v)),
                                  "a list of tokens"),
}


def check_tokenizer_config(data: dict, path: Path) -> None:
    for key, (ok, kind) in TOKENIZER_FIELDS.items():
        if key in data and not ok(data[key]):
            raise InputError(f"{path}: '{key}' must be {kind}, got {_shown(data[key])}; fix tokenizer_config.json "
                             "or re-download it")


_COUNT = (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_DIM), "an integer >= 0")
_NUMBER = (lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                   and v >= 0), "a number >= 0")
GENERATION_FIELDS = {
    **{k: _COUNT for k in ("max_new_tokens", "max_length", "min_length", "min_new_tokens", "top_k", "num_beams",
                           "num_return_sequences", "no_repeat_ngram_size")},
    **{k: _NUMBER for k in ("temperature", "top_p", "repetition_penalty", "length_penalty", "typical_p", "min_p")},
    **{k: (lambda v: v is None or isinstance(v, bool), "true or false") for k in ("do_sample", "use_cache",
                                                                                 "early_stopping")},
}


def check_generation_config(data: dict, path: Path) -> None:
    """generation_config.json: the engine stops on its eos_token_id; transformers reads the rest."""
    for key in TOKEN_IDS:
        value = data.get(key)
        ids = value if isinstance(value, list) else [value]
        if any(v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_DIM)
               for v in ids):
            raise InputError(f"{path}: '{key}' must be a token id (integer >= 0) or a list of them, got "
                             f"{_shown(value)}; fix generation_config.json")
    for key, (ok, kind) in GENERATION_FIELDS.items():
        if key in data and not ok(data[key]):
            raise InputError(f"{path}: '{key}' must be {kind}, got {_shown(data[key])}; fix generation_config.json")


def weight_files(model_dir: Path) -> list[Path]:
    """The weight files; one that is not a regular file (a symlink loop, a FIFO, a device) is
    refused by type (a folder named like one is a folder)."""
    found = []
    for p in sorted(model_dir.iterdir()):
        if p.name.endswith(WEIGHT_SUFFIXES) and not p.is_dir():
            check_regular(p)
            found.append(p)
    return found


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
        header = loads_json(raw.decode("utf-8"), f"{path}: safetensors header", max_bytes=MAX_HEADER_BYTES)
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
EXPERT_INDEX_RE = re.compile(r"\.experts\.(\d+)\.")
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
# Errors transformers raises for a config it cannot build (not those of building on the meta device).
CONFIG_ERRORS = (ValueError, KeyError, TypeError, AttributeError, AssertionError, ZeroDivisionError, IndexError)


def _config_fields(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}


def check_config_class(config: dict, where: str) -> None:
    """transformers' own configuration class accepts the fields (types and consistency: transformers
    5 validates them, e.g. hidden_act must be a string, hidden_size a multiple of the heads). Cheap:
    no model is built. Remote configuration code is never run here."""
    if config.get("auto_map"):
        return
    try:
        from transformers import AutoConfig

        AutoConfig.for_model(config["model_type"], **_config_fields(config))
    except Exception as exc:  # noqa: BLE001 - transformers' validation errors have several classes
        if not isinstance(exc, CONFIG_ERRORS) and "Validation" not in type(exc).__name__:
            return
        detail = " ".join(line.strip() for line in str(exc).splitlines()[1:] or str(exc).splitlines())[:300]
        raise InputError(f"{where}: transformers rejects this configuration ({detail or type(exc).__name__}); "
                         "fix config.json") from None


def _build_on_meta(config: dict):
    """transformers' own class for the config on the meta device: no memory, no weights. The class is the one
    transformers runs the checkpoint with (agent.recipe.text_decoder.auto_class_for: an image-text checkpoint's
    image-text class)."""
    import torch
    from transformers import AutoConfig

    from agent.recipe.text_decoder import auto_class_for

    with torch.device("meta"):
        return auto_class_for(config).from_config(AutoConfig.for_model(config["model_type"], **_config_fields(config)))


def layers_the_code_builds(config: dict) -> int | None:
    """How many decoder layers transformers' own class for this config builds (on the meta device:
    no memory, no weights), or None when it cannot say (remote code, a config it rejects)."""
    if config.get("auto_map"):
        return None     # remote code runs only with --trust-remote-code, never in a check
    try:
        model = _build_on_meta(config)
    except Exception:  # noqa: BLE001 - unknown type or invalid config: the name-based check stands
        return None
    indices = {int(m.group(1)) for name in model.state_dict() for m in [LAYER_INDEX_RE.search(name)] if m}
    return max(indices) + 1 if indices else None


def _mismatch(model_dir: Path, what: str) -> InputError:
    return InputError(f"{model_dir}: the weights do not match config.json: {what}; use the config.json that came "
                      "with these weights")


def _fields_equal_to(config: dict, value: int) -> list[str]:
    return [k for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool) and v == value][:2]


def check_weights_match_config(model_dir: Path, config: dict, shapes: dict[str, list[int]], *,
                               says: str = "config.json", stored: dict | None = None) -> str | None:
    """The weights (`shapes`: tensor name -> shape, from the safetensors headers) are the config's
    model. Costs what the files cost, never what the config claims: counts (vocabulary rows, decoder
    layers, experts) are compared with the weights first, and only then is transformers' own class
    built — on the meta device, with the layer count the weights hold — to compare every tensor's
    shape (hidden_size, intermediate_size, heads, ...). More rows than vocab_size are not refused:
    some models build them (moshi: vocab_size + 1). An image-text checkpoint: its text decoder and the
    rest checked apart (check_image_text_weights). Returns None when checked, else what could not be
    checked and why (the caller says so: a check that cannot run never passes silently). `says`: where
    the config's fields are (an image-text checkpoint's text_config); `stored`: a tensor's name as the
    checkpoint stores it, for the message."""
    if not shapes:
        return "no safetensors header to read the shapes from (*.bin weights): transformers compares them at load"
    if is_image_text_config(config) or isinstance(config.get("text_config"), dict):
        return check_image_text_weights(model_dir, config, shapes)
    stored = stored or {}

    def named(name: str) -> str:
        return stored.get(name, name)

    vocab = config.get("vocab_size")
    for name, shape in shapes.items():
        if name.endswith(("model.embed_tokens.weight", "transformer.wte.weight")) and isinstance(vocab, int) \
                and len(shape) == 2 and shape[0] < vocab:
            raise _mismatch(model_dir, f"{named(name)} has {shape[0]} rows, {says} says vocab_size {vocab}")
    layers = config.get("num_hidden_layers")
    found = {int(m.group(1)) for name in shapes for m in [LAYER_INDEX_RE.search(name)] if m}
    held = max(found) + 1 if found else None
    if isinstance(layers, int) and held is not None and held < layers:
        # num_hidden_layers is a name, not the model: some build another count from it (dory's
        # layer_types and loop counts). transformers' own code decides — asked with one layer more
        # than the weights hold, never with the config's number (1000000 layers would take minutes).
        built = layers_the_code_builds(dict(config, num_hidden_layers=held + 1))
        if built is None and layers <= 4 * held + 64:
            # the shortened config does not validate (layer_types lists every layer): the config's
            # own number, when it is within a small multiple of what the files hold
            built = layers_the_code_builds(config)
        if built is None or built > held:
            raise _mismatch(model_dir, f"they hold {held} decoder layers, {says} says num_hidden_layers {layers}")
    experts = {int(m.group(1)) for name in shapes for m in [EXPERT_INDEX_RE.search(name)] if m}
    claimed = next((config[k] for k in EXPERT_COUNTS if isinstance(config.get(k), int)), None)
    if experts and claimed is not None and max(experts) + 1 < claimed:
        field = next(k for k in EXPERT_COUNTS if isinstance(config.get(k), int))
        raise _mismatch(model_dir, f"they hold {max(experts) + 1} experts per layer, {says} says {field} {claimed}")
    if config.get("auto_map"):
        return "the repository's own code (auto_map) is never built in a check: the shapes are compared at load"
    if held is not None and isinstance(layers, int) and layers > held:
        return (f"transformers' class builds {held} of num_hidden_layers {layers} layers from it: the shapes are "
                "compared at load")
    if not isinstance(config.get("model_type"), str):
        return "no model_type to build transformers' class with"
    try:
        model = _build_on_meta(config)
    except Exception as exc:  # noqa: BLE001
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
        if isinstance(exc, CONFIG_ERRORS) and "meta" not in str(exc).lower():
            raise InputError(f"{model_dir}/config.json: transformers' own model class cannot be built from it "
                             f"({type(exc).__name__}: {line}); fix config.json") from None
        return f"transformers' class cannot be built on the meta device ({type(exc).__name__}: {line})"
    compare_shapes(model_dir, model.state_dict(), shapes, config, says, named)
    return None


def compare_shapes(model_dir: Path, built: dict, shapes: dict[str, list[int]], config: dict, says: str,
                   named=lambda name: name) -> None:
    """Every tensor of transformers' model (`built`: name -> tensor, on the meta device) that the files hold
    has its shape there (or the same numbers in another layout: converted at load); else the one line names the
    tensor and the config's fields of the width that differs."""
    for name, tensor in built.items():
        want, have = list(tensor.shape), shapes.get(name)
        if have is None or have == want or math.prod(have) == math.prod(want):
            continue        # not in the files, or the same numbers in another layout (converted at load)
        differs = [w for w, h in zip(want, have) if w != h] if len(want) == len(have) else []
        fields = _fields_equal_to(config, differs[0]) if differs else []
        because = f" ({', '.join(f'{k} {config[k]}' for k in fields)})" if fields else ""
        raise _mismatch(model_dir, f"{named(name)} is {have} in the weights, {says} makes it {want}{because}")


def is_image_text_config(config: dict) -> bool:
    from agent.recipe.text_decoder import is_image_text

    return is_image_text(config)


def check_image_text_weights(model_dir: Path, config: dict, shapes: dict[str, list[int]]) -> str | None:
    """An image-text checkpoint (agent.recipe.text_decoder): its text decoder's tensors — its stored names read as
    transformers' image-text class reads them (its conversion mapping), those under the decoder and the head — are
    checked as the causal LM of the decoder's config (counts, then every shape, check_weights_match_config); the
    rest (the vision tower, the projector) against the image-text class itself, built on the meta device with the
    checkpoint's config. Returns what could not be checked, as check_weights_match_config."""
    from agent.recipe.text_decoder import NotServedByText, apply_renames, text_decoder

    try:
        decoder = text_decoder(config) if is_image_text_config(config) else None
    except NotServedByText as exc:
        return f"an image-text model whose text decoder is not served ({exc})"
    if decoder is None:
        return "a composite config (text_config) that is not an image-text model's: its weights follow its own scheme"
    if is_image_text_config(decoder.config):
        return f"its text decoder's config ({decoder.causal_lm_type}) is itself an image-text model's"
    served = (decoder.decoder_prefix + ".", decoder.head + ".")
    text_shapes, stored, rest = {}, {}, {}
    for name, shape in shapes.items():
        as_built = apply_renames(decoder.stored_renames, name)
        if as_built.startswith(served):
            text_name = apply_renames(decoder.renames, name)
            text_shapes[text_name], stored[text_name] = shape, name
        else:
            rest[as_built], stored[as_built] = shape, name
    if not text_shapes:
        raise _mismatch(model_dir, f"none of them is the text decoder's ({decoder.image_text_class} reads it under "
                                   f"{decoder.decoder_prefix}.* and {decoder.head}.*)")
    key = next((k for k in ("text_config", "llm_config", "language_config") if isinstance(config.get(k), dict)),
               "text_config")
    unchecked = check_weights_match_config(model_dir, decoder.config, text_shapes, says=f"config.json's {key}",
                                           stored=stored)
    if unchecked:
        return f"its text decoder: {unchecked}"
    try:
        model = _build_on_meta(config)
    except Exception as exc:  # noqa: BLE001 - the decoder is checked; the vision tower's class refuses its config here
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
        return (f"its vision tower and projector: transformers cannot build {decoder.image_text_class} on the meta "
                f"device ({type(exc).__name__}: {line})")
    others = {name: tensor for name, tensor in model.state_dict().items() if not name.startswith(served)}
    vision = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else {}
    compare_shapes(model_dir, others, rest, {**config, **vision}, "config.json's vision_config" if vision else
                   "config.json", lambda name: stored.get(name, name))
    return None


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
    if os.path.lexists(config_file):
        check_regular(config_file)         # a loop, a FIFO, a device: refused by type
    if not config_file.is_file():
        raise InputError(f"{model_dir}: no config.json — point at a Hugging Face model directory "
                         "(the folder that holds config.json and the weights)")
    config = check_config(read_json_file(config_file), str(config_file))
    source = locate_source(config, model_dir, trust_remote_code=trust_remote_code)   # reads code, runs none
    # served by transformers' own class (an auto_map it implements): checked as that class, like any other
    built = {k: v for k, v in config.items() if k != "auto_map"} if source.note else config
    check_config_class(built, str(config_file))
    check_tokenizer(model_dir, trust_remote_code)
    shapes = check_weights(model_dir)
    quantization = check_quantized(model_dir, config, (config.get("architectures") or [config["model_type"]])[0])
    if quantization is not None and quantization[1] is not None:
        # the model transformers builds holds the tensors as converted (a weight, not its packed parts)
        shapes = quantization[1].output_shapes(read_tensors(model_dir))
    unchecked = check_weights_match_config(model_dir, built, shapes)
    if unchecked:
        print(f"[migrator] {model_dir.name}: the weights are not checked against config.json: {unchecked}",
              file=sys.stderr)
    return config
