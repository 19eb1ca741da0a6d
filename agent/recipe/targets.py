"""Targets as data (SPEC §7): where a recipe lives, what its files are, what runs it.

A target is one row of TARGETS. `standalone` is this project's own layout (SPEC §3) on its engine;
`legacy` and `framework` are cann-recipes-infer's two kinds of model folder. Today the migrator
renders `standalone` only; the other two rows say how to run and measure a folder of that kind
(scenarios B and C), and become renderable when they get a `layout`.

Adding a target is a row here plus its templates.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Protocol

from engine.config import KEYS, Key, rendered_settings

# The shared entry point of a cann-recipes-infer checkout, and the file that marks a checkout.
ENTRY = Path("executor") / "scripts" / "infer.sh"
REGISTRY = Path("executor") / "core" / "support_models.py"


@dataclass(frozen=True)
class Launch:
    """One run of a recipe: the command, its working directory (None: the run's own folder, where
    upstream's launcher writes res/<date>/<case>/) and what it adds to the environment."""
    command: tuple[str, ...]
    cwd: Path | None
    env: Mapping[str, str] = field(default_factory=dict)


class Recipe(Protocol):
    """What a launch reads of agent.recipe.recipe.Recipe."""
    path: Path
    repo_root: Path | None
    yaml: Path | None

    def yaml_for(self, world_size: int = 1, write: bool = False) -> Path | None: ...


def standalone_yaml_name(model_name: str, world_size: int = 1) -> str:
    return f"{model_name}_{world_size}card_eager.yaml"


def _run_infer_sh(recipe: Recipe, world_size: int) -> Launch:
    """`bash infer.sh` in the recipe folder; on N cards the N-card YAML through YAML_FILE
    (written from the single-card one when the recipe lacks it)."""
    env = {}
    if world_size > 1:
        env["YAML_FILE"] = recipe.yaml_for(world_size, write=True).relative_to(recipe.path).as_posix()
    return Launch(("bash", str(recipe.path / "infer.sh")), recipe.path, env)


def _run_entry_point(recipe: Recipe, world_size: int) -> Launch:
    """The checkout's `executor/scripts/infer.sh --model NAME --yaml FILE`, with the checkout on
    PYTHONPATH; it runs in the run's own folder (it writes res/ under its working directory)."""
    yaml = recipe.yaml_for(world_size) or recipe.yaml
    rel = yaml.relative_to(recipe.path / "config").as_posix()
    pythonpath = os.pathsep.join(filter(None, [str(recipe.repo_root), os.environ.get("PYTHONPATH")]))
    return Launch(("bash", str(recipe.repo_root / ENTRY), "--model", recipe.path.name, "--yaml", rel), None,
                  {"PYTHONPATH": pythonpath})


@dataclass(frozen=True)
class Target:
    name: str
    summary: str                                    # what runs it, for messages and --help
    launch: Callable[[Recipe, int], Launch]         # (recipe, world_size) -> the run
    yaml_name: Callable[[str, int], str]            # (model_name, world_size) -> file name in config/
    baseline_dir: str = "baseline"                  # relative to the recipe (see Recipe.baseline_dir)
    # What the migrator renders: template -> path in the recipe ({name}, {yaml_name} filled in); the
    # runner comes from the model's family (agent.recipe.routing). Empty: not rendered (yet).
    layout: Mapping[str, str] = field(default_factory=dict)
    readme_template: str | None = None
    yaml_schema: tuple[Key, ...] = ()
    yaml_settings: Callable[[dict], dict] | None = None   # render context -> the YAML as data

    @property
    def renders(self) -> bool:
        return bool(self.layout)

    def files(self) -> dict[str, str]:
        """template -> recipe path of every file rendered for this target (the runner aside)."""
        return {**self.layout, **({self.readme_template: "README.md"} if self.readme_template else {})}


TARGETS: dict[str, Target] = {
    "standalone": Target(
        "standalone", "the recipe's infer.sh, on infer-migrator's engine", _run_infer_sh, standalone_yaml_name,
        layout={
            "infer.py.j2": "infer.py",
            "infer.sh.j2": "infer.sh",
            "config.yaml.j2": "config/{yaml_name}",
            "model_setting.py.j2": "models/model_setting.py",
            "requirements.txt.j2": "requirements.txt",
        },
        readme_template="README.md.j2", yaml_schema=KEYS, yaml_settings=rendered_settings),
    # cann-recipes-infer's ModelRunner recipes: their own infer.sh (sourcing executor/scripts/function.sh).
    "legacy": Target("legacy", "the recipe's infer.sh", _run_infer_sh, standalone_yaml_name),
    # cann-recipes-infer's framework models: config/*.yaml run by the checkout's shared entry point.
    "framework": Target("framework", f"{ENTRY.as_posix()} --model NAME --yaml FILE", _run_entry_point,
                        standalone_yaml_name),
}


def checkout_root(path: Path) -> Path | None:
    """The cann-recipes-infer checkout holding `path`: the nearest folder at or above it with
    executor/core/support_models.py."""
    path = Path(path).expanduser().resolve()
    return next((p for p in (path, *path.parents) if (p / REGISTRY).is_file()), None)


def default_target(output_dir: Path) -> str:
    """`framework` for an output dir inside a checkout (upstream's default for new models) once
    that row renders; `standalone` otherwise."""
    if checkout_root(output_dir) is not None and TARGETS["framework"].renders:
        return "framework"
    return "standalone"
