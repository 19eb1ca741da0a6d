"""Rules about the recipe's files and layout: packages, PYTHONPATH, missing or corrupt files."""

from __future__ import annotations

import ast
import importlib.machinery
import re
import sys
import tempfile
from pathlib import Path

from libcst.codemod import CodemodContext

from agent.codemods.repair import InsertWarmUpCommand, generate_calls, rewrite_file, warm_up_argument
from agent.repair.failure import Failure
from agent.repair.rules._util import load_yaml, report_data
from agent.repair.rules.rule import RepairContext, Rule


_MODELS_INIT = re.compile(r"models/__init__\.py|No module named 'models[.']|'models' is not a package")


def _models_init_facts(failure: Failure, found: re.Match) -> dict | None:
    init = failure.recipe_dir / "models" / "__init__.py"
    return {"file": "models/__init__.py"} if init.is_file() else None


def _fix_models_init(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    # The recipe's models/ is a namespace package: an __init__.py copied from elsewhere
    # (often importing modules this recipe does not have) shadows it. Backed up, then removed.
    (failure.recipe_dir / facts["file"]).unlink()
    return "removed models/__init__.py (models/ is a namespace package in a recipe)"


# ---- shared: the recipe's identity and render context -------------------------------------
def recipe_model_name(recipe_dir: Path) -> str:
    """The recipe's model name: the runner file, else the report, else the YAML, else the folder."""
    runners = sorted(recipe_dir.glob("runner_*.py"))
    if runners:
        return runners[0].stem.removeprefix("runner_")
    return (report_data(recipe_dir).get("model_name") or load_yaml(recipe_dir).get("model_name")
            or recipe_dir.name)


def resolve_model_path(recipe_dir: Path, model_path) -> Path | None:
    """A YAML model_path as the engine resolves it (relative paths from the recipe dir)."""
    if not isinstance(model_path, str) or not model_path.strip():
        return None
    path = Path(model_path).expanduser()
    return path if path.is_absolute() else (recipe_dir / path).resolve()


def checkpoint_dir(recipe_dir: Path) -> Path | None:
    """The checkpoint the recipe runs: the YAML model_path, else the report's model_dir (if it exists)."""
    candidates = [resolve_model_path(recipe_dir, load_yaml(recipe_dir).get("model_path")),
                  resolve_model_path(recipe_dir, report_data(recipe_dir).get("model_dir"))]
    return next((p for p in candidates if p is not None and (p / "config.json").is_file()), None)


def _runner_imports(recipe_dir: Path, name: str) -> dict:
    """model/config class names from the runner's `from models.X import Cls` lines (read only)."""
    runner = recipe_dir / f"runner_{name}.py"
    found: dict[str, str] = {}
    try:
        tree = ast.parse(runner.read_text())
    except (OSError, SyntaxError, ValueError):
        return found
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.names:
            if node.module == f"models.modeling_{name}":
                found["model_class"] = node.names[0].name
            elif node.module == f"models.configuration_{name}":
                found["config_class"] = node.names[0].name
    return found


def recipe_spec(recipe_dir: Path, model_name: str | None = None, trust_remote_code: bool = False):
    """The recipe's agent.recipe.spec.RecipeSpec, rebuilt from migration_report.json, the YAML and the
    checkpoint. YAML values that validate are kept."""
    from agent.recipe.spec import RecipeSpec
    from agent.migrate.vendor import locate_source, read_config

    report = report_data(recipe_dir)
    name = model_name or report.get("model_name") or recipe_model_name(recipe_dir)
    model_dir = checkpoint_dir(recipe_dir)
    config = read_config(model_dir) if model_dir else {}
    vendored = dict(report.get("vendored") or {})
    if not {"model_class", "config_class", "modeling_module", "configuration_module"} <= set(vendored):
        if config:
            try:
                source = locate_source(config, model_dir, trust_remote_code=trust_remote_code)
                vendored = {"model_class": source.model_class, "config_class": source.config_class,
                            "modeling_module": source.modeling_module,
                            "configuration_module": source.configuration_module,
                            "origin": source.origin, "attn_implementation": source.attn_implementation,
                            **vendored}
            except Exception:  # noqa: BLE001 - fall back to what the runner imports
                pass
        vendored = {**_runner_imports(recipe_dir, name), **vendored}
    return RecipeSpec.from_recipe(model_name=name, report=report, settings=load_yaml(recipe_dir),
                                  model_dir=model_dir, config=config, vendored=vendored)


def render_context(recipe_dir: Path, model_name: str | None = None, trust_remote_code: bool = False):
    """(context, family) for the templates, from the recipe's spec (as node_render renders it)."""
    spec = recipe_spec(recipe_dir, model_name, trust_remote_code)
    return spec.context(), spec.family_spec()


def generated_targets(name: str, family) -> dict[str, str]:
    """recipe-relative path -> template, for every file the migrator renders."""
    from agent.recipe.render import RECIPE_FILES, yaml_name

    targets = {target.format(name=name, yaml_name=yaml_name(name)): template
               for template, target in RECIPE_FILES.items()}
    targets[f"runner_{name}.py"] = family.runner_template
    return targets


def render_file(recipe_dir: Path, rel: str, context: dict, family) -> str:
    """The text the templates give for one recipe file (rel: recipe-relative path)."""
    from agent.recipe.render import render_text

    targets = generated_targets(context["model_name"], family)
    if rel not in targets and rel.startswith("config/") and rel.endswith((".yaml", ".yml")):
        template = "config.yaml.j2"
    else:
        template = targets[rel]
    return render_text(template, context, family)


def write_rendered(recipe_dir: Path, rel: str, context: dict, family) -> Path:
    path = recipe_dir / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_file(recipe_dir, rel, context, family))
    if path.suffix == ".sh":
        path.chmod(0o755)
    return path


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
    infer_sh.write_text("".join(lines))
    return f"infer.sh: export PYTHONPATH with the recipe dir before line {at + 1} (import of '{facts['module']}')"


# ---- a vendored model file was deleted ----------------------------------------------------
_SUBMODULE_MISSING = re.compile(r"No module named 'models\.(\w+)'")


def _vendored_stems(recipe_dir: Path) -> set[str]:
    name = recipe_model_name(recipe_dir)
    stems = {f"modeling_{name}", f"configuration_{name}"}
    files = ((report_data(recipe_dir).get("vendored") or {}).get("files") or {}).values()
    stems |= {Path(f).stem for f in files if str(f).startswith("models/")}
    return stems


def _vendored_missing_facts(failure: Failure, found: re.Match) -> dict | None:
    if not (failure.recipe_dir / "models").is_dir():
        return None
    stem = found.group(1)
    if (failure.recipe_dir / "models" / f"{stem}.py").exists() or stem not in _vendored_stems(failure.recipe_dir):
        return None
    return {"file": f"models/{stem}.py"}


def _fix_vendored_missing(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    from agent.migrate.vendor import locate_source, read_config, vendor_source

    recipe_dir = failure.recipe_dir
    model_dir = checkpoint_dir(recipe_dir)
    if model_dir is None:
        return (f"{facts['file']} is missing and no checkpoint was found to re-vendor it from "
                "(neither the YAML model_path nor the report's model_dir holds a config.json)")
    source = locate_source(read_config(model_dir), model_dir, trust_remote_code=ctx.trust_remote_code)
    # Vendor aside and copy back only the missing file: the other vendored files may carry edits.
    with tempfile.TemporaryDirectory(prefix="revendor_") as tmp:
        result = vendor_source(source, Path(tmp), recipe_model_name(recipe_dir))
        fresh = Path(tmp) / facts["file"]
        if not fresh.is_file():
            written = ", ".join(str(p.relative_to(tmp)) for p in result.files.values())
            return f"re-vendoring {source.model_class} gives {written}, not {facts['file']}"
        (recipe_dir / facts["file"]).write_text(fresh.read_text())
    was = (report_data(recipe_dir).get("vendored") or {}).get("origin")
    drift = f" (first vendored from {was})" if was and was != source.origin else ""
    return f"re-vendored {facts['file']} ({source.model_class}) from {source.origin}{drift}"


# ---- a generated file is missing or corrupt -----------------------------------------------
_CANT_OPEN = re.compile(r"can't open file '(?P<path>[^']+)'")
_MODULE_MISSING = re.compile(r"No module named '(?P<module>[\w.]+)'")
_SYNTAX = re.compile(r"^(SyntaxError|IndentationError|TabError)\b")   # at the start of the error line
_GENERATED_PY = ("infer.py", "models/model_setting.py")


def _is_generated(recipe_dir: Path, rel: str, name: str) -> bool:
    rendered = report_data(recipe_dir).get("rendered")
    if rendered:
        return rel in rendered
    return rel in (*_GENERATED_PY, f"runner_{name}.py")


def _carries_header(recipe_dir: Path, rel: str) -> bool:
    """The file starts with the line the template writes (it was generated, then damaged)."""
    try:
        first = (recipe_dir / rel).read_text(errors="replace").splitlines()[:1]
        context, family = render_context(recipe_dir)
        return bool(first) and first == render_file(recipe_dir, rel, context, family).splitlines()[:1]
    except Exception:  # noqa: BLE001 - not renderable: not ours
        return False


def _generated_facts(failure: Failure, _found=None) -> dict | None:
    recipe_dir = failure.recipe_dir
    name = recipe_model_name(recipe_dir)
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
        truncated = _truncated_generated(recipe_dir, name)
        if truncated:
            return {"file": truncated, "state": "corrupt", "model_name": name}
    for rel, state in candidates:
        path = recipe_dir / rel
        if state == "missing" and not path.exists() and _is_generated(recipe_dir, rel, name):
            return {"file": rel, "state": "missing", "model_name": name}
        if state == "corrupt" and path.is_file() and rel.endswith(".py"):
            try:
                compile(path.read_text(), str(path), "exec")
                continue                       # it compiles: the SyntaxError is elsewhere
            except (SyntaxError, ValueError):
                pass
            if _is_generated(recipe_dir, rel, name) or _carries_header(recipe_dir, rel):
                return {"file": rel, "state": "corrupt", "model_name": name}
    return None


def _truncated_generated(recipe_dir: Path, name: str) -> str | None:
    """The generated file whose text is a strict prefix of what the templates give (a copy or a save
    interrupted halfway), if any."""
    try:
        context, family = render_context(recipe_dir, name)
        targets = generated_targets(name, family)
    except Exception:  # noqa: BLE001 - not one of our recipes, or not enough left to tell
        return None
    for rel in targets:
        path = recipe_dir / rel
        if not path.is_file() or not rel.endswith((".py", ".sh")):
            continue
        current = path.read_text(errors="replace")
        try:
            expected = render_file(recipe_dir, rel, context, family)
        except Exception:  # noqa: BLE001
            continue
        if current and current != expected and expected.startswith(current):
            return rel
    return None


def _fix_generated(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    recipe_dir = failure.recipe_dir
    context, family = render_context(recipe_dir, facts.get("model_name"), ctx.trust_remote_code)
    path = recipe_dir / facts["file"]
    old = path.read_text(errors="replace") if path.is_file() else None
    fresh = render_file(recipe_dir, facts["file"], context, family)
    write_rendered(recipe_dir, facts["file"], context, family)
    if old is None:
        return f"re-rendered the missing {facts['file']} from the templates"
    how = "a truncated copy of" if fresh.startswith(old.rstrip()) else "not a plain truncation of (edits in the backup)"
    return f"re-rendered {facts['file']} from the templates (it had a syntax error; it was {how} the template output)"


# ---- infer.py without a warm-up generation ------------------------------------------------
_NO_WARM_UP = re.compile(re.escape("BaselineError: infer.py ran without a warm-up generation"))


def _no_warm_up_facts(failure: Failure, found: re.Match) -> dict | None:
    import libcst as cst

    infer_py = failure.recipe_dir / "infer.py"
    if not infer_py.is_file():
        return None
    try:
        module = cst.parse_module(infer_py.read_text())
    except cst.ParserSyntaxError:
        return None
    calls = generate_calls(module)
    if any(warm_up_argument(c) for c in calls):
        return None          # a warm-up is there but did not run: not this rule's fix
    formal = next((c for c in calls if c.args), None)
    return {"file": "infer.py", "call": module.code_for_node(formal)} if formal is not None else None


def _fix_no_warm_up(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    context = CodemodContext()
    if not rewrite_file(failure.recipe_dir / facts["file"], [InsertWarmUpCommand], context=context):
        return f"{facts['file']}: no formal model_generate call to put a warm-up before"
    return f"{facts['file']}: inserted `{context.scratch['inserted']}` before the formal generation"


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
    own = {"infer"} | {p.stem for p in recipe_dir.glob("runner_*.py")}
    for stem in dict.fromkeys(stems):
        if stem not in own and (recipe_dir / f"{stem}.py").is_file() and _shadows(recipe_dir, stem):
            return {"file": f"{stem}.py", "module": stem}
    return None


def _fix_shadowing(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    path = failure.recipe_dir / facts["file"]
    aside = path.with_name(path.name + ".shadowing")
    path.rename(aside)
    return (f"renamed {facts['file']} to {aside.name}: on the recipe's sys.path it shadowed the "
            f"'{facts['module']}' module")


_OUT = ("output",)
RULES: list[Rule] = [
    Rule("models_init_shadows_package", _MODELS_INIT, "a models/__init__.py shadows the recipe's models package",
         _fix_models_init, facts=_models_init_facts, where=_OUT, kind="remove"),
    Rule("infer_sh_no_pythonpath", _TOP_MODULE_MISSING,
         "infer.sh does not put the recipe dir on PYTHONPATH, so the recipe's modules are not found",
         _fix_no_pythonpath, facts=_no_pythonpath_facts, where=_OUT, kind="infer.sh"),
    Rule("vendored_module_missing", _SUBMODULE_MISSING, "a vendored model source file is missing from models/",
         _fix_vendored_missing, facts=_vendored_missing_facts, where=_OUT, kind="rerender"),
    Rule("generated_file_missing_or_corrupt", None, "a file the migrator generated is missing or has a syntax error",
         _fix_generated, facts=_generated_facts, kind="rerender"),
    Rule("infer_py_without_warm_up", _NO_WARM_UP,
         "infer.py runs the formal generation without a warm-up generation first",
         _fix_no_warm_up, facts=_no_warm_up_facts, where=_OUT, kind="codemod"),
    Rule("recipe_file_shadows_stdlib_or_package", None,
         "a file in the recipe dir shadows a standard or installed module of the same name",
         _fix_shadowing, facts=_shadowing_facts, kind="remove"),
]
