"""Rules about code: vendored modeling, runner, imports, packages, devices.

Fixes patch the recipe's Python files with libcst codemods (agent.codemods.vendor, agent.codemods.device,
agent.codemods.repair), never by regenerating them; YAML fixes are line edits. A fix gets the full
failure and the facts; facts name the files and classes to patch.
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

from agent.codemods.vendor import RunnerSettingsInitCommand
from agent.codemods.device import GUARD_FLASH_ATTN, DeviceAgnosticCudaCommand, GuardOptionalImportCommand
from agent.codemods.repair import (AddForwardKwargsCommand, PadTokenFallbackCommand, TrustRemoteCodeCommand, codemod,
                                   rewrite_file)
from agent.failure import Failure
from agent.repair_rules._util import edit_yaml_line, load_yaml
from agent.repair_rules.rule import RepairContext, Rule

# Directories of a recipe that hold no recipe code.
_SKIP_DIRS = {".migrator", "res", "baseline", "__pycache__"}
GUARD_FLASH_ATTN_IMPORTS = codemod(GuardOptionalImportCommand, **GUARD_FLASH_ATTN)


# ---- helpers -----------------------------------------------------------------------------
def recipe_py_files(recipe_dir: Path) -> list[Path]:
    """The recipe's own Python files: models/*.py, runner_*.py, infer.py and other top-level code."""
    from agent.fs_guard import is_regular

    files = sorted(recipe_dir.glob("*.py")) + sorted((recipe_dir / "models").rglob("*.py"))
    return [p for p in files if not set(p.relative_to(recipe_dir).parts[:-1]) & _SKIP_DIRS and is_regular(p)]


def recipe_frames(failure: Failure) -> list[tuple[str, int]]:
    """(recipe-relative path, line) of the traceback frames inside the recipe, outermost first."""
    return failure.recipe_frames(frozenset(_SKIP_DIRS))


def _defining_file(recipe_dir: Path, class_name: str) -> Path | None:
    """The recipe file (models/ first, then the top level) with a module-level `class class_name`."""
    pattern = re.compile(rf"^class {re.escape(class_name)}\b", re.M)
    files = sorted((recipe_dir / "models").rglob("*.py")) + sorted(recipe_dir.glob("*.py"))
    return next((p for p in files if pattern.search(p.read_text(errors="replace"))), None)


def _rel(recipe_dir: Path, path: Path) -> str:
    return str(path.relative_to(recipe_dir))


# ---- 1. model __init__ without runner_settings ----------------------------------------------
_INIT_RUNNER_SETTINGS = re.compile(r"(\w+)\.__init__\(\) got an unexpected keyword argument 'runner_settings'")


def _runner_settings_facts(failure: Failure, found: re.Match) -> dict | None:
    path = _defining_file(failure.recipe_dir, found.group(1))
    if path is None or not rewrite_file(path, [RunnerSettingsInitCommand], dry_run=True):
        return None
    return {"class": found.group(1), "file": _rel(failure.recipe_dir, path)}


def _fix_runner_settings(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    rewrite_file(failure.recipe_dir / facts["file"], [RunnerSettingsInitCommand])
    return f"RunnerSettingsInitCommand on {facts['file']}: model __init__ accepts runner_settings=None, **kwargs"


# ---- 2. forward() without **kwargs -------------------------------------------------------
_FORWARD_KWARG = re.compile(r"(\w+)\.(forward)\(\) got an unexpected keyword argument '(\w+)'")


def _forward_kwarg_facts(failure: Failure, found: re.Match) -> dict | None:
    cls, method, kwarg = found.groups()
    path = _defining_file(failure.recipe_dir, cls)
    if path is None or not rewrite_file(path, [codemod(AddForwardKwargsCommand, class_name=cls, method=method)],
                                        dry_run=True):
        return None
    return {"class": cls, "method": method, "kwarg": kwarg, "file": _rel(failure.recipe_dir, path)}


def _fix_forward_kwarg(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    rewrite_file(failure.recipe_dir / facts["file"],
                 [codemod(AddForwardKwargsCommand, class_name=facts["class"], method=facts["method"])])
    return (f"added **kwargs to {facts['class']}.{facts['method']} in {facts['file']} "
            f"(it was called with {facts['kwarg']}=...)")


# ---- 3. flash_attn not installed ---------------------------------------------------------
_NO_FLASH_ATTN = re.compile(r"No module named '(flash_attn[\w.]*)'|package flash_attn seems to be not installed|"
                            r"FlashAttention2 has been toggled on, but it cannot be used")


def _flash_attn_facts(failure: Failure, found: re.Match) -> dict | None:
    files = [_rel(failure.recipe_dir, p) for p in recipe_py_files(failure.recipe_dir)
             if "flash_attn" in p.read_text(errors="replace")
             and rewrite_file(p, [GUARD_FLASH_ATTN_IMPORTS], dry_run=True)]
    attn = (load_yaml(failure.recipe_dir).get("model_config") or {}).get("attn_implementation")
    yaml_needs_change = isinstance(attn, str) and attn.startswith("flash_attention")
    if not files and not yaml_needs_change:
        return None
    return {"files": files, "attn_implementation": attn, "set_sdpa": yaml_needs_change}


def _fix_flash_attn(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    notes = []
    for rel in facts["files"]:
        rewrite_file(failure.recipe_dir / rel, [GUARD_FLASH_ATTN_IMPORTS])
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


def _missing_package_facts(failure: Failure, found: re.Match) -> dict | None:
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
_NO_CUDA = re.compile(
    r"Torch not compiled with CUDA enabled|Found no NVIDIA driver|No CUDA GPUs are available|"
    r"CUDA driver initialization failed|CUDA is not available|torch\.cuda\.is_available\(\) is False|"
    r"Expected all tensors to be on the same device|no CUDA-capable device|Invalid device string: 'cuda", re.I)


def _cuda_facts(failure: Failure, found: re.Match) -> dict | None:
    files = [_rel(failure.recipe_dir, p) for p in recipe_py_files(failure.recipe_dir)
             if "cuda" in p.read_text(errors="replace") and rewrite_file(p, [DeviceAgnosticCudaCommand], dry_run=True)]
    return {"files": files} if files else None


def _fix_cuda(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    for rel in facts["files"]:
        rewrite_file(failure.recipe_dir / rel, [DeviceAgnosticCudaCommand])
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


def _state_dict_facts(failure: Failure, found: re.Match) -> dict | None:
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
_REMOTE_CODE = re.compile(r"contains custom code which must be executed|requires you to execute the "
                          r"\w+ file in that repo")


def _remote_code_facts(failure: Failure, found: re.Match) -> dict | None:
    # The innermost frame in the recipe's own code whose line calls from_pretrained.
    for rel, line in reversed(recipe_frames(failure)):
        path = failure.recipe_dir / rel
        if rewrite_file(path, [codemod(TrustRemoteCodeCommand, line=line)], dry_run=True):
            return {"file": rel, "line": line}
    return None


def _fix_remote_code(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    if not ctx.trust_remote_code:
        return (f"{facts['file']}:{facts['line']} loads a checkpoint with custom code: re-run with "
                f"--trust-remote-code after reviewing the code; nothing changed")
    rewrite_file(failure.recipe_dir / facts["file"], [codemod(TrustRemoteCodeCommand, line=facts["line"])])
    return f"added trust_remote_code=True to the from_pretrained call at {facts['file']}:{facts['line']}"


# ---- 8. tokenizer without pad token ------------------------------------------------------
_NO_PAD = re.compile(r"Asking to pad but the tokenizer does not have a padding token")


def _pad_token_facts(failure: Failure, found: re.Match) -> dict | None:
    recipe = failure.recipe_dir
    candidates = sorted(recipe.glob("runner_*.py")) + sorted(recipe.glob("*.py"))
    files = [_rel(recipe, p) for p in dict.fromkeys(candidates)
             if "from_pretrained" in p.read_text(errors="replace") and rewrite_file(p, [PadTokenFallbackCommand],
                                                                                   dry_run=True)]
    return {"files": files} if files else None


def _fix_pad_token(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    for rel in facts["files"]:
        rewrite_file(failure.recipe_dir / rel, [PadTokenFallbackCommand])
    return f"pad token falls back to EOS after the tokenizer is loaded in {', '.join(facts['files'])}"


RULES: list[Rule] = [
    Rule("constructor_without_runner_settings", _INIT_RUNNER_SETTINGS,
         "a vendored model __init__ does not accept the runner_settings the engine passes",
         _fix_runner_settings, facts=_runner_settings_facts, kind="codemod"),
    Rule("forward_unexpected_keyword", _FORWARD_KWARG,
         "a model forward() gets a keyword argument its signature does not accept",
         _fix_forward_kwarg, facts=_forward_kwarg_facts, kind="codemod"),
    # Before missing_pip_package: flash_attn is optional, not a package to install.
    Rule("flash_attn_not_installed", _NO_FLASH_ATTN, "recipe code needs flash_attn, which is not installed",
         _fix_flash_attn, facts=_flash_attn_facts, kind="codemod"),
    Rule("missing_pip_package", _NO_MODULE,
         "a Python package the recipe imports is not installed (install it, or re-run with --allow-install)",
         _fix_missing_package, facts=_missing_package_facts, where=("error",), kind="report"),
    Rule("hardcoded_cuda_device", _NO_CUDA, "recipe code hard-codes CUDA, which this device does not have",
         _fix_cuda, facts=_cuda_facts, kind="codemod"),
    Rule("state_dict_key_mismatch", _STATE_DICT, "checkpoint weights are named differently from the model's parameters",
         _fix_state_dict, facts=_state_dict_facts, kind="yaml"),
    Rule("remote_code_needs_trust", _REMOTE_CODE,
         "a from_pretrained call loads a checkpoint with custom code (re-run with --trust-remote-code "
         "after reviewing the code)",
         _fix_remote_code, facts=_remote_code_facts, kind="codemod"),
    Rule("tokenizer_without_pad_token", _NO_PAD, "the tokenizer has no padding token but the batch needs padding",
         _fix_pad_token, facts=_pad_token_facts, kind="codemod"),
]
