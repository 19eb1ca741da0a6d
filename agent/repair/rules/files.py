"""Rules whose fix removes, re-renders or re-vendors a recipe file, or edits infer.sh: packages,
PYTHONPATH, missing or corrupt files, line endings."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import sys
from pathlib import Path


from agent.recipe.fs_guard import user_tree
from agent.migrate.vendor import locate_source, read_config, vendor_source
from agent.processes import owned_temp
from agent.recipe.recipe import Recipe, runner_files
from agent.recipe.render import generated_files, render_file, write_rendered
from agent.repair.recipe_spec import recipe_spec
from agent.recipe.textfile import read_source, write_source
from agent.repair.failure import Failure
from agent.repair.rules.rule import Kind, RepairContext, Rule


_MODELS_INIT = re.compile(r"models/__init__\.py|No module named 'models[.']|'models' is not a package")


def _models_init_facts(failure: Failure, found: re.Match) -> dict | None:
    init = failure.recipe_dir / "models" / "__init__.py"
    return {"file": "models/__init__.py"} if init.is_file() else None


def _fix_models_init(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    # The recipe's models/ is a namespace package: an __init__.py copied from elsewhere
    # (often importing modules this recipe does not have) shadows it. Backed up, then removed.
    user_tree(failure.recipe_dir).unlink(failure.recipe_dir / facts["file"], missing_ok=False)
    return "removed models/__init__.py (models/ is a namespace package in a recipe)"


def _inside(recipe_dir: Path, path: str) -> str | None:
    """recipe-relative form of an absolute path printed by the run, or None when outside."""
    try:
        return str(Path(path).resolve().relative_to(recipe_dir.resolve()))
    except (ValueError, OSError):
        return None


# ---- infer.sh does not put the recipe on PYTHONPATH ---------------------------------------
_TOP_MODULE_MISSING = re.compile(r"No module named '(\w+)'")


_RECIPE_ON_PATH = re.compile(r"^\s*(?:export\s+)?PYTHONPATH=.*(SCRIPT_DIR|dirname|BASH_SOURCE|\$PWD|\$\(pwd\))",
                             re.M)


_ASSIGNMENT = re.compile(r"^\s*(?:export\s+|local\s+|readonly\s+)?\w+=")


_PYTHON_LINE = re.compile(r"^\s*(?:exec\s+)?\S*(?:PYTHON|python[\d.]*|torchrun)\S*(?:\s|$)")


def _python_line(lines: list[str]) -> int | None:
    for i, line in enumerate(lines):
        if line.lstrip().startswith("#") or _ASSIGNMENT.match(line):
            continue
        if _PYTHON_LINE.match(line):
            return i
    return None


def _no_pythonpath_facts(failure: Failure, found: re.Match) -> dict | None:
    infer_sh = failure.recipe_dir / "infer.sh"
    if not infer_sh.is_file():
        return None
    module = found.group(1)
    # Only the recipe's own top-level modules: models/ or runner_<name>.py that do exist.
    if not ((failure.recipe_dir / module).is_dir() or (failure.recipe_dir / f"{module}.py").is_file()):
        return None
    text = infer_sh.read_text()
    if _RECIPE_ON_PATH.search(text) or str(failure.recipe_dir.resolve()) in text:
        return None
    if _python_line(text.splitlines(keepends=True)) is None:
        return None
    return {"module": module}


def _fix_no_pythonpath(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    infer_sh = failure.recipe_dir / "infer.sh"
    lines = infer_sh.read_text().splitlines(keepends=True)
    at = _python_line(lines)
    indent = re.match(r"\s*", lines[at]).group(0)
    defines_script_dir = any(re.match(r"\s*(?:export\s+)?SCRIPT_DIR=", ln) for ln in lines[:at])
    recipe = "$SCRIPT_DIR" if defines_script_dir else '$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)'
    lines.insert(at, f'{indent}export PYTHONPATH="{recipe}${{PYTHONPATH:+:$PYTHONPATH}}"\n')
    user_tree(failure.recipe_dir).write_text(infer_sh, "".join(lines))
    return f"infer.sh: export PYTHONPATH with the recipe dir before line {at + 1} (import of '{facts['module']}')"


# ---- a vendored model file was deleted ----------------------------------------------------
_SUBMODULE_MISSING = re.compile(r"No module named 'models\.(\w+)'")


def _vendored_stems(recipe: Recipe) -> set[str]:
    name = recipe.model_name
    stems = {f"modeling_{name}", f"configuration_{name}"}
    files = ((recipe.report().get("vendored") or {}).get("files") or {}).values()
    stems |= {Path(f).stem for f in files if str(f).startswith("models/")}
    return stems


def _vendored_missing_facts(failure: Failure, found: re.Match) -> dict | None:
    if not (failure.recipe_dir / "models").is_dir():
        return None
    stem = found.group(1)
    if (failure.recipe_dir / "models" / f"{stem}.py").exists() or stem not in _vendored_stems(failure.recipe):
        return None
    return {"file": f"models/{stem}.py"}


def _fix_vendored_missing(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    recipe_dir = failure.recipe_dir
    model_dir = failure.recipe.checkpoint_dir()
    if model_dir is None:
        return (f"{facts['file']} is missing and no checkpoint was found to re-vendor it from "
                "(neither the YAML model_path nor the report's model_dir holds a config.json)")
    source = locate_source(read_config(model_dir), model_dir, trust_remote_code=ctx.trust_remote_code)
    # From the release it was vendored from (a checkout's transformers, agent.migrate.transformers_source),
    # with the imports of its target's layout.
    from agent.migrate.transformers_source import SourceTree
    from agent.recipe.targets import OWN_LAYOUT

    plan = failure.recipe.report().get("transformers") or {}
    tree = SourceTree(plan["version"], Path(plan["source_root"]), plan.get("origin") or "") \
        if plan.get("source_root") and Path(plan["source_root"], "transformers").is_dir() else None
    target = failure.recipe.target if failure.recipe.is_recipe else OWN_LAYOUT
    package = target.vendored_package.format(name=failure.recipe.model_name)
    # Vendor aside and copy back only the missing file: the other vendored files may carry edits.
    with owned_temp("revendor") as tmp:
        result = vendor_source(source, Path(tmp), failure.recipe.model_name, package, tree=tree)
        source = result.source
        fresh = Path(tmp) / facts["file"]
        if not fresh.is_file():
            written = ", ".join(str(p.relative_to(tmp)) for p in result.files.values())
            return f"re-vendoring {source.model_class} gives {written}, not {facts['file']}"
        user_tree(recipe_dir).write_text(recipe_dir / facts["file"], fresh.read_text())
    was = (failure.recipe.report().get("vendored") or {}).get("origin")
    drift = f" (first vendored from {was})" if was and was != source.origin else ""
    return f"re-vendored {facts['file']} ({source.model_class}) from {source.origin}{drift}"


# ---- a generated file is missing or corrupt -----------------------------------------------
_CANT_OPEN = re.compile(r"can't open file '(?P<path>[^']+)'")


_MODULE_MISSING = re.compile(r"No module named '(?P<module>[\w.]+)'")


_SYNTAX = re.compile(r"^(SyntaxError|IndentationError|TabError)\b")   # at the start of the error line


_GENERATED_PY = ("infer.py", "models/model_setting.py")


def _is_generated(recipe: Recipe, rel: str, name: str) -> bool:
    rendered = recipe.report().get("rendered")
    if rendered:
        return rel in rendered
    return rel in (*_GENERATED_PY, f"runner_{name}.py")


def _carries_header(recipe: Recipe, rel: str) -> bool:
    """The file starts with the line the template writes (it was generated, then damaged)."""
    try:
        first = (recipe.path / rel).read_text(errors="replace").splitlines()[:1]
        spec = recipe_spec(recipe)
        return bool(first) and first == render_file(rel, spec.context(), spec.family_spec()).splitlines()[:1]
    except Exception:  # noqa: BLE001 - not renderable: not ours
        return False


def _generated_facts(failure: Failure, _found=None) -> dict | None:
    recipe_dir = failure.recipe_dir
    name = failure.recipe.model_name
    candidates: list[tuple[str, str]] = []
    if (found := failure.search(_CANT_OPEN, ("output",))) and (rel := _inside(recipe_dir, found["path"])):
        candidates.append((rel, "missing"))
    for found in failure.search_all(_MODULE_MISSING):
        module = found["module"]
        if module.startswith("runner_"):
            name = module.removeprefix("runner_")
        candidates.append((module.replace(".", "/") + ".py", "missing"))
    if failure.search(_SYNTAX, ("error",)) and failure.location:
        rel = _inside(recipe_dir, failure.location.rpartition(":")[0])
        if rel:
            candidates.append((rel, "corrupt"))
    if not failure.output.strip() or failure.error == "no output":
        # A run that printed nothing: a generated file cut short can still be valid Python.
        truncated = _truncated_generated(failure.recipe, name)
        if truncated:
            return {"file": truncated, "state": "corrupt", "model_name": name}
    for rel, state in candidates:
        path = recipe_dir / rel
        if state == "missing" and not path.exists() and _is_generated(failure.recipe, rel, name):
            return {"file": rel, "state": "missing", "model_name": name}
        if state == "corrupt" and path.is_file() and rel.endswith(".py"):
            try:
                compile(path.read_text(), str(path), "exec")
                continue                       # it compiles: the SyntaxError is elsewhere
            except (SyntaxError, ValueError):
                pass
            if _is_generated(failure.recipe, rel, name) or _carries_header(failure.recipe, rel):
                return {"file": rel, "state": "corrupt", "model_name": name}
    return None


def _truncated_generated(recipe: Recipe, name: str) -> str | None:
    """The generated file whose text is a strict prefix of what the templates give (a copy or a save
    interrupted halfway), if any."""
    try:
        spec = recipe_spec(recipe, name)
        context, family = spec.context(), spec.family_spec()
        targets = generated_files(name, family)
    except Exception:  # noqa: BLE001 - not one of our recipes, or not enough left to tell
        return None
    for rel in targets:
        path = recipe.path / rel
        if not path.is_file() or not rel.endswith((".py", ".sh")):
            continue
        current = path.read_text(errors="replace")
        try:
            expected = render_file(rel, context, family)
        except Exception:  # noqa: BLE001
            continue
        if current and current != expected and expected.startswith(current):
            return rel
    return None


def _fix_generated(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    recipe_dir = failure.recipe_dir
    spec = recipe_spec(failure.recipe, facts.get("model_name"), ctx.trust_remote_code)
    context, family = spec.context(), spec.family_spec()
    path = recipe_dir / facts["file"]
    old = path.read_text(errors="replace") if path.is_file() else None
    fresh = render_file(facts["file"], context, family)
    write_rendered(recipe_dir, facts["file"], context, family)
    if old is None:
        return f"re-rendered the missing {facts['file']} from the templates"
    how = "a truncated copy of" if fresh.startswith(old.rstrip()) else "not a plain truncation of (edits in the backup)"
    return f"re-rendered {facts['file']} from the templates (it had a syntax error; it was {how} the template output)"


# ---- a stray recipe file shadows a package ------------------------------------------------
_SHADOW_PATTERNS = (
    re.compile(r"module '(\w+)' has no attribute"),
    re.compile(r"cannot import name '\w+' from '(\w+)'"),
    re.compile(r"No module named '(\w+)\.[\w.]+'; '\w+' is not a package"),
    re.compile(r"partially initialized module '(\w+)'"),
)


_FRAME_AND_CODE = re.compile(r'File "([^"]+)", line \d+[^\n]*\n[ \t]*([^\n]*)')   # a frame and its source line


def _shadows(recipe_dir: Path, stem: str) -> bool:
    """A module of that name exists outside the recipe (stdlib or installed)."""
    if stem in sys.stdlib_module_names or stem in ("engine", "agent"):
        return True
    recipe = str(recipe_dir.resolve())
    paths = [p for p in sys.path if p and str(Path(p).resolve()) != recipe]
    try:
        spec = importlib.machinery.PathFinder.find_spec(stem, paths)
    except (ImportError, ValueError):
        return False
    return spec is not None


def _shadowing_facts(failure: Failure, _found=None) -> dict | None:
    recipe_dir = failure.recipe_dir
    stems = [found.group(1) for pattern in _SHADOW_PATTERNS for found in failure.search_all(pattern)]
    # ...or the traceback enters a top-level recipe file from an `import <its name>` line.
    frames = [found.groups() for found in failure.search_all(_FRAME_AND_CODE)]
    for (_, caller_code), (path, _) in zip(frames, frames[1:]):
        rel = _inside(recipe_dir, path)
        if rel and "/" not in rel and rel.endswith(".py") and \
                re.search(rf"\b(import|from)\s+{re.escape(rel[:-3])}\b", caller_code):
            stems.append(rel[:-3])
    own = {"infer"} | {p.stem for p in runner_files(recipe_dir)}
    for stem in dict.fromkeys(stems):
        if stem not in own and (recipe_dir / f"{stem}.py").is_file() and _shadows(recipe_dir, stem):
            return {"file": f"{stem}.py", "module": stem}
    return None


def _fix_shadowing(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    path = failure.recipe_dir / facts["file"]
    aside = path.with_name(path.name + ".shadowing")
    user_tree(failure.recipe_dir).replace(path, aside)
    return (f"renamed {facts['file']} to {aside.name}: on the recipe's sys.path it shadowed the "
            f"'{facts['module']}' module")


# ---- the YAML file is gone ----------------------------------------------------------------
_YAML_NOT_FOUND = re.compile(r"(?P<path>\S+\.ya?ml): YAML file not found")


def _yaml_missing_facts(failure: Failure, found: re.Match) -> dict | None:
    if failure.yaml is not None:
        return None
    named = Path(found["path"])
    named = named if named.is_absolute() else failure.recipe_dir / named
    try:
        rel = str(named.resolve().relative_to(failure.recipe_dir.resolve()))
    except ValueError:
        rel = None
    if not rel or not rel.startswith("config/"):
        rel = f"config/{failure.recipe.yaml_name()}"
    return {"file": rel}


def _fix_yaml_missing(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    spec = recipe_spec(failure.recipe, trust_remote_code=ctx.trust_remote_code)
    context, family = spec.context(), spec.family_spec()
    if not context["model_path"]:
        return f"{facts['file']} is missing and no checkpoint is known (no migration_report.json model_dir)"
    write_rendered(failure.recipe_dir, facts["file"], context, family)
    return (f"re-rendered {facts['file']} from the template (model_path {context['model_path']}, "
            f"device {context['device']}, dtype {context['dtype']}, max_new_tokens {context['max_new_tokens']})")


# ---- shell scripts with CRLF line endings -------------------------------------------------
# bash's complaint about a script (a run's output is read with universal newlines, so the "\r" in
# "pipefail\r: invalid option name" may already be a line break; the script's own bytes decide).
_CRLF_ERROR = re.compile(r"\.sh: line \d+: ")


def _crlf_facts(failure: Failure, found: re.Match) -> dict | None:
    files = [p.name for p in sorted(failure.recipe_dir.glob("*.sh")) if b"\r\n" in p.read_bytes()]
    return {"files": files} if files else None


def _fix_crlf(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    for name in facts["files"]:
        path = failure.recipe_dir / name
        user_tree(failure.recipe_dir).write_bytes(path, path.read_bytes().replace(b"\r\n", b"\n"))   # mode kept

    return f"converted {', '.join(facts['files'])} from CRLF (Windows) to LF line endings"


# ---- infer.sh does not put the repository root on PYTHONPATH (upstream's common issue 3) ----------
# a sibling model (models.gpt_oss, imported by executor/core/support_models.py), or the shared executor itself
_SIBLING_MISSING = re.compile(r"No module named '(?P<sibling>models\.\w+|executor|module)'")
_REPO_ON_PATH = re.compile(r"^\s*(?:export\s+)?PYTHONPATH=.*(?:/\.\./\.\.|recipes_path|REPO_ROOT)", re.M)


def _repo_root_facts(failure: Failure, found: re.Match) -> dict | None:
    recipe = failure.recipe.path
    root = failure.recipe.repo_root
    infer_sh = recipe / "infer.sh"
    sibling = found.group("sibling")
    if root is None or recipe.parent != root / "models" or not infer_sh.is_file():
        return None
    if (recipe / "models" / "__init__.py").exists() or not (root / sibling.replace(".", "/")).is_dir():
        return None     # issue 1 (the shadowing __init__.py) first; a sibling that does not exist is not this
    text = infer_sh.read_text(errors="replace")
    if _REPO_ON_PATH.search(text):
        return None
    return {"sibling": sibling, "script_path": "SCRIPT_PATH=" in text}


def _fix_repo_root(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    infer_sh = failure.recipe_dir / "infer.sh"
    original = infer_sh.read_bytes()
    lines = read_source(infer_sh).splitlines(keepends=True)
    line = ('export PYTHONPATH="${SCRIPT_PATH}/../..:${PYTHONPATH}"\n' if facts["script_path"] else
            'export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"\n')
    at = _python_line(lines)
    # after the set_env / function.sh lines, as the issue says: right before the line that runs Python
    lines.insert(len(lines) if at is None else at, line)
    write_source(infer_sh, "".join(lines), original, root=failure.recipe_dir)
    return f"infer.sh exports the repository root on PYTHONPATH ({facts['sibling']} is in the repository)"


RULES: list[Rule] = [
    Rule("models_init_shadows_package", _MODELS_INIT, "a models/__init__.py shadows the recipe's models package",
         _fix_models_init, facts=_models_init_facts, where=("output",), kind=Kind.REMOVE),
    Rule("infer_sh_no_pythonpath", _TOP_MODULE_MISSING,
         "infer.sh does not put the recipe dir on PYTHONPATH, so the recipe's modules are not found",
         _fix_no_pythonpath, facts=_no_pythonpath_facts, where=("output",), kind=Kind.INFER_SH),
    Rule("infer_sh_without_repository_root", _SIBLING_MISSING,
         "infer.sh does not put the repository root on PYTHONPATH, so sibling models are not found "
         "(upstream common issue 3)",
         _fix_repo_root, facts=_repo_root_facts, where=("error", "output", "log"), kind=Kind.INFER_SH),
    Rule("vendored_module_missing", _SUBMODULE_MISSING, "a vendored model source file is missing from models/",
         _fix_vendored_missing, facts=_vendored_missing_facts, where=("output",), kind=Kind.RERENDER),
    Rule("generated_file_missing_or_corrupt", None, "a file the migrator generated is missing or has a syntax error",
         _fix_generated, facts=_generated_facts, kind=Kind.RERENDER),
    Rule("recipe_file_shadows_stdlib_or_package", None,
         "a file in the recipe dir shadows a standard or installed module of the same name",
         _fix_shadowing, facts=_shadowing_facts, kind=Kind.REMOVE),
    Rule("yaml_file_missing", _YAML_NOT_FOUND, "the recipe YAML file is missing",
         _fix_yaml_missing, facts=_yaml_missing_facts, where=("output",), kind=Kind.RERENDER),
    Rule("shell_script_crlf", _CRLF_ERROR,
         "a recipe shell script has Windows (CRLF) line endings",
         _fix_crlf,
         facts=_crlf_facts, where=("output",), kind=Kind.INFER_SH, keeps_format=False),
]
