"""Recipe YAML: loading and validation that names the bad key or value."""

from __future__ import annotations

import os
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A recipe YAML that cannot be used; the message names the key and what to do."""


# key -> (type, required). Nested sections are dicts of the same shape.
SCHEMA = {
    "model_name": (str, True),
    "model_path": (str, True),
    "exe_mode": (str, True),
    "world_size": (int, True),
    "device": (str, False),
    "model_source": (str, False),
    "model_config": ({
        "dtype": (str, True),
        "enable_online_split_weight": (bool, False),
        "attn_implementation": (str, False),
        "key_mapping": (dict, False),
        "config_overrides": (dict, False),
    }, True),
    "data_config": ({
        "dataset": (str, True),
        "input_max_len": (int, True),
        "max_new_tokens": (int, True),
        "batch_size": (int, True),
    }, True),
    "parallel_config": ({
        "attn_tp_size": (int, True),
        "moe_tp_size": (int, True),
        "lmhead_tp_size": (int, True),
    }, True),
}

CHOICES = {
    "exe_mode": ("eager", "graph"),
    "device": ("auto", "npu", "cuda", "cpu"),
    "model_config.dtype": ("float32", "float16", "bfloat16"),
    "model_config.attn_implementation": ("eager", "sdpa"),
}


def _check(section: dict, schema: dict, prefix: str, path: str) -> None:
    for key, (kind, required) in schema.items():
        name = f"{prefix}{key}"
        if key not in section:
            if required:
                raise ConfigError(f"{path}: missing required key '{name}'")
            continue
        value = section[key]
        if isinstance(kind, dict):
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: '{name}' must be a mapping, got {type(value).__name__}")
            _check(value, kind, f"{name}.", path)
            continue
        # bool is an int subclass: `batch_size: true` must not pass as 1.
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ConfigError(
                f"{path}: '{name}' must be {kind.__name__}, got {value!r} ({type(value).__name__})")
        if name in CHOICES and value not in CHOICES[name]:
            raise ConfigError(f"{path}: '{name}' is {value!r}; expected one of {', '.join(CHOICES[name])}")
        if kind is int and value < 1:
            raise ConfigError(f"{path}: '{name}' must be >= 1, got {value}")


def validate(settings: dict, path: str = "<yaml>") -> dict:
    if not isinstance(settings, dict):
        raise ConfigError(f"{path}: top level must be a mapping of settings")
    _check(settings, SCHEMA, "", path)
    _check_parallel(settings, path)
    return settings


def _check_parallel(settings: dict, path: str) -> None:
    """world_size = (world_size / attn_tp_size) data-parallel groups x attn_tp_size tensor-parallel
    ranks; moe_tp_size and lmhead_tp_size shard on that group (= attn_tp_size) or not at all (1)."""
    world_size, parallel = settings["world_size"], settings["parallel_config"]
    tp = parallel["attn_tp_size"]
    if world_size % tp:
        raise ConfigError(f"{path}: 'parallel_config.attn_tp_size' ({tp}) must divide 'world_size' ({world_size})")
    for key in ("moe_tp_size", "lmhead_tp_size"):
        if parallel[key] not in (1, tp):
            raise ConfigError(f"{path}: 'parallel_config.{key}' is {parallel[key]}; expected 1 or "
                              f"attn_tp_size ({tp})")
    batch_size, dp = settings["data_config"]["batch_size"], world_size // tp
    if batch_size % dp:
        raise ConfigError(f"{path}: 'data_config.batch_size' ({batch_size}) must be a multiple of "
                          f"world_size / attn_tp_size ({dp} data-parallel groups)")


def load_runner_settings(yaml_path: str | os.PathLike) -> dict:
    """Load and validate a recipe YAML. A relative model_path is taken from the YAML's recipe dir."""
    path = Path(yaml_path)
    if not path.is_file():
        raise ConfigError(f"{path}: YAML file not found")
    try:
        settings = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or exc.__class__.__name__
        raise ConfigError(f"{path}: not valid YAML{where} ({problem}); fix it or re-render the recipe") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read ({exc})") from exc
    validate(settings, str(path))
    model_path = Path(os.path.expanduser(settings["model_path"]))
    if not model_path.is_absolute():
        model_path = (path.resolve().parent.parent / model_path).resolve()
    settings["model_path"] = str(model_path)
    settings["yaml_path"] = str(path.resolve())
    return settings
