"""Rules whose fix is a line edit of the recipe YAML the run used: paths, keys, types, dtypes, lengths,
devices, checkpoint key names."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import yaml

from agent.recipe.fs_guard import user_tree
from agent.recipe.recipe import Recipe
from agent.repair.recipe_spec import recipe_spec
from agent.recipe.textfile import read_source, write_source
from agent.recipe.targets import dotted
from agent.repair.failure import Failure
from agent.repair.rules._util import edit_yaml_line
from agent.repair.rules.rule import Kind, RepairContext, Rule, report, where_it_failed
from engine.config import CHOICES, KEYS, SECTIONS, rendered_keys
from engine.safe_load import LoadError, load_json, load_yaml, loads_json, loads_yaml


_DTYPE_UNSUPPORTED = re.compile(
    r"not implemented for '(BFloat16|Half)'|does not support (bfloat16|float16)|"
    r"(BFloat16|Half) is not supported", re.I)


def _dtype_facts(failure: Failure, found: re.Match) -> dict | None:
    dtype = (failure.settings().get("model_config") or {}).get("dtype")
    return {"dtype": dtype} if dtype in ("bfloat16", "float16") else None


def _fix_dtype(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    return edit_yaml_line(failure.yaml, "model_config", "dtype", "float32", root=failure.recipe_dir)


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


def template_defaults(recipe: Recipe) -> dict:
    """What the template would write for this recipe: {dotted key: value}, from the recipe's spec.
    Values the YAML already has are used to keep the others consistent (e.g. max_new_tokens fits
    beside input_max_len)."""
    return recipe_spec(recipe).yaml_defaults()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _split(dotted: str) -> tuple[str | None, str]:
    section, _, key = dotted.rpartition(".")
    return section or None, key


def _scalar(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


def _add_key(failure: Failure, dotted: str, value) -> str:
    """Add a missing key where the template has it (after its predecessor); else at the section end."""
    section, key = _split(dotted)
    path = failure.yaml
    lines = path.read_text().splitlines(keepends=True)
    order = TEMPLATE_ORDER.get(section, [])
    before = order[:order.index(key)] if key in order else []
    indent = "" if section is None else "  "
    in_section = section is None
    anchor = None
    sections = {k for k, v in failure.settings().items() if isinstance(v, dict)}
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
        return edit_yaml_line(path, section, key, value, root=failure.recipe_dir)
    lines.insert(anchor + 1, f"{indent}{key}: {_scalar(value)}\n")
    user_tree(failure.recipe_dir).write_text(path, "".join(lines))
    return f"added {dotted}: {_scalar(value)} to {path.name}"


def _add_section(failure: Failure, section: str, defaults: dict) -> str:
    path = failure.yaml
    text = path.read_text()
    body = "".join(f"  {k}: {_scalar(defaults[f'{section}.{k}'])}\n" for k in TEMPLATE_ORDER[section])
    user_tree(failure.recipe_dir).write_text(path, text.rstrip("\n") + f"\n\n{section}:\n{body}")

    return f"added section {section} with the template defaults to {path.name}"


# ---- a required key is missing ------------------------------------------------------------
_MISSING_KEY = re.compile(r"missing required key '(?P<key>[\w.]+)'")


def _lookup(settings: dict, key: str):
    return dotted(settings, key, KeyError)


def _missing_key_facts(failure: Failure, found: re.Match) -> dict | None:
    if failure.yaml is None:
        return None
    key = found["key"]
    if _lookup(failure.settings(), key) is not KeyError:
        return None
    known = key in TEMPLATE_ORDER or key in {f"{s}.{k}" if s else k for s, ks in TEMPLATE_ORDER.items() for k in ks}
    return {"key": key} if known else None


def _fix_missing_key(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    defaults = template_defaults(failure.recipe)
    key = facts["key"]
    if key in TEMPLATE_ORDER:
        return _add_section(failure, key, defaults)
    if key not in defaults:
        return f"{key} is missing and has no default here (no checkpoint found); set it in the YAML"
    return _add_key(failure, key, defaults[key])


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
    if failure.yaml is None:
        return None
    for pattern, problem in ((_WRONG_TYPE, "type"), (_BAD_CHOICE, "choice"), (_TOO_SMALL, "range")):
        found = failure.search(pattern, ("output",))
        if found:
            value = _lookup(failure.settings(), found["key"])
            if value is KeyError or isinstance(value, (dict, list)):
                return None
            choices = [c.strip() for c in found["choices"].split(",")] if problem == "choice" else None
            kind = found["kind"] if problem == "type" else ("str" if problem == "choice" else "int")
            return {"key": found["key"], "value": value, "kind": kind, "choices": choices}
    return None


def _fix_wrong_type(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    key = facts["key"]
    if facts["kind"] == "str" and not facts["choices"]:
        facts["choices"] = list(CHOICES.get(key, ())) or None
    value = _coerce(key, facts["value"], facts["kind"], facts["choices"])
    how = f"{facts['value']!r} read as {value!r}"
    if value is None:
        value = template_defaults(failure.recipe).get(key)
        how = f"{facts['value']!r} has no unambiguous reading; template default {value!r}"
        if value is None:
            return f"{key}: {facts['value']!r} has no unambiguous reading and no default here; set it in the YAML"
    section, name = _split(key)
    return f"{edit_yaml_line(failure.yaml, section, name, value, root=failure.recipe_dir)} ({how})"


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
    settings = failure.settings()
    path = failure.recipe.resolve(settings.get("model_path"))
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
    report_dir = failure.recipe.resolve(failure.recipe.report().get("model_dir"))
    if report_dir is not None and _checkpoint(report_dir):
        new, why = report_dir, "the checkpoint migration_report.json recorded (model_dir)"
    else:
        found, candidates = find_moved_checkpoint(Path(facts["resolved"]))
        nearby = list(dict.fromkeys([found, *candidates])) if found is not None else candidates
        listed = ", ".join(map(str, nearby[:5])) or "none"
        return (f"model_path {facts['model_path']} does not exist (report model_dir: {report_dir or 'none'}; "
                f"checkpoints nearby, not chosen for you: {listed}); set model_path in the YAML to the folder "
                "holding config.json and the weights")
    note = edit_yaml_line(failure.yaml, None, "model_path", str(new), root=failure.recipe_dir)
    return f"{note}: {facts['model_path']} does not exist; using {why}"


# ---- prompt + generation longer than the model's positions --------------------------------
_LENGTHS = re.compile(r"input_max_len \((?P<inp>\d+)\) \+ data_config\.max_new_tokens \((?P<new>\d+)\) "
                      r"exceeds max_position_embeddings \((?P<limit>\d+)\)")


def _lengths_facts(failure: Failure, found: re.Match) -> dict | None:
    if failure.yaml is None:
        return None
    return {k: int(v) for k, v in found.groupdict().items()}


def _fix_lengths(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    limit, new = facts["limit"], facts["new"]
    if new >= limit:            # the generation alone does not fit: halve it until the prompt gets half
        while new > max(1, limit // 2):
            new //= 2
    notes = []
    if new != facts["new"]:
        notes.append(edit_yaml_line(failure.yaml, "data_config", "max_new_tokens", new, root=failure.recipe_dir))
    inp = max(1, min(facts["inp"], limit - new))
    if inp != facts["inp"]:
        notes.append(edit_yaml_line(failure.yaml, "data_config", "input_max_len", inp, root=failure.recipe_dir))
    return "; ".join(notes) + f" (max_position_embeddings {limit})"


# ---- the YAML names a device this machine does not have -----------------------------------
_DEVICE = re.compile(r"--device (?P<device>\w+) requested but")


def _device_facts(failure: Failure, found: re.Match) -> dict | None:
    device = failure.settings().get("device")
    if not isinstance(device, str) or device.lower() != found["device"] or device == "auto":
        return None
    return {"device": device, "reason": found.string[found.start():].splitlines()[0][:300]}


def _fix_device(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    note = edit_yaml_line(failure.yaml, None, "device", "auto", root=failure.recipe_dir)
    return f"{note}: {facts['device']} is not usable here; the run logs the device it actually uses"


# ---- state dict key mismatch ----------------------------------------------------------
_STATE_DICT = re.compile(r"state dict mismatch loading (?P<path>.+?): missing keys (?P<missing>\[.*?\]), "
                         r"unexpected keys (?P<unexpected>\[.*?\]), mismatched shapes (?P<shapes>\[.*?\])")


_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "tok_embeddings.weight",
                       "embeddings.weight", "embedding.weight")


def _key_list(text: str) -> list[str]:
    return re.findall(r"'([^']*)'", text)


def _common_suffix(a: str, b: str) -> int:
    """Number of trailing dot-components a and b share."""
    pa, pb = a.split("."), b.split(".")
    n = 0
    while n < min(len(pa), len(pb)) and pa[-1 - n] == pb[-1 - n]:
        n += 1
    return n


def key_prefix_mapping(missing: list[str], unexpected: list[str]) -> dict[str, str] | None:
    """{regex: replacement} renaming the checkpoint's (unexpected) prefix to the code's (missing)
    one, when every missing key is an unexpected key with one consistent prefix swapped."""
    if not missing or not unexpected:
        return None
    pairs = set()
    for key in missing:
        best = max(unexpected, key=lambda u: _common_suffix(key, u))
        n = _common_suffix(key, best)
        ours, theirs = key.split("."), best.split(".")
        if n < 2 or n == len(ours) and n == len(theirs):
            return None
        pairs.add((".".join(theirs[:len(theirs) - n]), ".".join(ours[:len(ours) - n])))
    if len(pairs) != 1:
        return None
    theirs, ours = pairs.pop()
    if theirs:
        return {f"^{re.escape(theirs + '.')}": f"{ours}." if ours else ""}
    return {"^": f"{ours}."}


def checkpoint_keys(model_path: Path) -> set[str]:
    """Tensor names of a safetensors checkpoint (headers only: no tensor is read)."""
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        return set(load_json(index).get("weight_map", {}))
    keys: set[str] = set()
    for shard in model_path.glob("*.safetensors"):
        with open(shard, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            keys |= set(loads_json(f.read(size))) - {"__metadata__"}
    return keys


def _state_dict_facts(failure: Failure, found: re.Match) -> dict | None:
    missing, unexpected = _key_list(found["missing"]), _key_list(found["unexpected"])
    if _key_list(found["shapes"]):
        return None                       # shapes differ: a config problem, not naming
    model_config = failure.settings().get("model_config") or {}
    if missing == ["lm_head.weight"] and not unexpected:
        if (model_config.get("config_overrides") or {}).get("tie_word_embeddings") is True:
            return None                   # already applied: it did not help
        try:
            keys = checkpoint_keys(Path(found["path"]))
        except (OSError, ValueError, struct.error):
            return None
        if any(k.endswith(_EMBEDDING_SUFFIXES) for k in keys) and "lm_head.weight" not in keys:
            return {"fix": "tie_word_embeddings",
                    "config_overrides": {**(model_config.get("config_overrides") or {}), "tie_word_embeddings": True}}
        return None
    mapping = key_prefix_mapping(missing, unexpected)
    current = model_config.get("key_mapping") or {}
    if mapping is None or all(current.get(k) == v for k, v in mapping.items()):
        return None
    return {"fix": "key_mapping", "key_mapping": {**current, **mapping}}


def _fix_state_dict(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    if facts["fix"] == "tie_word_embeddings":
        return edit_yaml_line(failure.yaml, "model_config", "config_overrides", facts["config_overrides"],
                              root=failure.recipe_dir)
    return edit_yaml_line(failure.yaml, "model_config", "key_mapping", facts["key_mapping"], root=failure.recipe_dir)


# ---- mixed dtypes in recipe code ----------------------------------------------------------
_MIXED_DTYPE = re.compile(r"expected scalar type (\w+) but found (\w+)|expected m(?:at)?1 and m(?:at)?2 to have the "
                          r"same dtype, but got: ([\w:]+) != ([\w:]+)|Input type \((\w+)\) and bias type \((\w+)\)")


def _mixed_dtype_facts(failure: Failure, found: re.Match) -> dict | None:
    dtype = (failure.settings().get("model_config") or {}).get("dtype")
    types = " and ".join(g for g in found.groups() if g)
    return {"dtype": dtype, "types": types, "where": where_it_failed(failure), "fixable": dtype in ("bfloat16", "float16")}


def _fix_mixed_dtype(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    if facts["fixable"]:
        note = edit_yaml_line(failure.yaml, "model_config", "dtype", "float32", root=failure.recipe_dir)
        return f"{note}: tensors of {facts['types']} met at {facts['where']}; one dtype (float32) everywhere"
    return (f"tensors of {facts['types']} meet at {facts['where']} although model_config.dtype is {facts['dtype']}: "
            "recipe code creates a tensor in another dtype; cast it with .to(<weights>.dtype) there")


# ---- the recipe YAML does not parse -------------------------------------------------------
_YAML_ERROR = re.compile(r"\b(ScannerError|ParserError|ComposerError|ConstructorError)\b|not valid YAML")


def _yaml_syntax_facts(failure: Failure, found: re.Match) -> dict | None:
    """The recipe YAML really does not parse: where, from our own parse."""
    path = failure.yaml
    if path is None:
        return None
    try:
        load_yaml(path)
        return None
    except LoadError as exc:
        rel = str(path.relative_to(failure.recipe_dir))
        syntax = exc.syntax
        if syntax is None:
            return {"file": rel, "line": exc.line or 0, "col": exc.column or 0, "kind": "LoadError",
                    "problem": exc.problem, "text": ""}
        mark = syntax.problem_mark
        lines = read_source(path).splitlines()
        text = lines[mark.line].rstrip() if mark and mark.line < len(lines) else ""
        return {"file": rel, "line": mark.line + 1 if mark else 0,
                "col": mark.column + 1 if mark else 0, "kind": type(syntax).__name__, "problem": syntax.problem or "",
                "text": text}
    except OSError:
        return None


def _fix_one_slip(lines: list[str], exc) -> str | None:
    """Fix the slip PyYAML points at (a tab in the indentation, a missing space after ':', an
    indentation off by a space, an unquoted value holding ': '), in place; returns what was done."""
    mark = exc.context_mark if exc.context == "while scanning a simple key" and exc.context_mark else exc.problem_mark
    if mark is None or mark.line >= len(lines):
        return None
    at = mark.line
    line = lines[at]
    indent = re.match(r"[ \t]*", line).group(0)
    if "\t" in indent:
        lines[at] = indent.replace("\t", "  ") + line[len(indent):]
        return f"line {at + 1}: a tab in the indentation replaced by spaces"
    key = re.match(r"^(\s*)([A-Za-z_][\w.-]*):(\S.*)$", line)
    if exc.problem == "could not find expected ':'" and key and not key.group(3).startswith(("//", ":")):
        lines[at] = f"{key.group(1)}{key.group(2)}: {key.group(3)}"
        return f"line {at + 1}: a space added after '{key.group(2)}:'"
    if exc.problem == "mapping values are not allowed here":
        previous = next((ln for ln in reversed(lines[:at]) if ln.strip() and not ln.lstrip().startswith("#")), "")
        prev_indent = len(previous) - len(previous.lstrip())
        want = prev_indent + 2 if previous.rstrip().endswith(":") else prev_indent
        if len(indent) != want and abs(len(indent) - want) == 1:
            lines[at] = " " * want + line.lstrip()
            return f"line {at + 1}: indentation aligned with the line above"
        pair = re.match(r"^(\s*)([A-Za-z_][\w.-]*):\s+(.*\S)\s*$", line)
        choices = {key.leaf for key in KEYS if key.choices}      # exe_mode: eager: fast has no one reading
        if pair and ": " in pair.group(3) and not pair.group(3).startswith(("'", '"', "{", "[")) \
                and pair.group(2) not in choices:
            lines[at] = f"{pair.group(1)}{pair.group(2)}: {json.dumps(pair.group(3), ensure_ascii=False)}"
            return f"line {at + 1}: the value of '{pair.group(2)}' (it holds ': ') quoted"
    return None


def _fix_yaml_syntax(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    """The slips the diagnosis names, fixed one at a time at the place PyYAML reports, until the
    YAML parses as a mapping; if it does not, nothing is written and the diagnosis stands."""
    path = failure.recipe_dir / facts["file"]
    original = path.read_bytes()
    lines = read_source(path).split("\n")
    done = []
    for _ in range(20):
        try:
            data = loads_yaml("\n".join(lines), str(path))
        except LoadError as exc:
            what = _fix_one_slip(lines, exc.syntax) if exc.syntax is not None else None
            if what is None:
                break
            done.append(what)
            continue
        if isinstance(data, dict) and done:
            write_source(path, "\n".join(lines), original, root=failure.recipe_dir)
            return f"{facts['file']}: " + "; ".join(done)
        break
    return report("{file} line {line} column {col} is not valid YAML ({kind}): {problem}: {text!r}; typical "
                  "causes: a missing space after ':', a tab in the indentation, an unquoted value containing ': ' "
                  "(quote it)")(failure, facts, ctx)


RULES: list[Rule] = [
    Rule("recipe_yaml_syntax_error", _YAML_ERROR, "the recipe YAML is not valid YAML",
         _fix_yaml_syntax, facts=_yaml_syntax_facts, kind=Kind.YAML),
    Rule("dtype_unsupported_on_device", _DTYPE_UNSUPPORTED, "the configured dtype cannot run on this device",
         _fix_dtype, facts=_dtype_facts, where=("output",), kind=Kind.YAML),
    Rule("yaml_missing_key", _MISSING_KEY, "the recipe YAML lacks a required key",
         _fix_missing_key, facts=_missing_key_facts, where=("output",), kind=Kind.YAML),
    Rule("yaml_wrong_type", None, "a recipe YAML value has the wrong type or is not an accepted value",
         _fix_wrong_type, facts=_wrong_type_facts, kind=Kind.YAML),
    Rule("model_path_missing", None, "the YAML model_path does not point at a checkpoint",
         _fix_model_path, facts=_model_path_facts, kind=Kind.YAML),
    Rule("lengths_exceed_positions", _LENGTHS, "input_max_len + max_new_tokens exceed the model's positions",
         _fix_lengths, facts=_lengths_facts, where=("output",), kind=Kind.YAML),
    Rule("device_unavailable", _DEVICE, "the YAML names a device this machine cannot use",
         _fix_device, facts=_device_facts, where=("output",), kind=Kind.YAML),
    Rule("state_dict_key_mismatch", _STATE_DICT, "checkpoint weights are named differently from the model's parameters",
         _fix_state_dict, facts=_state_dict_facts, kind=Kind.YAML),
    Rule("mixed_dtype_in_recipe_code", _MIXED_DTYPE,
         "tensors of two dtypes meet in one operation",
         _fix_mixed_dtype,
         facts=_mixed_dtype_facts, kind=Kind.YAML),
]
