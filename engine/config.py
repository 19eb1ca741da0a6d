"""Recipe YAML: the one schema of its keys, and loading and validation that names the bad key or value.

KEYS is the schema every other part reads: the renderer writes the keys in this order
(`rendered_settings`), validation checks types, choices and ranges, the repair rules take defaults
and key order from it, and docs/recipes.md's key table is generated from it (`keys_markdown`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from engine import defaults
from engine.parallel import no_plan_error, tp_plan
from engine.safe_load import LoadError, load_yaml


class ConfigError(ValueError):
    """A recipe YAML that cannot be used; the message names the key and what to do."""


@dataclass(frozen=True)
class Key:
    name: str                   # dotted: "data_config.max_new_tokens"; a section is kind dict with children
    kind: type
    required: bool
    default: object = None      # what the migrator writes when nothing is known; None: from the checkpoint
    choices: tuple = ()
    doc: str = ""
    rendered: bool = True       # the migrator writes it (False: a key the user adds by hand)

    @property
    def section(self) -> str | None:
        return self.name.rpartition(".")[0] or None

    @property
    def leaf(self) -> str:
        return self.name.rpartition(".")[2]

    @property
    def is_section(self) -> bool:
        return self.kind is dict and self.section is None


# In the order the renderer writes them; a section comes before its keys.
KEYS: tuple[Key, ...] = (
    Key("model_name", str, True, doc="recipe name: log prefix, runner_{model_name}.py"),
    Key("model_path", str, True, doc="checkpoint folder; a relative path is taken from the recipe folder"),
    Key("model_source", str, False, doc="where the checkpoint came from (link or path); the baseline keeps a link, never a local path"),
    Key("exe_mode", str, True, "eager", ("eager", "graph"), "graph compiles the decode step"),
    Key("device", str, False, "auto", ("auto", "npu", "cuda", "cpu"), "auto: npu, else cuda, else cpu"),
    Key("world_size", int, True, defaults.WORLD_SIZE, doc="ranks torchrun starts (cards)"),
    Key("model_config", dict, True),
    Key("model_config.dtype", str, True, choices=("float32", "float16", "bfloat16"),
        doc="weights and compute dtype (the checkpoint's unless --dtype)"),
    Key("model_config.attn_implementation", str, False, "sdpa", ("eager", "sdpa"),
        doc="transformers attention: sdpa where the model class supports it, else eager"),
    Key("model_config.key_mapping", dict, False, rendered=False,
        doc="regex -> replacement for checkpoint keys named differently from the code"),
    Key("model_config.config_overrides", dict, False, rendered=False, doc="config.json values the recipe corrects"),
    Key("data_config", dict, True),
    Key("data_config.dataset", str, True, "default", doc="prompt set (engine/data.py)"),
    Key("data_config.input_max_len", int, True, defaults.INPUT_MAX_LEN,
        doc="prompt budget in tokens (less when the model has fewer positions)"),
    Key("data_config.max_new_tokens", int, True, defaults.MAX_NEW_TOKENS, doc="tokens generated per request"),
    Key("data_config.batch_size", int, True, 1, doc="prompts per forward; a multiple of the data-parallel groups"),
    Key("parallel_config", dict, True),
    Key("parallel_config.attn_tp_size", int, True, 1,
        doc="tensor-parallel group size (divides world_size; the rest is data parallel)"),
    Key("parallel_config.moe_tp_size", int, True, 1, doc="experts sharded over the group (attn_tp_size) or not (1)"),
    Key("parallel_config.lmhead_tp_size", int, True, 1, doc="lm_head sharded over the group (attn_tp_size) or not (1)"),
)
KEY = {key.name: key for key in KEYS}

# Keys earlier releases wrote that nothing reads: an old recipe still validates, the key is ignored.
OBSOLETE = {
    "model_config.enable_online_split_weight": "read by nothing (tensor parallel uses parallel_config)",
}

# Derived views, for readers that want one aspect.
SECTIONS = tuple(key.name for key in KEYS if key.is_section)
CHOICES = {key.name: key.choices for key in KEYS if key.choices}


def rendered_keys(section: str | None) -> list[str]:
    """Leaf names the migrator writes in one section (None: the top level, sections included), in order."""
    return [key.leaf for key in KEYS if key.section == section and key.rendered]


def rendered_settings(values: dict) -> dict:
    """The YAML as data for a recipe: each key from `values` (by its leaf name: `dtype`,
    `max_new_tokens`, ...), else its default; a key with neither is left out."""
    settings: dict = {}
    for key in (k for k in KEYS if k.rendered):
        parent = settings if key.section is None else settings.get(key.section)
        if parent is None:
            continue
        if key.is_section:
            parent[key.leaf] = {}
            continue
        value = values.get(key.leaf)
        value = key.default if value is None else value
        if value is not None:
            parent[key.leaf] = key.kind(value) if key.kind in (str, int) else value
    return settings


def keys_markdown() -> str:
    """docs/recipes.md's table of the YAML keys (tests/lint/test_one_home.py checks the page against it)."""
    rows = ["| key | type | required | default | values | meaning |", "|---|---|---|---|---|---|"]
    for key in KEYS:
        if key.is_section:
            continue
        default = "set at migration" if key.required and key.default is None else (
            "—" if key.default is None else f"`{key.default}`")
        rows.append(f"| `{key.name}` | {key.kind.__name__} | {'yes' if key.required else 'no'} | {default} | "
                    f"{', '.join(key.choices) or '—'} | {key.doc} |")
    return "\n".join(rows)


def _check(settings: dict, path: str) -> None:
    for key in KEYS:
        parent = settings if key.section is None else settings.get(key.section, {})   # a section is checked first
        if key.leaf not in parent:
            if key.required:
                raise ConfigError(f"{path}: missing required key '{key.name}'")
            continue
        value = parent[key.leaf]
        if key.is_section:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: '{key.name}' must be a mapping, got {type(value).__name__}")
            continue
        # bool is an int subclass: `batch_size: true` must not pass as 1.
        if not isinstance(value, key.kind) or (key.kind is int and isinstance(value, bool)):
            raise ConfigError(
                f"{path}: '{key.name}' must be {key.kind.__name__}, got {value!r} ({type(value).__name__})")
        if key.choices and value not in key.choices:
            raise ConfigError(f"{path}: '{key.name}' is {value!r}; expected one of {', '.join(key.choices)}")
        if key.kind is int and value < 1:
            raise ConfigError(f"{path}: '{key.name}' must be >= 1, got {value}")


def validate(settings: dict, path: str = "<yaml>") -> dict:
    """Check every schema key; keys outside the schema (OBSOLETE ones, or the user's) are ignored."""
    if not isinstance(settings, dict):
        raise ConfigError(f"{path}: top level must be a mapping of settings")
    _check(settings, path)
    try:
        check_parallel(settings)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return settings


def check_parallel(settings: dict, config_class=None) -> None:
    """The parallel rules, in one place (YAML validation, the recipe's check_vars and the runner use
    them): world_size = (world_size / attn_tp_size) data-parallel groups x attn_tp_size tensor-parallel
    ranks; moe_tp_size and lmhead_tp_size shard on that group (= attn_tp_size) or not at all (1); the
    batch splits evenly over the groups; more than one tensor-parallel rank needs the model's plan
    (`config_class`: its configuration class, when known)."""
    world_size, parallel = settings["world_size"], settings["parallel_config"]
    tp = parallel["attn_tp_size"]
    if world_size % tp:
        raise ConfigError(f"'parallel_config.attn_tp_size' ({tp}) must divide 'world_size' ({world_size})")
    for key in ("moe_tp_size", "lmhead_tp_size"):
        if parallel.get(key, 1) not in (1, tp):
            raise ConfigError(f"'parallel_config.{key}' is {parallel[key]}; expected 1 or attn_tp_size ({tp})")
    batch_size, dp = (settings.get("data_config") or {}).get("batch_size"), world_size // tp
    if batch_size is not None and batch_size % dp:
        raise ConfigError(f"'data_config.batch_size' ({batch_size}) must be a multiple of "
                          f"world_size / attn_tp_size ({dp} data-parallel groups)")
    if tp > 1 and config_class is not None:
        if tp_plan(config_class) is None:
            raise ConfigError(str(no_plan_error(config_class, f"parallel_config.attn_tp_size={tp}")))


def setting(settings: dict, dotted: str):
    """A recipe setting by its dotted schema name: the YAML's value, else the schema's default."""
    key = KEY[dotted]
    parent = settings if key.section is None else settings.get(key.section) or {}
    value = parent.get(key.leaf)
    if value is None and key.default is None and key.required:
        raise ConfigError(f"missing required key '{dotted}'")
    return key.default if value is None else value


def load_runner_settings(yaml_path: str | os.PathLike) -> dict:
    """Load and validate a recipe YAML. A relative model_path is taken from the YAML's recipe dir."""
    path = Path(yaml_path)
    if not path.is_file():
        raise ConfigError(f"{path}: YAML file not found")
    try:
        settings = load_yaml(path, hint="fix it or re-render the recipe")
    except LoadError as exc:
        if exc.syntax is None:       # too large, an alias bomb, too deep, duplicate keys, not UTF-8, not a file
            raise ConfigError(str(exc)) from exc
        mark, problem = exc.syntax.problem_mark, exc.syntax.problem or exc.syntax.__class__.__name__
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where} ({problem}); fix it or re-render the recipe") from exc
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
