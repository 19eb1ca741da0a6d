"""What a folder is: a checkpoint, a recipe with its own infer.sh, or a framework-mode recipe.

- **checkpoint** (scenario A): ``config.json`` plus weights (``*.safetensors`` / ``*.bin``), even
  when it also holds an ``infer.sh``; nothing inside a checkpoint is ever executed or written.
- **legacy** recipe: a folder with its own ``infer.sh`` (this tool's recipes, and cann-recipes-infer's
  ``ModelRunner`` recipes whose ``infer.sh`` sources ``executor/scripts/function.sh``).
- **framework** recipe: a ``models/NAME`` folder with ``config/*.yaml`` inside a repository whose
  shared entry point runs it: ``executor/scripts/infer.sh --model NAME --yaml FILE`` (relative to
  the repository root, found by walking up from the folder).

Paths are resolved first (relative, ``.``, symlinked folders), so what runs never depends on the
caller's working directory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ENTRY = Path("executor") / "scripts" / "infer.sh"
WEIGHT_GLOBS = ("*.safetensors", "*.bin")


@dataclass
class RecipeInfo:
    kind: str                          # "checkpoint" | "legacy" | "framework" | "none"
    path: Path                         # the resolved folder
    repo_root: Path | None = None      # repository holding executor/scripts/infer.sh, if any
    yaml: Path | None = None           # the YAML the run uses
    reason: str = ""
    entry_files: list[Path] = field(default_factory=list)   # shared files the entry runs

    @property
    def is_recipe(self) -> bool:
        return self.kind in ("legacy", "framework")

    @property
    def model_name(self) -> str:
        return self.path.name

    def command(self) -> list[str]:
        """The command that runs the recipe (absolute paths)."""
        if self.kind == "legacy":
            return ["bash", str(self.path / "infer.sh")]
        if self.kind == "framework":
            rel = self.yaml.relative_to(self.path / "config").as_posix()
            return ["bash", str(self.repo_root / ENTRY), "--model", self.path.name, "--yaml", rel]
        raise ValueError(f"{self.path} is not a recipe")

    def baseline_dir(self) -> Path:
        """Where the baseline goes: the repository's convention (agentic/baseline/) when it has one."""
        if (self.path / "agentic" / "baseline").is_dir() or (self.path / "agentic").is_dir():
            return self.path / "agentic" / "baseline"
        return self.path / "baseline"


def is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and any(
        p.is_file() for pattern in WEIGHT_GLOBS for p in path.glob(pattern))


def find_repo_root(path: Path) -> Path | None:
    """The nearest folder at or above `path` with executor/scripts/infer.sh."""
    for parent in (path, *path.parents):
        if (parent / ENTRY).is_file():
            return parent
    return None


_YAML_ASSIGN_RE = re.compile(
    r"""^\s*(?:export\s+)?(?:YAML_FILE_NAME|YAML_FILE|YAML_NAME|YAML)=["']?(?:\$\{\w+:-)?"""
    r"""(?P<value>[^"'\s}]+\.ya?ml)""", re.M)
_YAML_ARG_RE = re.compile(r"""(?:--yaml(?:_file_path|-file)?[= ]|\$\{2:-)["']?(?P<value>[^"'\s}]+\.ya?ml)""")


def _yaml_settings(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8", errors="replace")) or {}
    except Exception:
        return {}
    return data if isinstance(data, dict) else {}


def _world_size(data: dict) -> int | None:
    parallel = data.get("parallel_config") if isinstance(data.get("parallel_config"), dict) else {}
    value = parallel.get("world_size", data.get("world_size"))
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def choose_yaml(recipe_dir: Path) -> Path | None:
    """The YAML a run uses: the one infer.sh names, else a single-card one, else the first."""
    infer_sh = recipe_dir / "infer.sh"
    if infer_sh.is_file():
        text = infer_sh.read_text(errors="replace")
        for rx in (_YAML_ASSIGN_RE, _YAML_ARG_RE):
            for found in rx.finditer(text):
                value = found.group("value").replace("${SCRIPT_PATH}/", "").replace("${SCRIPT_DIR}/", "")
                for candidate in (recipe_dir / value, recipe_dir / "config" / value):
                    if "$" not in value and candidate.is_file():
                        return candidate
    config = recipe_dir / "config"
    yamls = sorted(p for p in config.rglob("*.y*ml") if p.is_file()) if config.is_dir() else []
    if not yamls:
        return None
    top = [p for p in yamls if p.parent == config] or yamls
    single = [p for p in top if _world_size(_yaml_settings(p)) in (1, None)]
    return (single or top)[0]


def describe(path: str | Path) -> RecipeInfo:
    """Classify a folder (see the module docs). Never runs or writes anything."""
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        return RecipeInfo("none", folder, reason="not a directory")
    repo_root = find_repo_root(folder)
    if is_checkpoint(folder):
        return RecipeInfo("checkpoint", folder, repo_root,
                          reason="config.json and weights: a checkpoint (nothing inside it is run)")
    if (folder / "infer.sh").is_file():
        return RecipeInfo("legacy", folder, repo_root, choose_yaml(folder), "infer.sh present")
    if repo_root is not None and folder.parent == repo_root / "models":
        yaml_path = choose_yaml(folder)
        if yaml_path is not None:
            entries = [p for p in (folder / "infer.py", repo_root / "executor" / "offline" / "infer.py",
                                   repo_root / "executor" / "infer.py") if p.is_file()][:1]
            return RecipeInfo("framework", folder, repo_root, yaml_path,
                              f"framework recipe run by {ENTRY.as_posix()} --model {folder.name} "
                              f"--yaml {yaml_path.relative_to(folder / 'config').as_posix()}",
                              entry_files=[p for p in entries if folder not in p.parents])
    return RecipeInfo("none", folder, repo_root, reason="no infer.sh and no repository entry point runs it")

