"""Rules about the recipe YAML: paths, keys, types, dtypes, lengths, devices."""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from agent.failure import Failure
from agent.repair_rules._util import edit_yaml_line, load_yaml, recipe_yaml, report_data
from agent.repair_rules.rule import RepairContext, Rule
from engine.config import SECTIONS, rendered_keys

_DTYPE_UNSUPPORTED = re.compile(
    r"not implemented for '(BFloat16|Half)'|does not support (bfloat16|float16)|"
    r"(BFloat16|Half) is not supported", re.I)


def _dtype_facts(failure: Failure, found: re.Match) -> dict | None:
    dtype = (load_yaml(failure.recipe_dir).get("model_config") or {}).get("dtype")
    return {"dtype": dtype} if dtype in ("bfloat16", "float16") else None


def _fix_dtype(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    return edit_yaml_line(failure.recipe_dir, "model_config", "dtype", "float32")


# ---- template defaults --------------------------------------------------------------------
# The template's keys in order (engine/config.py's schema): sections -> keys.
TEMPLATE_ORDER = {section: rendered_keys(section) for section in (None, *SECTIONS)}
ALIASES = {
    "model_config.dtype": {"fp16": "float16", "half": "float16", "torch.float16": "float16",
                           "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
                           "fp32": "float32", "float": "float32", "torch.float32": "float32"},
    "device": {"gpu": "cuda", "ascend": "npu"},
    "exe_mode": {"eager_mode": "eager", "graph_mode": "graph"},
}


def template_defaults(recipe_dir: Path) -> dict:
    """What the template would write for this recipe: {dotted key: value}, from the recipe's spec.
    Values the YAML already has are used to keep the others consistent (e.g. max_new_tokens fits
    beside input_max_len)."""
    from agent.repair_rules.files import recipe_spec

    return recipe_spec(recipe_dir).yaml_defaults()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _split(dotted: str) -> tuple[str | None, str]:
    section, _, key = dotted.rpartition(".")
    return section or None, key


def _scalar(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


def _add_key(recipe_dir: Path, dotted: str, value) -> str:
    """Add a missing key where the template has it (after its predecessor); else at the section end."""
    section, key = _split(dotted)
    path = recipe_yaml(recipe_dir)
    lines = path.read_text().splitlines(keepends=True)
    order = TEMPLATE_ORDER.get(section, [])
    before = order[:order.index(key)] if key in order else []
    indent = "" if section is None else "  "
    in_section = section is None
    anchor = None
    sections = {k for k, v in load_yaml(recipe_dir).items() if isinstance(v, dict)}
    for i, line in enumerate(lines):
        top = line[:1] not in (" ", "\t") and line.strip() and not line.lstrip().startswith("#")
        if section is not None and top:
            in_section = line.startswith(f"{section}:")
            continue
        if in_section and line.startswith(indent) and (section is None) == bool(top):
            name = line.strip().split(":", 1)[0]
            if name in before and not (section is None and name in sections):
                anchor = i
    if anchor is None:
        return edit_yaml_line(recipe_dir, section, key, value)
    lines.insert(anchor + 1, f"{indent}{key}: {_scalar(value)}\n")
    path.write_text("".join(lines))
    return f"added {dotted}: {_scalar(value)} to {path.name}"


def _add_section(recipe_dir: Path, section: str, defaults: dict) -> str:
    path = recipe_yaml(recipe_dir)
    text = path.read_text()
    body = "".join(f"  {k}: {_scalar(defaults[f'{section}.{k}'])}\n" for k in TEMPLATE_ORDER[section])
    path.write_text(text.rstrip("\n") + f"\n\n{section}:\n{body}")
    return f"added section {section} with the template defaults to {path.name}"


# ---- a required key is missing ------------------------------------------------------------
_MISSING_KEY = re.compile(r"missing required key '(?P<key>[\w.]+)'")


def _lookup(settings: dict, dotted: str):
    node = settings
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return KeyError
        node = node[part]
    return node


def _missing_key_facts(failure: Failure, found: re.Match) -> dict | None:
    if recipe_yaml(failure.recipe_dir) is None:
        return None
    key = found["key"]
    if _lookup(load_yaml(failure.recipe_dir), key) is not KeyError:
        return None
    known = key in TEMPLATE_ORDER or key in {f"{s}.{k}" if s else k for s, ks in TEMPLATE_ORDER.items() for k in ks}
    return {"key": key} if known else None


def _fix_missing_key(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    defaults = template_defaults(failure.recipe_dir)
    key = facts["key"]
    if key in TEMPLATE_ORDER:
        return _add_section(failure.recipe_dir, key, defaults)
    if key not in defaults:
        return f"{key} is missing and has no default here (no checkpoint found); set it in the YAML"
    return _add_key(failure.recipe_dir, key, defaults[key])


# ---- a value of the wrong type or not among the choices -----------------------------------
_WRONG_TYPE = re.compile(r"'(?P<key>[\w.]+)' must be (?P<kind>int|str|bool), got ")
_BAD_CHOICE = re.compile(r"'(?P<key>[\w.]+)' is .+; expected one of (?P<choices>[\w, ]+)$", re.M)
_TOO_SMALL = re.compile(r"'(?P<key>[\w.]+)' must be >= 1, got ")
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _coerce(key: str, value, kind: str, choices: list[str] | None):
    """The unambiguous reading of `value` as `kind`, or None."""
    if kind == "int":
        if isinstance(value, str) and re.fullmatch(r"\s*\+?\d+\s*", value):
            value = int(value)
        elif isinstance(value, float) and value.is_integer():
            value = int(value)
        return value if _is_int(value) and value >= 1 else None
    if kind == "bool":
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        return bool(value) if _is_int(value) and value in (0, 1) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not choices:
        return str(value)
    if isinstance(value, str) and choices:
        raw = value.strip().lower()
        mapped = ALIASES.get(key, {}).get(raw, raw)
        return mapped if mapped in choices else None
    return None


def _wrong_type_facts(failure: Failure, _found=None) -> dict | None:
    if recipe_yaml(failure.recipe_dir) is None:
        return None
    for pattern, problem in ((_WRONG_TYPE, "type"), (_BAD_CHOICE, "choice"), (_TOO_SMALL, "range")):
        found = failure.search(pattern, ("output",))
        if found:
            value = _lookup(load_yaml(failure.recipe_dir), found["key"])
            if value is KeyError or isinstance(value, (dict, list)):
                return None
            choices = [c.strip() for c in found["choices"].split(",")] if problem == "choice" else None
            kind = found["kind"] if problem == "type" else ("str" if problem == "choice" else "int")
            return {"key": found["key"], "value": value, "kind": kind, "choices": choices}
    return None


def _fix_wrong_type(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    key = facts["key"]
    if facts["kind"] == "str" and not facts["choices"]:
        from engine.config import CHOICES

        facts["choices"] = list(CHOICES.get(key, ())) or None
    value = _coerce(key, facts["value"], facts["kind"], facts["choices"])
    how = f"{facts['value']!r} read as {value!r}"
    if value is None:
        value = template_defaults(failure.recipe_dir).get(key)
        how = f"{facts['value']!r} has no unambiguous reading; template default {value!r}"
        if value is None:
            return f"{key}: {facts['value']!r} has no unambiguous reading and no default here; set it in the YAML"
    section, name = _split(key)
    return f"{edit_yaml_line(failure.recipe_dir, section, name, value)} ({how})"


# ---- model_path does not exist ------------------------------------------------------------
_PATH_ERRORS = re.compile(r"OSError|HFValidationError|not a local folder|not a valid model identifier|"
                          r"Can't load|Repo id must be|Incorrect path_or_model_id|No such file or directory|"
                          r"does not appear to have a file named config\.json")


def _checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file()


def find_moved_checkpoint(old: Path, max_dirs: int = 5000) -> tuple[Path | None, list[Path]]:
    """A checkpoint dir near a model_path that no longer exists: under its nearest existing
    ancestor (at most 3 levels up), at most 3 levels deep. (the pick or None, all candidates)."""
    anchor = old.parent
    for _ in range(3):
        if anchor.is_dir():
            break
        anchor = anchor.parent
    if not anchor.is_dir() or len(anchor.parts) < 3:      # never search / or /home wholesale
        return None, []
    found: list[Path] = []
    seen = 0
    for root, dirs, files in os.walk(anchor):
        seen += 1
        depth = len(Path(root).relative_to(anchor).parts)
        dirs[:] = [d for d in dirs if not d.startswith(".")] if depth < 3 else []
        if "config.json" in files and any(f.endswith((".safetensors", ".bin")) for f in files):
            found.append(Path(root))
        if seen >= max_dirs:
            break
    same_name = [p for p in found if p.name == old.name]
    pick = same_name[0] if len(same_name) == 1 else (found[0] if len(found) == 1 else None)
    return pick, found


def _model_path_facts(failure: Failure, _found=None) -> dict | None:
    settings = load_yaml(failure.recipe_dir)
    from agent.repair_rules.files import resolve_model_path

    path = resolve_model_path(failure.recipe_dir, settings.get("model_path"))
    if path is None or _checkpoint(path):
        return None
    if settings["model_path"] not in failure.output and str(path) not in failure.output \
            and not failure.search(_PATH_ERRORS, ("output",)):
        return None
    return {"model_path": settings["model_path"], "resolved": str(path)}


def _fix_model_path(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    """model_path is re-pointed only to the checkpoint this recipe was migrated from (the one the
    user named then, recorded as model_dir in migration_report.json). A checkpoint that merely sits
    near the old path may be anyone's: it is named in the note, never written into the YAML."""
    from agent.repair_rules.files import resolve_model_path

    report_dir = resolve_model_path(failure.recipe_dir, report_data(failure.recipe_dir).get("model_dir"))
    if report_dir is not None and _checkpoint(report_dir):
        new, why = report_dir, "the checkpoint migration_report.json recorded (model_dir)"
    else:
        found, candidates = find_moved_checkpoint(Path(facts["resolved"]))
        nearby = list(dict.fromkeys([found, *candidates])) if found is not None else candidates
        listed = ", ".join(map(str, nearby[:5])) or "none"
        return (f"model_path {facts['model_path']} does not exist (report model_dir: {report_dir or 'none'}; "
                f"checkpoints nearby, not chosen for you: {listed}); set model_path in the YAML to the folder "
                "holding config.json and the weights")
    note = edit_yaml_line(failure.recipe_dir, None, "model_path", str(new))
    return f"{note}: {facts['model_path']} does not exist; using {why}"


# ---- prompt + generation longer than the model's positions --------------------------------
_LENGTHS = re.compile(r"input_max_len \((?P<inp>\d+)\) \+ data_config\.max_new_tokens \((?P<new>\d+)\) "
                      r"exceeds max_position_embeddings \((?P<limit>\d+)\)")


def _lengths_facts(failure: Failure, found: re.Match) -> dict | None:
    if recipe_yaml(failure.recipe_dir) is None:
        return None
    return {k: int(v) for k, v in found.groupdict().items()}


def _fix_lengths(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    limit, new = facts["limit"], facts["new"]
    if new >= limit:            # the generation alone does not fit: halve it until the prompt gets half
        while new > max(1, limit // 2):
            new //= 2
    notes = []
    if new != facts["new"]:
        notes.append(edit_yaml_line(failure.recipe_dir, "data_config", "max_new_tokens", new))
    inp = max(1, min(facts["inp"], limit - new))
    if inp != facts["inp"]:
        notes.append(edit_yaml_line(failure.recipe_dir, "data_config", "input_max_len", inp))
    return "; ".join(notes) + f" (max_position_embeddings {limit})"


# ---- the YAML names a device this machine does not have -----------------------------------
_DEVICE = re.compile(r"--device (?P<device>\w+) requested but")


def _device_facts(failure: Failure, found: re.Match) -> dict | None:
    device = load_yaml(failure.recipe_dir).get("device")
    if not isinstance(device, str) or device.lower() != found["device"] or device == "auto":
        return None
    return {"device": device, "reason": found.string[found.start():].splitlines()[0][:300]}


def _fix_device(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    note = edit_yaml_line(failure.recipe_dir, None, "device", "auto")
    return f"{note}: {facts['device']} is not usable here; the run logs the device it actually uses"


# ---- the YAML file is gone ----------------------------------------------------------------
_YAML_NOT_FOUND = re.compile(r"(?P<path>\S+\.ya?ml): YAML file not found")


def _yaml_missing_facts(failure: Failure, found: re.Match) -> dict | None:
    if recipe_yaml(failure.recipe_dir) is not None:
        return None
    named = Path(found["path"])
    named = named if named.is_absolute() else failure.recipe_dir / named
    try:
        rel = str(named.resolve().relative_to(failure.recipe_dir.resolve()))
    except ValueError:
        rel = None
    from agent.render import yaml_name
    from agent.repair_rules.files import recipe_model_name

    if not rel or not rel.startswith("config/"):
        rel = f"config/{yaml_name(recipe_model_name(failure.recipe_dir))}"
    return {"file": rel}


def _fix_yaml_missing(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    from agent.repair_rules.files import render_context, write_rendered

    context, family = render_context(failure.recipe_dir, trust_remote_code=ctx.trust_remote_code)
    if not context["model_path"]:
        return f"{facts['file']} is missing and no checkpoint is known (no migration_report.json model_dir)"
    write_rendered(failure.recipe_dir, facts["file"], context, family)
    return (f"re-rendered {facts['file']} from the template (model_path {context['model_path']}, "
            f"device {context['device']}, dtype {context['dtype']}, max_new_tokens {context['max_new_tokens']})")


_OUT = ("output",)
RULES: list[Rule] = [
    Rule("dtype_unsupported_on_device", _DTYPE_UNSUPPORTED, "the configured dtype cannot run on this device",
         _fix_dtype, facts=_dtype_facts, where=_OUT, kind="yaml"),
    Rule("yaml_missing_key", _MISSING_KEY, "the recipe YAML lacks a required key",
         _fix_missing_key, facts=_missing_key_facts, where=_OUT, kind="yaml"),
    Rule("yaml_wrong_type", None, "a recipe YAML value has the wrong type or is not an accepted value",
         _fix_wrong_type, facts=_wrong_type_facts, kind="yaml"),
    Rule("model_path_missing", None, "the YAML model_path does not point at a checkpoint",
         _fix_model_path, facts=_model_path_facts, kind="yaml"),
    Rule("lengths_exceed_positions", _LENGTHS, "input_max_len + max_new_tokens exceed the model's positions",
         _fix_lengths, facts=_lengths_facts, where=_OUT, kind="yaml"),
    Rule("device_unavailable", _DEVICE, "the YAML names a device this machine cannot use",
         _fix_device, facts=_device_facts, where=_OUT, kind="yaml"),
    Rule("yaml_file_missing", _YAML_NOT_FOUND, "the recipe YAML file is missing",
         _fix_yaml_missing, facts=_yaml_missing_facts, where=_OUT, kind="rerender"),
]
