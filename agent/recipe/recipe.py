"""What a folder is, and everything the migrator asks of a recipe on disk: one `Recipe`.

Kinds (`Recipe.at(path).kind`):

- **checkpoint** (scenario A): ``config.json`` plus weights (``*.safetensors`` / ``*.bin``), even
  when it also holds an ``infer.sh``; nothing inside a checkpoint is ever executed or written.
- **standalone**: a recipe of this project's layout (SPEC §3): its own ``infer.sh`` and a runner
  on infer-migrator's engine (``engine.model_runner``).
- **legacy**: any other folder with its own ``infer.sh`` (cann-recipes-infer's ``ModelRunner``
  recipes, whose ``infer.sh`` sources ``executor/scripts/function.sh``).
- **framework**: a ``models/NAME`` folder with ``config/*.yaml`` inside a repository whose shared
  entry point runs it: ``executor/scripts/infer.sh --model NAME --yaml FILE``.
- **none**: anything else; `reason` says why (e.g. a README-only model folder of a checkout).

The three recipe kinds are the rows of agent.recipe.targets.TARGETS: the row says how the recipe
runs, where its baseline goes and how its YAMLs are named. Paths are resolved first (relative,
``.``, symlinked folders), so nothing depends on the caller's working directory.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from agent.errors import InputError
from agent.recipe.targets import ANY_SCHEMA, ENTRY, Launch, Target, checkout_root, reads_yaml_file, state_dir, target_of
from agent.recipe.fs_guard import user_tree
from agent.recipe.textfile import read_source
from engine.safe_load import load_json, load_yaml, loads_yaml

WEIGHT_GLOBS = ("*.safetensors", "*.bin")
# Folders of a recipe that hold no recipe code: run state, run logs, baselines, caches, environments.
NO_CODE_DIRS = frozenset({".migrator", "res", "baseline", "__pycache__", ".git", ".venv", "venv", "site-packages"})
REPORT = "migration_report.json"
OUR_ENGINE = "engine.model_runner"


@dataclass(frozen=True)
class RunPlan:
    """What one run of a recipe is, decided once (agent.run.plan.plan_run, from `Recipe.run_plan`),
    carried in the workflow's state and read by every record of the run (the run, the baseline's
    yaml_path, the precision check's ranks and weights, the memory estimate, the report):

    - `yaml`: the file its launcher gets; `source_yaml`: the recipe's YAML it is (a copy with the real
      weights filled in when they differ: agent.run.plan);
    - `world_size`: the ranks it starts; `checkpoint`: the weights it runs (None: as the YAML says);
    - `standin`: the npu stand-in's device, None off the stand-in; `tiny`: a tiny random checkpoint
      of `model_type` (`max_new_tokens`: the copy's cut length); `notes`: what the plan did, for the report;
    - `parallel`: the copy's parallel_config where the plan chose a layout the recipe's code runs
      (agent.recipe.layouts), None where the YAML's is scaled to `world_size` (agent.run.plan.parallel_for)."""
    yaml: Path
    world_size: int
    source_yaml: Path | None = None
    checkpoint: Path | None = None
    standin: str | None = None
    tiny: bool = False
    model_type: str | None = None
    max_new_tokens: int | None = None
    notes: tuple[str, ...] = ()
    parallel: dict | None = None       # the copy's parallel_config where the plan chose the layout (agent.run.plan)

    @property
    def repaired_yaml(self) -> Path:
        """The YAML a repair of this run edits: the recipe's own (its copy is written from it before
        every run), but a stand-in run's copy (upstream's files are never edited)."""
        return self.yaml if self.standin or self.source_yaml is None else self.source_yaml

    def as_dict(self) -> dict:
        return {"yaml": str(self.yaml), "world_size": self.world_size,
                "source_yaml": str(self.source_yaml or self.yaml),
                "checkpoint": str(self.checkpoint) if self.checkpoint else None, "standin": self.standin,
                "tiny": self.tiny, "model_type": self.model_type, "max_new_tokens": self.max_new_tokens,
                "notes": list(self.notes), "parallel": dict(self.parallel) if self.parallel else None}

    @classmethod
    def from_dict(cls, data: dict) -> RunPlan:
        """A plan as the state stores it; a store of an earlier release has only yaml and world_size."""
        path = lambda key: Path(data[key]) if data.get(key) else None   # noqa: E731
        return cls(Path(data["yaml"]), int(data["world_size"]), path("source_yaml") or Path(data["yaml"]),
                   path("checkpoint"), data.get("standin"), bool(data.get("tiny")), data.get("model_type"),
                   data.get("max_new_tokens"), tuple(data.get("notes") or ()),
                   dict(data["parallel"]) if isinstance(data.get("parallel"), dict) else None)


@dataclass(frozen=True)
class Recipe:
    kind: str                          # "checkpoint" | "standalone" | "legacy" | "framework" | "none"
    path: Path                         # the resolved folder
    reason: str = ""                   # why it is this kind (for "none": why it is not a recipe)
    repo_root: Path | None = None      # the repository holding executor/scripts/infer.sh, if any
    yaml: Path | None = None           # the YAML a single-card run uses (would use, for "none")
    entry_files: tuple[Path, ...] = ()  # shared files the entry point runs (framework)

    @classmethod
    def at(cls, path: str | Path) -> Recipe:
        """Classify a folder (see the module docs). Never runs or writes anything."""
        folder = Path(path).expanduser().resolve()
        if not folder.is_dir():
            return cls("none", folder, "not a directory")
        repo_root = find_repo_root(folder)
        if is_checkpoint(folder):
            return cls("checkpoint", folder, "config.json and weights: a checkpoint (nothing inside it is run)",
                       repo_root)
        if (folder / "infer.sh").is_file():
            kind = "standalone" if _runs_on_our_engine(folder) else "legacy"
            return cls(kind, folder, "infer.sh present", repo_root, choose_yaml(folder))
        if repo_root is not None and folder.parent == repo_root / "models":
            yaml_path = choose_yaml(folder)
            if yaml_path is None:
                return cls("none", folder, f"a model folder of the repository at {repo_root} with no config/*.yaml "
                           f"for {ENTRY.as_posix()} to run (e.g. a README-only model)", repo_root)
            entries = [p for p in (folder / "infer.py", repo_root / "executor" / "offline" / "infer.py",
                                   repo_root / "executor" / "infer.py") if p.is_file()][:1]
            return cls("framework", folder,
                       f"framework recipe run by {ENTRY.as_posix()} --model {folder.name} "
                       f"--yaml {yaml_path.relative_to(folder / 'config').as_posix()}", repo_root, yaml_path,
                       tuple(p for p in entries if folder not in p.parents))
        # Not a recipe, but maybe one with a file missing: what a repair reads is still found.
        if (folder / "config.json").is_file():
            return cls("none", folder, "config.json without weights: a model folder, not a recipe", repo_root,
                       choose_yaml(folder))
        return cls("none", folder, "no infer.sh and no repository entry point runs it", repo_root, choose_yaml(folder))

    # ---- what it is ------------------------------------------------------------------------
    @property
    def is_recipe(self) -> bool:
        return self.target.is_recipe

    @property
    def refusal(self) -> str | None:
        """Why no command takes this folder, as the one line `classify`, `run` and `baseline` all give
        (exit 2); None for a checkpoint, a recipe, or a model folder with a config.json (migrated
        into a new recipe, scenario A)."""
        if self.is_recipe or self.kind == "checkpoint" or (self.path / "config.json").is_file():
            return None
        return (f"{self.path}: not a recipe and no config.json — {self.reason}; point at a Hugging Face model "
                "directory (the folder that holds config.json and the weights) or a recipe with infer.sh")

    @property
    def target(self) -> Target:
        """The row of its kind (agent.recipe.targets); NOT_A_RECIPE for a folder that is none."""
        return target_of(self.kind)

    @property
    def model_name(self) -> str:
        """The name the recipe runs under, from the first of its target's model_name_sources that names one:
        its runner file, the report, the YAML, the folder (a framework recipe's: `--model NAME`); a checkpoint's
        is its folder's."""
        for source in self.target.model_name_sources if not is_checkpoint(self.path) else ():
            named = self._model_name_from(source)
            if isinstance(named, str) and named:
                return named
        return self.path.name

    def _model_name_from(self, source: str) -> str | None:
        if source == "runner":
            runners = runner_files(self.path)
            return runners[0].stem.removeprefix("runner_") if runners else None
        if source == "report":
            return self.report().get("model_name")
        if source == "yaml":
            return self.settings().get("model_name")
        return self.path.name

    def report(self) -> dict:
        """migration_report.json, if the migrator made this recipe ({} otherwise), schema-checked
        (checked_report): a received recipe's report is untrusted input."""
        try:
            data = load_json(report_path(self.path), max_bytes=REPORT_MAX_BYTES)
        except (OSError, ValueError):
            return {}
        return checked_report(data)

    def settings(self, yaml_path: Path | None = None) -> dict:
        """A YAML of the recipe as data (default: the run's); {} when it is missing, unreadable or
        not a mapping (callers read it as evidence and must not crash on a broken one)."""
        return read_settings(yaml_path or self.yaml)

    def resolve(self, model_path) -> Path | None:
        """A YAML model_path as the engine resolves it (a relative path is taken from the recipe)."""
        if not isinstance(model_path, str) or not model_path.strip():
            return None
        path = Path(model_path).expanduser()
        return path if path.is_absolute() else (self.path / path).resolve()

    def checkpoint_dir(self) -> Path | None:
        """The checkpoint the recipe runs: the YAML's model_path (either schema), else the report's
        model_dir; None when neither holds a config.json."""
        for raw in (self.target.schema.get(self.settings(), "model_path"), self.report().get("model_dir")):
            path = self.resolve(raw)
            if path is not None and (path / "config.json").is_file():
                return path
        return None

    def code_files(self) -> list[Path]:
        """The recipe's own Python files, where its layout puts them: the top level (runner_*.py,
        infer.py, ...), then models/ (what a repair may edit; other folders may hold copies of
        libraries, e.g. a torch_npu source tree)."""
        top = sorted(p for p in self.path.glob("*.py") if p.is_file())
        models = sorted(p for p in (self.path / "models").rglob("*.py") if p.is_file()
                        and not set(p.relative_to(self.path).parts[:-1]) & NO_CODE_DIRS)
        return top + models

    # ---- its YAMLs ---------------------------------------------------------------------------
    def yaml_name(self, world_size: int = 1) -> str:
        return self.target.yaml_name(self.model_name, world_size)

    def yaml_for(self, world_size: int = 1, write: bool = False) -> Path | None:
        """The YAML for `world_size` cards: the run's for one; for N, config/{name}_{N}card_eager.yaml
        (written from the single-card one with `write` when the recipe lacks it)."""
        if world_size <= 1:
            return self.yaml
        config = self.path / "config"
        target = self.target
        # Named for this recipe, else for any model name (a recipe renamed since).
        for candidate in (config / self.yaml_name(world_size), *sorted(config.glob(target.yaml_name("*", world_size)))):
            if candidate.is_file():
                return candidate
        return self.write_yaml_for(world_size) if write else None

    def write_yaml_for(self, world_size: int) -> Path:
        """config/{name}_{N}card_eager.yaml next to the single-card one: the same settings on N cards,
        tensor parallel over all of them. Returns its path."""
        if self.yaml is None:
            raise InputError(f"{self.path}/config has no YAML file")
        row = self.target
        settings = row.scale_yaml(load_yaml(self.yaml), world_size, moe=self.is_moe())
        name = row.schema.get(settings, "model_name") or self.model_name
        target = self.yaml.parent / row.yaml_name(name, world_size)
        how = row.scaled_how(world_size)
        expert = self.expert_parallel_layout(world_size)
        if expert is not None and isinstance(settings.get("parallel_config"), dict):
            settings["parallel_config"].update(expert["parallel_config"])       # the experts expert parallel
            how = expert["how"]
        run = row.launch_hint(self.path.name, target.name)
        header = (f"# {name}: {world_size} cards, {how}, eager mode. Written from "
                  f"{self.yaml.name} by infer-migrator.\n# Run: {run}\n")
        if row.inside_checkout:
            # upstream's schemas, written as upstream's YAMLs write them (True / False, quoted strings)
            from agent.recipe.render import yaml_text
            body = yaml_text(settings)
        else:
            body = yaml.safe_dump(settings, sort_keys=False)
        user_tree(self.path).write_text(target, header + body)
        return target


    def expert_parallel_layout(self, world_size: int, checkpoint: Path | None = None) -> dict | None:
        """For a native MoE model on `world_size` cards, the layout upstream writes (the experts expert parallel,
        agent.recipe.native.preflight.expert_parallel_layout): {"parallel_config", "how"}; None for another model
        (the adapter's vendored code runs experts as its tensor-parallel plan splits them) or one card."""
        from agent.recipe.native import preflight

        checkpoint = checkpoint or self.checkpoint_dir()
        if not self.target.writes_native_models or checkpoint is None or not preflight.is_native(self.path):
            return None
        return preflight.expert_layout_of(checkpoint, world_size)

    def is_moe(self) -> bool:
        """The model has MoE layers: its migration's family says so, else its checkpoint's config
        names experts (unknown: True, every parallel size kept as it was)."""
        from agent.recipe.targets import MOE_FAMILIES

        family = self.report().get("family")
        if family:
            return family in MOE_FAMILIES
        checkpoint = self.checkpoint_dir()
        try:
            config = load_json(checkpoint / "config.json") if checkpoint else None
        except (OSError, ValueError):
            config = None
        if not isinstance(config, dict):
            # no checkpoint yet (a YAML's model_path placeholder, no report): the vendored configuration
            # class says whether the architecture has an experts count at all
            sources = sorted((self.path / "models").glob("configuration_*.py")) + sorted(self.path.glob("configuration_*.py"))
            if not sources:
                return True
            return any(re.search(r"\b(num_local_experts|num_experts|n_routed_experts|moe_num_experts)\b", _head(p))
                       for p in sources)
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        return any(text.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"))

    def run_plan(self, world_size: int | None = None, write: bool = True) -> RunPlan:
        """The one place a run's YAML and rank count are decided (agent.run.plan.plan_run adds the
        weights). `world_size` None: the recipe's own YAML (`yaml`) at the ranks it sets; N: config/'s
        YAML named for N ranks, else the recipe's own when it sets N, else a top-level config/ YAML that
        sets N, else one written from the single-card one (`write`; without it the plan is the own YAML
        at N ranks, scaled in the run's copy). Refused (InputError, one line, before anything runs) when
        no YAML for N ranks can be run: the YAML named for N sets another world_size, the recipe has no
        single-card YAML for N = 1, or its infer.sh picks its YAML itself (it never reads YAML_FILE), so
        another YAML would be written and not run."""
        if self.yaml is None:
            raise InputError(f"{self.path}/config has no YAML file")
        schema = self.target.schema
        own = schema.world_size(read_settings(self.yaml)) or 1
        named = self.yaml_for(world_size) if world_size is not None and world_size > 1 else None
        if world_size is None or (world_size == own and named is None):
            return self._tensor_parallel_checked(RunPlan(self.yaml, own, self.yaml))
        if named is None:
            named = next((p for p in recipe_yaml_files(self)[1:] if p.parent == self.path / "config"
                          and schema.world_size(read_settings(p)) == world_size), None)
        if named is not None and named.resolve() == self.yaml.resolve():
            pass                    # the recipe's own YAML is the N-rank one: its infer.sh runs it as it is
        elif world_size <= 1 and named is None and write:
            raise InputError(f"--world-size 1: {self.path.name}'s YAML {self._shown(self.yaml)} sets world_size {own} "
                             f"and the recipe has no single-card YAML; run it without --world-size (its {own} ranks)")
        elif self.target.runs_own_infer_sh and not reads_yaml_file(self.path / "infer.sh") and write:
            raise InputError(f"--world-size {world_size}: {self.path.name}/infer.sh runs {self._shown(self.yaml)} "
                             f"({own} rank(s)) and does not read YAML_FILE, so no other YAML can be run through it; "
                             f"make it honour YAML_FILE (YAML_FILE=config/X.yaml bash infer.sh) or run it without "
                             "--world-size")
        if named is None and not write:
            return RunPlan(self.yaml, world_size, self.yaml)
        yaml_path = named or self.write_yaml_for(world_size)
        ranks = schema.world_size(read_settings(yaml_path)) or 1
        if ranks != world_size:
            raise InputError(f"--world-size {world_size}: {self._shown(yaml_path)} is named for {world_size} ranks "
                             f"but sets world_size {ranks}; fix its world_size or remove it (it is then written "
                             f"from {self.yaml.name})")
        return self._tensor_parallel_checked(RunPlan(yaml_path, ranks, yaml_path))

    def _tensor_parallel_checked(self, plan: "RunPlan") -> "RunPlan":
        """A native framework model whose heads or widths do not split at the plan YAML's tensor-parallel
        sizes is refused here, one line, before anything runs (agent.recipe.native.preflight)."""
        if self.target.writes_native_models:
            from agent.recipe.native import preflight

            preflight.check(self.path, self.checkpoint_dir(), read_settings(plan.yaml), self._shown(plan.yaml))
        return plan

    def _shown(self, yaml_path: Path) -> str:
        try:
            return yaml_path.relative_to(self.path).as_posix()
        except ValueError:
            return str(yaml_path)

    # ---- running and measuring it ------------------------------------------------------------
    def launch(self, plan: RunPlan | int | None = None) -> Launch:
        """The command that runs `plan` (a RunPlan, or a world_size for `run_plan`): the target's launch."""
        if not isinstance(plan, RunPlan):
            plan = self.run_plan(plan)
        return self.target.launch(self, plan.yaml)

    def baseline_dir(self) -> Path:
        """Where the baseline goes: the repository's convention (agentic/baseline/) when the folder
        has agentic/, else the target's."""
        if (self.path / "agentic").is_dir():
            return self.path / "agentic" / "baseline"
        return self.path / self.target.baseline_dir


REPORT_MAX_BYTES = 64 * 2**20


def _str(value) -> bool:
    return isinstance(value, str) and "\0" not in value and len(value) <= 4096


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _relative(value) -> bool:
    return _str(value) and value and not value.startswith(("/", "\\")) and ".." not in value.split("/") \
        and "\\" not in value


# the report fields the tool reads back, each with its check; any other field is kept as data only
REPORT_SCHEMA = {
    "model_name": _str,
    "model_dir": _str,
    "recipe_dir": _str,
    "baseline_path": _str,
    "rendered": lambda v: isinstance(v, list) and all(_relative(x) for x in v),
    "vendored": lambda v: isinstance(v, dict) and (v.get("origin") is None or _str(v["origin"])) and (
        v.get("files") is None or (isinstance(v["files"], dict) and all(_relative(x) for x in v["files"].values()))),
    "transformers": lambda v: isinstance(v, dict) and all(v.get(k) is None or _str(v[k])
                                                          for k in ("version", "source_root", "origin", "python")),
    "rounds": lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v),
    "quantization": lambda v: isinstance(v, dict) and all(v.get(k) is None or _str(v[k]) for k in (
        "scheme", "source", "checkpoint", "format", "command")) and (v.get("cost") is None or isinstance(v["cost"], dict))
        and isinstance(v.get("kept_float", []), list) and all(isinstance(x, str) for x in v.get("kept_float", [])),
    "conversion": lambda v: isinstance(v, dict) and all(v.get(k) is None or _str(v[k]) for k in (
        "format", "why", "source", "path", "dtype", "command", "upstream_converter")) and all(
        v.get(k) is None or _number(v[k]) for k in ("seconds", "peak_rss_bytes", "rss_before_bytes",
                                                    "largest_source_shard_bytes")) and (
        v.get("tensors") is None or (isinstance(v["tensors"], dict) and all(_number(n) for n in v["tensors"].values()))),
}


def checked_report(data) -> dict:
    """A report with every field the tool reads back of the right shape: a field that is not is dropped
    (as if the report never had it), never used. Not a JSON object: {}."""
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if k not in REPORT_SCHEMA or v is None or REPORT_SCHEMA[k](v)}


def report_path(folder: Path) -> Path:
    """migration_report.json of a recipe: in the recipe; inside a checkout in our state folder
    (agent.recipe.targets.state_dir), so that upstream's tree holds nothing of ours but the recipe."""
    folder = Path(folder)
    if checkout_root(folder) is None or (folder / REPORT).is_file():
        return folder / REPORT
    return state_dir(folder) / REPORT


def is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and any(
        p.is_file() for pattern in WEIGHT_GLOBS for p in path.glob(pattern))


def find_repo_root(path: Path) -> Path | None:
    """The nearest folder at or above `path` with executor/scripts/infer.sh."""
    for parent in (path, *path.parents):
        if (parent / ENTRY).is_file():
            return parent
    return None


def runner_files(folder: Path) -> list[Path]:
    """A recipe's runner files (runner_NAME.py at its top level, sorted): the one answer to "which runner
    file" (its model name, whether it runs on our engine, the config class it builds, the code check)."""
    return sorted(p for p in Path(folder).glob("runner_*.py") if p.is_file())


def _runs_on_our_engine(folder: Path) -> bool:
    return any(OUR_ENGINE in _head(p) for p in runner_files(folder))


CLASSIFY_READ_LIMIT = 1 * 2**20     # classifying a folder reads at most this much of a file (a 4 GiB infer.sh too)


def _head(path: Path) -> str:
    """The first CLASSIFY_READ_LIMIT bytes of a regular file as text: classification stays bounded,
    whatever size a received file claims (a sparse infer.sh of gigabytes was read in full)."""
    try:
        with open(path, "rb") as f:
            return f.read(CLASSIFY_READ_LIMIT).decode("utf-8", errors="replace")
    except OSError:
        return ""


def read_settings(path: Path | None) -> dict:
    """A YAML file as a mapping; {} when missing, unreadable or not a mapping."""
    if path is None:
        return {}
    try:
        data = loads_yaml(read_source(path)) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


_YAML_ASSIGN_RE = re.compile(
    r"""^\s*(?:export\s+)?(?:YAML_FILE_NAME|YAML_FILE|YAML_NAME|YAML)=["']?(?:\$\{\w+:-)?"""
    r"""(?P<value>[^"'\s}]+\.ya?ml)""", re.M)
_YAML_ARG_RE = re.compile(r"""(?:--yaml(?:_file_path|-file)?[= ]|\$\{2:-)["']?(?P<value>[^"'\s}]+\.ya?ml)""")


def _world_size(data: dict) -> int | None:
    """The ranks a YAML of either schema sets (a folder's YAMLs are read before its kind is known)."""
    return ANY_SCHEMA.world_size(data)


def recipe_yaml_files(recipe: Recipe, limit: int = 200) -> list[Path]:
    """The YAML a run of the recipe reads, then every other config/*.yaml (at most `limit`)."""
    found = [recipe.yaml] if recipe.yaml is not None else []
    config = recipe.path / "config"
    if config.is_dir() and not config.is_symlink():
        for path in sorted(config.rglob("*.y*ml")):
            if len(found) >= limit:
                break
            if path.suffix in (".yaml", ".yml") and path.is_file() and path not in found:
                found.append(path)
    return found


def choose_yaml(recipe_dir: Path) -> Path | None:
    """The YAML a run uses: the one infer.sh names, else a single-card one, else the first."""
    infer_sh = recipe_dir / "infer.sh"
    if infer_sh.is_file():
        text = _head(infer_sh)
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
    single = [p for p in top if _world_size(read_settings(p)) in (1, None)]
    return (single or top)[0]
