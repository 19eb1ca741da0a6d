"""Rules about code: vendored modeling, runner, imports, packages, devices.

Fixes patch the recipe's Python files with the libcst codemods below (or those of
agent.codemods), never by regenerating them; YAML fixes are line edits. A fix only gets
`failure.error` / `failure.location` and the matcher's facts, so matchers put everything the
fix needs into the facts.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import PositionProvider

from agent.codemods import RunnerSettingsInitCommand, _insert_param, _is_model_class, _param_names
from agent.repair import Failure, RepairContext, Rule
from agent.repair_rules._util import edit_yaml_line, load_yaml

# Directories of a recipe that hold no recipe code.
_SKIP_DIRS = {".migrator", "res", "baseline", "__pycache__"}


# ---- helpers -----------------------------------------------------------------------------
def recipe_py_files(recipe_dir: Path) -> list[Path]:
    """The recipe's own Python files: models/*.py, runner_*.py, infer.py and other top-level code."""
    files = sorted(recipe_dir.glob("*.py")) + sorted((recipe_dir / "models").rglob("*.py"))
    return [p for p in files if not set(p.relative_to(recipe_dir).parts[:-1]) & _SKIP_DIRS]


def recipe_frames(failure: Failure) -> list[tuple[str, int]]:
    """(recipe-relative path, line) of the traceback frames inside the recipe, outermost first."""
    root = failure.recipe_dir.resolve()
    frames = []
    for file, line in re.findall(r'File "([^"]+)", line (\d+)', failure.output):
        try:
            rel = Path(file).resolve().relative_to(root)
        except ValueError:
            continue
        if rel.suffix == ".py" and not set(rel.parts) & _SKIP_DIRS and (root / rel).is_file():
            frames.append((str(rel), int(line)))
    return frames


def _run_codemod(command: type[VisitorBasedCodemodCommand], source: str, **kwargs) -> str:
    tree = cst.parse_module(source)
    return command(CodemodContext(), **kwargs).transform_module(tree).code


def apply_codemod(path: Path, command: type[VisitorBasedCodemodCommand], dry_run: bool = False, **kwargs) -> bool:
    """Run one codemod on a file; write it back when it changed (unless dry_run). True if changed."""
    source = path.read_text()
    try:
        new = _run_codemod(command, source, **kwargs)
    except cst.ParserSyntaxError:
        return False
    if new == source:
        return False
    if not dry_run:
        path.write_text(new)
    return True


def _defining_file(recipe_dir: Path, class_name: str) -> Path | None:
    """The recipe file (models/ first, then the top level) with a module-level `class class_name`."""
    pattern = re.compile(rf"^class {re.escape(class_name)}\b", re.M)
    files = sorted((recipe_dir / "models").rglob("*.py")) + sorted(recipe_dir.glob("*.py"))
    return next((p for p in files if pattern.search(p.read_text(errors="replace"))), None)


def _rel(recipe_dir: Path, path: Path) -> str:
    return str(path.relative_to(recipe_dir))


def _dotted(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_dotted(node.value)}.{node.attr.value}"
    return ""


# ---- 1. model __init__ without runner_settings ----------------------------------------------
_INIT_RUNNER_SETTINGS = re.compile(r"(\w+)\.__init__\(\) got an unexpected keyword argument 'runner_settings'")


def _match_runner_settings(failure: Failure) -> dict | None:
    found = _INIT_RUNNER_SETTINGS.search(failure.error) or _INIT_RUNNER_SETTINGS.search(failure.output)
    if not found:
        return None
    path = _defining_file(failure.recipe_dir, found.group(1))
    if path is None or not apply_codemod(path, RunnerSettingsInitCommand, dry_run=True):
        return None
    return {"class": found.group(1), "file": _rel(failure.recipe_dir, path)}


def _fix_runner_settings(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    apply_codemod(failure.recipe_dir / facts["file"], RunnerSettingsInitCommand)
    return f"RunnerSettingsInitCommand on {facts['file']}: model __init__ accepts runner_settings=None, **kwargs"


# ---- 2. forward() without **kwargs -------------------------------------------------------
class AddForwardKwargsCommand(VisitorBasedCodemodCommand):
    DESCRIPTION = "Let one class's forward() accept (and ignore) extra keyword arguments: add **kwargs."

    def __init__(self, context: CodemodContext, class_name: str, method: str = "forward"):
        super().__init__(context)
        self.class_name, self.method = class_name, method
        self._depth = 0

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self._depth += 1
        return self._depth == 1 and node.name.value == self.class_name

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        self._depth -= 1
        return updated_node

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False  # only the method's signature changes

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.FunctionDef:
        if updated_node.name.value != self.method or updated_node.params.star_kwarg is not None:
            return updated_node
        if not _param_names(updated_node.params)[:1] == ["self"]:
            return updated_node
        kwargs = cst.Param(name=cst.Name("kwargs"), star="**")
        return updated_node.with_changes(params=_insert_param(updated_node.params, "star_kwarg", kwargs))


_FORWARD_KWARG = re.compile(r"(\w+)\.(forward)\(\) got an unexpected keyword argument '(\w+)'")


def _match_forward_kwarg(failure: Failure) -> dict | None:
    found = _FORWARD_KWARG.search(failure.error) or _FORWARD_KWARG.search(failure.output)
    if not found:
        return None
    cls, method, kwarg = found.groups()
    path = _defining_file(failure.recipe_dir, cls)
    if path is None or not apply_codemod(path, AddForwardKwargsCommand, dry_run=True, class_name=cls, method=method):
        return None
    return {"class": cls, "method": method, "kwarg": kwarg, "file": _rel(failure.recipe_dir, path)}


def _fix_forward_kwarg(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    apply_codemod(failure.recipe_dir / facts["file"], AddForwardKwargsCommand, class_name=facts["class"],
                  method=facts["method"])
    return (f"added **kwargs to {facts['class']}.{facts['method']} in {facts['file']} "
            f"(it was called with {facts['kwarg']}=...)")


# ---- 3. flash_attn not installed ---------------------------------------------------------
def _is_flash_attn(module: str) -> bool:
    return module.split(".")[0] == "flash_attn"


def _bound_names(stmt: cst.Import | cst.ImportFrom) -> list[str] | None:
    """Names an import binds (None for `from x import *`)."""
    if isinstance(stmt, cst.ImportFrom):
        if isinstance(stmt.names, cst.ImportStar):
            return None
        return [(a.asname.name.value if a.asname else _dotted(a.name)) for a in stmt.names]
    return [(a.asname.name.value if a.asname else _dotted(a.name).split(".")[0]) for a in stmt.names]


def _flash_import(stmt: cst.BaseSmallStatement) -> bool:
    if isinstance(stmt, cst.ImportFrom) and not stmt.relative and stmt.module is not None:
        return _is_flash_attn(_dotted(stmt.module))
    if isinstance(stmt, cst.Import):
        return any(_is_flash_attn(_dotted(a.name)) for a in stmt.names)
    return False


class GuardFlashAttnImportCommand(VisitorBasedCodemodCommand):
    DESCRIPTION = "Guard unguarded flash_attn imports: try/except ImportError binding the names to None."

    def __init__(self, context: CodemodContext):
        super().__init__(context)
        self._in_try = 0
        self._module: cst.Module | None = None

    def visit_Module(self, node: cst.Module) -> None:
        self._module = node

    def visit_Try(self, node: cst.Try) -> None:
        self._in_try += 1

    def leave_Try(self, original_node: cst.Try, updated_node: cst.Try) -> cst.Try:
        self._in_try -= 1
        return updated_node

    def leave_SimpleStatementLine(self, original_node, updated_node):
        if self._in_try or not any(_flash_import(s) for s in updated_node.body):
            return updated_node
        if len(updated_node.body) != 1:
            self.warn("flash_attn import shares a line with other statements: left as is")
            return updated_node
        names = _bound_names(updated_node.body[0])
        if not names:
            self.warn("`from flash_attn... import *` cannot be guarded: left as is")
            return updated_node
        module = self._module
        indent, newline = module.default_indent, module.default_newline
        import_line = cst.Module(body=[updated_node.with_changes(leading_lines=[])]).code.rstrip("\r\n")
        code = (f"try:{newline}{indent}{import_line}{newline}"
                f"except ImportError:  # flash_attn is optional: use another attn_implementation{newline}"
                f"{indent}{' = '.join(dict.fromkeys(names))} = None{newline}")
        guarded = cst.parse_statement(code, config=module.config_for_parsing)
        return guarded.with_changes(leading_lines=updated_node.leading_lines)


_NO_FLASH_ATTN = re.compile(r"No module named '(flash_attn[\w.]*)'|package flash_attn seems to be not installed|"
                            r"FlashAttention2 has been toggled on, but it cannot be used")


def _match_flash_attn(failure: Failure) -> dict | None:
    if not (_NO_FLASH_ATTN.search(failure.error) or _NO_FLASH_ATTN.search(failure.output)):
        return None
    files = [_rel(failure.recipe_dir, p) for p in recipe_py_files(failure.recipe_dir)
             if "flash_attn" in p.read_text(errors="replace")
             and apply_codemod(p, GuardFlashAttnImportCommand, dry_run=True)]
    attn = (load_yaml(failure.recipe_dir).get("model_config") or {}).get("attn_implementation")
    yaml_needs_change = isinstance(attn, str) and attn.startswith("flash_attention")
    if not files and not yaml_needs_change:
        return None
    return {"files": files, "attn_implementation": attn, "set_sdpa": yaml_needs_change}


def _fix_flash_attn(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    notes = []
    for rel in facts["files"]:
        apply_codemod(failure.recipe_dir / rel, GuardFlashAttnImportCommand)
        notes.append(f"guarded flash_attn imports in {rel}")
    if facts.get("set_sdpa"):
        notes.append(edit_yaml_line(failure.recipe_dir, "model_config", "attn_implementation", "sdpa"))
    return "; ".join(notes)


# ---- 4. missing pip package --------------------------------------------------------------
# import name -> distribution name on PyPI, where they differ (or are often confused).
IMPORT_TO_DIST = {
    "yaml": "pyyaml", "sklearn": "scikit-learn", "PIL": "pillow", "cv2": "opencv-python",
    "google.protobuf": "protobuf", "skimage": "scikit-image", "bs4": "beautifulsoup4",
    "attr": "attrs", "dateutil": "python-dateutil", "Crypto": "pycryptodome", "jwt": "PyJWT",
    "dotenv": "python-dotenv", "fitz": "PyMuPDF", "docx": "python-docx", "Levenshtein": "levenshtein",
    "sentencepiece": "sentencepiece", "einops": "einops", "tiktoken": "tiktoken", "timm": "timm",
    "flash_attn": "flash-attn", "jieba": "jieba", "tokenizers": "tokenizers", "safetensors": "safetensors",
    "accelerate": "accelerate", "scipy": "scipy", "numpy": "numpy", "pandas": "pandas",
    "transformers_stream_generator": "transformers-stream-generator", "triton": "triton",
    "torchvision": "torchvision", "torchaudio": "torchaudio", "soundfile": "soundfile",
    "librosa": "librosa", "decord": "decord", "av": "av", "msgpack": "msgpack", "regex": "regex",
    "blobfile": "blobfile", "zmq": "pyzmq", "google.generativeai": "google-generativeai",
}
_NO_MODULE = re.compile(r"No module named '([\w.]+)'")
_RECIPE_MODULES = {"models", "engine", "agent"}    # the recipe's own and infer-migrator's packages


def pip_distribution(module: str) -> str:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        dist = IMPORT_TO_DIST.get(".".join(parts[:i]))
        if dist:
            return dist
    return parts[0]


def install_command(dist: str) -> str:
    return f"{sys.executable} -m pip install {shlex.quote(dist)}"


def _match_missing_package(failure: Failure) -> dict | None:
    found = _NO_MODULE.search(failure.error) if "No module named" in failure.error else None
    if not found:
        return None
    module = found.group(1)
    top = module.split(".")[0]
    recipe = failure.recipe_dir
    if top in _RECIPE_MODULES or top.startswith("runner_") or (recipe / f"{top}.py").exists() \
            or (recipe / top).is_dir():
        return None           # a recipe-local module: a layout problem, not a package to install
    if importlib.util.find_spec(top) is not None:
        return None           # the package is there, a submodule is not: a version problem
    dist = pip_distribution(module)
    return {"module": module, "distribution": dist, "install": install_command(dist)}


def _fix_missing_package(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    if not ctx.allow_install:
        return (f"module {facts['module']} is not installed; install it with `{facts['install']}` "
                f"(or re-run with --allow-install); nothing changed")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", facts["distribution"]],
                          capture_output=True, text=True, timeout=ctx.timeout_s)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["no output"])[-1]
        return f"`{facts['install']}` failed: {tail}"
    # The recipe records its dependencies: add the distribution to requirements.txt.
    requirements = failure.recipe_dir / "requirements.txt"
    listed = requirements.read_text() if requirements.is_file() else ""
    names = {re.split(r"[<>=!~\[;\s]", ln.strip(), maxsplit=1)[0].lower().replace("_", "-")
             for ln in listed.splitlines() if ln.strip() and not ln.lstrip().startswith("#")}
    if facts["distribution"].lower().replace("_", "-") not in names:
        requirements.write_text(listed + ("" if not listed or listed.endswith("\n") else "\n")
                                + f"{facts['distribution']}\n")
    return f"ran `{facts['install']}`; added {facts['distribution']} to requirements.txt"


# ---- 5. hard-coded CUDA ------------------------------------------------------------------
_DEVICE_HELPER = '''

@functools.lru_cache(maxsize=None)
def _recipe_device():
    """The device this recipe runs on (replaces hard-coded CUDA; RECIPE_DEVICE overrides)."""
    from engine.environment import select_device

    return select_device(os.environ.get("RECIPE_DEVICE", "auto"))
'''
_SYNC_HELPER = '''

def _recipe_synchronize():
    """Wait for the recipe device's queued work (replaces torch.cuda.synchronize())."""
    from engine.environment import synchronize

    synchronize(_recipe_device())
'''
_CUDA_STRING = re.compile(r"""^[rbuRBU]?(['"])cuda(:\d+)?\1$""")
_TORCH_CUDA = m.Attribute(value=m.Name("torch"), attr=m.Name("cuda"))


def _is_cuda_string(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.SimpleString) and bool(_CUDA_STRING.match(node.value))


class DeviceAgnosticCudaCommand(VisitorBasedCodemodCommand):
    DESCRIPTION = "Replace hard-coded CUDA (.cuda(), \"cuda\" devices, torch.cuda.synchronize) with the recipe device."

    def __init__(self, context: CodemodContext):
        super().__init__(context)
        self._classes: list[cst.ClassDef] = []
        self._functions: list[cst.FunctionDef] = []
        self._needs_device = self._needs_sync = False

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._classes.append(node)

    def leave_ClassDef(self, original_node, updated_node):
        self._classes.pop()
        return updated_node

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._functions.append(node)

    def leave_FunctionDef(self, original_node, updated_node):
        self._functions.pop()
        return updated_node

    def _device(self) -> cst.BaseExpression:
        """`self.device` in a model's method, the tensor's device when a hidden_states argument is
        in scope, else the module-level `_recipe_device()` helper."""
        func = self._functions[-1] if self._functions else None
        params = _param_names(func.params) if func is not None else []
        if func is not None and params[:1] == ["self"] and len(self._classes) == 1 \
                and len(self._functions) == 1 and _is_model_class(self._classes[0]):
            return cst.parse_expression("self.device")
        if func is not None and "hidden_states" in params:
            return cst.parse_expression("hidden_states.device")
        self._needs_device = True
        return cst.parse_expression("_recipe_device()")

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        func = updated_node.func
        if m.matches(func, m.Attribute(value=_TORCH_CUDA, attr=m.Name("synchronize"))):
            self._needs_sync = True
            return cst.parse_expression("_recipe_synchronize()")
        if m.matches(func, m.Attribute(value=_TORCH_CUDA, attr=m.Name("current_device"))):
            return self._device()
        if m.matches(func, m.Attribute(value=m.Name("torch"), attr=m.Name("device"))) and updated_node.args \
                and _is_cuda_string(updated_node.args[0].value):
            return self._device()
        if isinstance(func, cst.Attribute) and func.attr.value == "cuda" and not m.matches(func.value, m.Name("torch")):
            # x.cuda(), x.cuda(0), x.cuda(non_blocking=True) -> x.to(<device>[, non_blocking=...])
            keep = [a for a in updated_node.args if a.keyword is not None and a.keyword.value == "non_blocking"]
            args = [cst.Arg(self._device())]
            if keep:
                args[0] = args[0].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
                args.append(keep[0].with_changes(comma=cst.MaybeSentinel.DEFAULT))
            return updated_node.with_changes(func=func.with_changes(attr=cst.Name("to")), args=args)
        if isinstance(func, cst.Attribute) and func.attr.value == "to" and updated_node.args \
                and updated_node.args[0].keyword is None and _is_cuda_string(updated_node.args[0].value):
            args = list(updated_node.args)
            args[0] = args[0].with_changes(value=self._device())
            return updated_node.with_changes(args=args)
        return updated_node

    def leave_Arg(self, original_node: cst.Arg, updated_node: cst.Arg) -> cst.Arg:
        if updated_node.keyword is not None and updated_node.keyword.value == "device" \
                and _is_cuda_string(updated_node.value):
            return updated_node.with_changes(value=self._device())
        return updated_node

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        code = updated_node.code
        helpers = ""
        if (self._needs_device or self._needs_sync) and "def _recipe_device(" not in code:
            helpers += _DEVICE_HELPER
            AddImportsVisitor.add_needed_import(self.context, "functools")
            AddImportsVisitor.add_needed_import(self.context, "os")
        if self._needs_sync and "def _recipe_synchronize(" not in code:
            helpers += _SYNC_HELPER
        if not helpers:
            return updated_node
        new = list(cst.parse_module(helpers.lstrip("\n"), config=updated_node.config_for_parsing).body)
        new[0] = new[0].with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
        body = list(updated_node.body)
        # Before the first module-level class/function, i.e. after imports and constants.
        index = next((i for i, s in enumerate(body) if isinstance(s, (cst.ClassDef, cst.FunctionDef))), len(body))
        if index < len(body):
            body[index] = body[index].with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
        body[index:index] = new
        return updated_node.with_changes(body=body)


_NO_CUDA = re.compile(
    r"Torch not compiled with CUDA enabled|Found no NVIDIA driver|No CUDA GPUs are available|"
    r"CUDA driver initialization failed|CUDA is not available|torch\.cuda\.is_available\(\) is False|"
    r"Expected all tensors to be on the same device|no CUDA-capable device|Invalid device string: 'cuda", re.I)


def _match_cuda(failure: Failure) -> dict | None:
    if not (_NO_CUDA.search(failure.error) or _NO_CUDA.search(failure.output)):
        return None
    files = [_rel(failure.recipe_dir, p) for p in recipe_py_files(failure.recipe_dir)
             if "cuda" in p.read_text(errors="replace") and apply_codemod(p, DeviceAgnosticCudaCommand, dry_run=True)]
    return {"files": files} if files else None


def _fix_cuda(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    for rel in facts["files"]:
        apply_codemod(failure.recipe_dir / rel, DeviceAgnosticCudaCommand)
    return f"DeviceAgnosticCudaCommand on {', '.join(facts['files'])}: hard-coded CUDA replaced by the recipe device"


# ---- 6. state dict key mismatch ----------------------------------------------------------
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
        return set(json.loads(index.read_text()).get("weight_map", {}))
    keys: set[str] = set()
    for shard in model_path.glob("*.safetensors"):
        with open(shard, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            keys |= set(json.loads(f.read(size))) - {"__metadata__"}
    return keys


def _match_state_dict(failure: Failure) -> dict | None:
    found = _STATE_DICT.search(failure.error) or _STATE_DICT.search(failure.output)
    if not found:
        return None
    missing, unexpected = _key_list(found["missing"]), _key_list(found["unexpected"])
    if _key_list(found["shapes"]):
        return None                       # shapes differ: a config problem, not naming
    model_config = load_yaml(failure.recipe_dir).get("model_config") or {}
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
        return edit_yaml_line(failure.recipe_dir, "model_config", "config_overrides", facts["config_overrides"])
    return edit_yaml_line(failure.recipe_dir, "model_config", "key_mapping", facts["key_mapping"])


# ---- 7. remote code needs trust_remote_code -----------------------------------------------
class TrustRemoteCodeCommand(VisitorBasedCodemodCommand):
    DESCRIPTION = "Pass trust_remote_code=True to the from_pretrained(...) call on a given line."

    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, context: CodemodContext, line: int):
        super().__init__(context)
        self.line = line
        self._target: cst.Call | None = None

    def visit_Call(self, node: cst.Call) -> None:
        if not m.matches(node.func, m.Attribute(attr=m.Name("from_pretrained"))):
            return
        pos = self.get_metadata(PositionProvider, node)
        if pos.start.line <= self.line <= pos.end.line:
            self._target = node       # visited outer -> inner: the innermost call wins

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if original_node is not self._target:
            return updated_node
        args = list(updated_node.args)
        for i, arg in enumerate(args):
            if arg.keyword is not None and arg.keyword.value == "trust_remote_code":
                args[i] = arg.with_changes(value=cst.Name("True"))
                return updated_node.with_changes(args=args)
        new = cst.Arg(keyword=cst.Name("trust_remote_code"), value=cst.Name("True"),
                      equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                            whitespace_after=cst.SimpleWhitespace("")))
        if args:
            last = args[-1]
            sep = next((a.comma for a in reversed(args[:-1]) if isinstance(a.comma, cst.Comma)),
                       cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            new = new.with_changes(comma=last.comma)   # a trailing comma / newline stays at the end
            args[-1] = last.with_changes(comma=sep)
        return updated_node.with_changes(args=[*args, new])


_REMOTE_CODE = re.compile(r"contains custom code which must be executed|requires you to execute the "
                          r"\w+ file in that repo")


def _match_remote_code(failure: Failure) -> dict | None:
    if not (_REMOTE_CODE.search(failure.error) or _REMOTE_CODE.search(failure.output)):
        return None
    # The innermost frame in the recipe's own code whose line calls from_pretrained.
    for rel, line in reversed(recipe_frames(failure)):
        path = failure.recipe_dir / rel
        if apply_codemod(path, TrustRemoteCodeCommand, dry_run=True, line=line):
            return {"file": rel, "line": line}
    return None


def _fix_remote_code(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    if not ctx.trust_remote_code:
        return (f"{facts['file']}:{facts['line']} loads a checkpoint with custom code: re-run with "
                f"--trust-remote-code after reviewing the code; nothing changed")
    apply_codemod(failure.recipe_dir / facts["file"], TrustRemoteCodeCommand, line=facts["line"])
    return f"added trust_remote_code=True to the from_pretrained call at {facts['file']}:{facts['line']}"


# ---- 8. tokenizer without pad token ------------------------------------------------------
def _tokenizer_load(stmt: cst.BaseStatement) -> cst.BaseAssignTargetExpression | None:
    """`<target> = <...Tokenizer...>.from_pretrained(...)` -> target."""
    if not m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget()], value=m.Call(
            func=m.Attribute(attr=m.Name("from_pretrained"))))])):
        return None
    assign = stmt.body[0]
    owner = _dotted(assign.value.func.value)
    return assign.targets[0].target if "Tokenizer" in owner else None


def _pad_fallback_of(stmt: cst.BaseStatement, target_code: str) -> bool:
    return isinstance(stmt, cst.If) and f"{target_code}.pad_token" in cst.Module(body=[stmt]).code


class PadTokenFallbackCommand(VisitorBasedCodemodCommand):
    DESCRIPTION = "After a tokenizer is loaded with from_pretrained, fall back to EOS as its pad token."

    def __init__(self, context: CodemodContext):
        super().__init__(context)
        self._module: cst.Module | None = None

    def visit_Module(self, node: cst.Module) -> None:
        self._module = node

    def _patch(self, body: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        out: list[cst.BaseStatement] = []
        for i, stmt in enumerate(body):
            out.append(stmt)
            target = _tokenizer_load(stmt)
            if target is None:
                continue
            name = cst.Module(body=[]).code_for_node(target)
            if i + 1 < len(body) and _pad_fallback_of(body[i + 1], name):
                continue
            module = self._module
            out.append(cst.parse_statement(
                f"if {name}.pad_token is None:  # batches need padding: pad with EOS (masked out){module.default_newline}"
                f"{module.default_indent}{name}.pad_token = {name}.eos_token{module.default_newline}",
                config=module.config_for_parsing))
        return out

    def leave_IndentedBlock(self, original_node, updated_node):
        body = self._patch(list(updated_node.body))
        return updated_node.with_changes(body=body) if len(body) != len(updated_node.body) else updated_node

    def leave_Module(self, original_node, updated_node):
        body = self._patch(list(updated_node.body))
        return updated_node.with_changes(body=body) if len(body) != len(updated_node.body) else updated_node


_NO_PAD = re.compile(r"Asking to pad but the tokenizer does not have a padding token")


def _match_pad_token(failure: Failure) -> dict | None:
    if not (_NO_PAD.search(failure.error) or _NO_PAD.search(failure.output)):
        return None
    recipe = failure.recipe_dir
    candidates = sorted(recipe.glob("runner_*.py")) + sorted(recipe.glob("*.py"))
    files = [_rel(recipe, p) for p in dict.fromkeys(candidates)
             if "from_pretrained" in p.read_text(errors="replace") and apply_codemod(p, PadTokenFallbackCommand,
                                                                                    dry_run=True)]
    return {"files": files} if files else None


def _fix_pad_token(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    for rel in facts["files"]:
        apply_codemod(failure.recipe_dir / rel, PadTokenFallbackCommand)
    return f"pad token falls back to EOS after the tokenizer is loaded in {', '.join(facts['files'])}"


RULES: list[Rule] = [
    Rule("constructor_without_runner_settings",
         "a vendored model __init__ does not accept the runner_settings the engine passes",
         _match_runner_settings, _fix_runner_settings, kind="codemod"),
    Rule("forward_unexpected_keyword",
         "a model forward() gets a keyword argument its signature does not accept",
         _match_forward_kwarg, _fix_forward_kwarg, kind="codemod"),
    # Before missing_pip_package: flash_attn is optional, not a package to install.
    Rule("flash_attn_not_installed",
         "recipe code needs flash_attn, which is not installed",
         _match_flash_attn, _fix_flash_attn, kind="codemod"),
    Rule("missing_pip_package",
         "a Python package the recipe imports is not installed (install it, or re-run with --allow-install)",
         _match_missing_package, _fix_missing_package, kind="report"),
    Rule("hardcoded_cuda_device",
         "recipe code hard-codes CUDA, which this device does not have",
         _match_cuda, _fix_cuda, kind="codemod"),
    Rule("state_dict_key_mismatch",
         "checkpoint weights are named differently from the model's parameters",
         _match_state_dict, _fix_state_dict, kind="yaml"),
    Rule("remote_code_needs_trust",
         "a from_pretrained call loads a checkpoint with custom code (re-run with --trust-remote-code "
         "after reviewing the code)",
         _match_remote_code, _fix_remote_code, kind="codemod"),
    Rule("tokenizer_without_pad_token",
         "the tokenizer has no padding token but the batch needs padding",
         _match_pad_token, _fix_pad_token, kind="codemod"),
]
