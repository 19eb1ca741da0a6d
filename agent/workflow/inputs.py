"""The one input step of a workflow run: what the user gave, checked once, as the state and the run
options the graph runs on.

* `validate_run(args)`: `migrator run`'s arguments -> (MigrationState, RunOptions). Bad input is one
  line and exit 2, a host that cannot run it exit 4, before anything is written or downloaded; what
  is checked here (the checkpoint, the output dir, the target kind, the device, the NPU kernels of a
  recipe) the nodes do not check again. A checkpoint downloaded from a hub is checked where it
  arrives (node_acquire): nothing of it exists here.
* `validate_recipe(recipe, args)`: the same for one recipe of `migrator baseline` / `classify`.
* `host_environment(device)`: the environment record of this host (engine.environment) with whether a
  stand-in run can happen here (npu_standin.availability): `migrator env` and the detect_env node.

The run options (max_rounds, timeout_s, device) travel in the graph's config (agent.workflow.state.
RunOptions), not in its state.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from agent import errors
from agent.errors import EnvironmentProblem
from agent.migrate.acquire import hub_target, local_path_problem, parse_hub_ref
from agent.migrate.checkpoint_check import check_checkpoint, check_output_outside, weight_files
from agent.recipe.fs_guard import check_regular, check_writable, check_write_destinations
from agent.recipe.recipe import Recipe
from agent.recipe.runnable import ensure_runnable_here
from agent.recipe.targets import TARGETS, checkout_root, choose_target
from agent.workflow.state import MigrationState, RunOptions
from engine.environment import DeviceUnavailableError, detect_environment, select_device
from engine.safe_load import LoadError


def validate_run(args) -> tuple[MigrationState, RunOptions]:
    """`migrator run TARGET ...`: every check of what the user gave, once, in the order a user meets
    them (text, device, target, output dir, stand-in plan, NPU kernels, target kind, transformers
    source, the host for a checkout), then the state and options. With `--resume` the input is checked
    too (a resume with nothing saved starts from the beginning, and no node checks it again); the
    stand-in plan (it writes a YAML copy) and the host check of a checkout migration are the stored
    run's."""
    check_text_args(target=args.target, **{"--name": args.name, "--output-dir": args.output_dir,
                                           "--weights": args.weights})
    args.target = hub_target(args.target, args.hub)
    check_device_here(args.device)
    path = Path(args.target).expanduser()
    # the input step's one look-up of the folder (after check_target refused what must not be read)
    recipe = check_target(args.target, args.trust_remote_code)
    is_recipe = recipe is not None and recipe.is_recipe
    check_quantize(args, path, is_recipe)
    if (path / "config.json").is_file():
        check_output_outside(path, Path(args.output_dir), args.output_dir)
    if not is_recipe:     # a recipe is repaired in place: no output dir is made
        check_output_dir(args.output_dir)
    args.target = resolve_target(args.target)
    plan = None if args.resume else standin_plan(args, recipe)
    if args.yaml and not args.standin:
        raise errors.InputError("--yaml picks the YAML of a --standin run; without it the recipe runs its own")
    if plan is None and not (args.resume and args.standin):     # a resumed stand-in run keeps its plan
        preflight(recipe)
    # the kind of recipe a migration writes: a bad --target is exit 2 before acquiring
    recipe_target = None if is_recipe else choose_target(args.recipe_target, Path(args.output_dir))
    if args.transformers_source and args.transformers_source != "installed":
        from agent.migrate.transformers_source import check_source_fits, open_source

        if recipe_target is not None:     # a standalone migration takes none: exit 2, nothing unpacked
            check_source_fits(args.transformers_source, TARGETS[recipe_target].inside_checkout)
        open_source(args.transformers_source)       # a bad source is exit 10 before the workflow starts
    if not args.resume and not is_recipe:
        check_npu_for_checkout(args, recipe_target)     # bad input first (above), then the host: exit 4 before any write
    state: MigrationState = {
        "target": args.target, "output_dir": args.output_dir, "name": args.name, "dtype": args.dtype,
        "weights": args.weights, "trust_remote_code": args.trust_remote_code, "allow_install": args.allow_install,
        "max_new_tokens": args.max_new_tokens, "world_size": args.world_size, "recipe_target": recipe_target,
        "transformers_source": args.transformers_source, "reference_python": command_path(args.reference_python),
        **({"quantize": args.quantize} if getattr(args, "quantize", None) else {}),
        **({"run_plan": plan} if plan else {})}
    return state, {"max_rounds": args.max_rounds, "timeout_s": args.timeout, "device": args.device}


def command_path(value: str | None) -> str | None:
    """A command given as a path (`.venv-tf5.0/bin/python`), made absolute against the folder the user typed it
    in: the recipe's runs and the precision check start it from other folders. A bare name is looked up on PATH
    where it runs, as typed."""
    if not value or (os.sep not in value and not value.startswith("~")):
        return value
    return str(Path(value).expanduser().absolute())


def validate_recipe(recipe: Recipe, args, max_rounds: int = 0) -> tuple[MigrationState, RunOptions]:
    """One recipe of `migrator baseline` (or `classify`): refused (the same line run gives), planned for
    the stand-in (--standin), or checked to run on this host; measured or repaired in place."""
    if recipe.refusal:
        raise errors.InputError(recipe.refusal)
    plan = standin_plan(args, recipe) if hasattr(args, "standin") else None
    if plan is None:
        preflight(recipe)
    state: MigrationState = {"target": str(recipe.path), "output_dir": str(recipe.path.parent),
                             **({"run_plan": plan} if plan else {})}
    return state, {"max_rounds": max_rounds, "timeout_s": args.timeout, "device": "auto"}


def host_environment(device: str = "auto") -> dict:
    """The environment of the device `device` names; one it cannot have is exit 4 (EnvironmentProblem)."""
    from npu_standin import availability

    try:
        return {**detect_environment(device), "npu_standin": availability()}
    except DeviceUnavailableError as exc:
        raise EnvironmentProblem(str(exc)) from exc


# ---- the checks ---------------------------------------------------------------------------
def standin_plan(args, recipe: Recipe | None) -> dict | None:
    """--standin: the run plan of a recipe under the npu stand-in (agent.run.plan; None without --standin)."""
    if getattr(args, "tiny", False) and not args.standin:
        raise errors.InputError("--tiny needs --standin (a tiny checkpoint is for a run under the npu stand-in)")
    if not args.standin:
        return None
    from agent.run.plan import plan_run

    recipe = recipe or Recipe.at(args.target)
    if recipe.is_recipe:
        check_recipe_files(recipe)      # a binary / bomb / duplicate-key upstream YAML: exit 2, not a crash
    asked = getattr(args, "world_size", None)
    return plan_run(recipe, asked or 1, yaml_name=getattr(args, "yaml", None), standin="cpu", tiny=args.tiny,
                    max_new_tokens=min(getattr(args, "max_new_tokens", 16), 16), fit_ranks=asked is None,
                    quantize=getattr(args, "quantize", None)).as_dict()


def check_quantize(args, path: Path, is_recipe: bool) -> None:
    """--quantize: a checkpoint migration's (a recipe runs the weights its YAML names); a local
    checkpoint it cannot convert is refused here, one line, before anything is written (a hub
    checkpoint where it arrives: node_acquire)."""
    scheme = getattr(args, "quantize", None)
    if not scheme:
        return
    if is_recipe:
        if getattr(args, "standin", False) and getattr(args, "tiny", False):
            return      # the stand-in's tiny checkpoint written so (agent.run.plan)
        raise errors.InputError(f"--quantize {scheme} quantizes the checkpoint a migration starts from; "
                                f"{args.target} is a recipe, which runs the weights its YAML names (under "
                                "--standin --tiny its tiny checkpoint is written so)")
    if (path / "config.json").is_file():
        from agent.migrate.quantize import plan

        plan(path.resolve())


def check_target(target: str, trust_remote_code: bool = False) -> Recipe | None:
    """Reject bad input before the workflow starts: one line, exit code 2. Returns the folder's
    Recipe.at (None for a link or repo id)."""
    path = Path(target).expanduser()
    if path.exists():
        if not path.is_dir():
            raise errors.InputError(f"{target}: not a directory; give a Hugging Face model directory, "
                                    "a recipe directory, an https://huggingface.co/Org/Name link or Org/Name")
        if os.path.lexists(path / "config.json"):
            check_regular(path / "config.json")      # a loop, a FIFO, a device: refused by type, never read
        recipe = Recipe.at(path)
        if recipe.refusal:
            raise errors.InputError(recipe.refusal)     # the same line classify and baseline give
        if (path / "config.json").is_file() and (not (path / "infer.sh").is_file() or weight_files(path)):
            check_checkpoint(path, trust_remote_code)   # a checkpoint (even one holding an infer.sh): checked before any step
        return recipe
    if local_path_problem(target):
        raise errors.InputError(local_path_problem(target))
    elif parse_hub_ref(target) is None:
        from agent.migrate.acquire import hub_ref_problem

        why = hub_ref_problem(target)
        raise errors.InputError(f"{target}: no such directory, and not a Hugging Face link "
                                "(https://huggingface.co/Org/Name), repo id (Org/Name) or ModelScope link "
                                f"(https://modelscope.cn/models/Org/Name)" + (f" ({why})" if why else ""))
    return None


def resolve_target(target: str) -> str:
    """A local folder as an absolute, symlink-free path (relative paths, `.`, symlinked folders all
    work from any working directory); links and repo ids are kept as given."""
    path = Path(target).expanduser()
    return str(path.resolve()) if path.exists() else target


def preflight(recipe: Recipe | None) -> None:
    """Before anything runs or is written: a recipe that calls NPU kernels on a host without a
    usable NPU ends here with exit 4 (no repair round, no file touched); the workflow's classify
    does not ask again."""
    if recipe is not None and recipe.is_recipe:
        check_recipe_files(recipe)
        check_recipe_destinations(recipe)
        ensure_runnable_here(recipe)


def check_recipe_files(recipe: Recipe) -> None:
    """The recipe's YAML files loaded with the bounded loader before anything runs: one too large, an
    alias bomb, nested too deep, with duplicate keys or bytes that are not UTF-8 is exit 2 naming the file
    and line. A plain syntax slip is left to the repair rounds (scenario B)."""
    from agent.recipe.recipe import recipe_yaml_files
    from engine.safe_load import load_yaml

    for path in recipe_yaml_files(recipe):
        try:
            load_yaml(path)
        except LoadError as exc:
            if exc.kind != "syntax":
                raise errors.InputError(str(exc)) from None


def check_recipe_destinations(recipe: Recipe) -> None:
    """What a run of the recipe writes (its run logs, baseline, report) can be written inside it."""
    check_writable(recipe.path)       # a read-only recipe: one line before anything runs
    baseline = recipe.baseline_dir().relative_to(recipe.path).as_posix()
    check_write_destinations(recipe.path, {".migrator": "dir", "agentic": "dir", baseline: "dir",
                                         "migration_report.json": "file", "migration_summary.md": "file",
                                         "README.md": "file"})


# The environment variables that name a server: checked once, at the start of the commands that may reach it,
# so a value no URL parser accepts is one line (exit 2), not a ValueError deep in a hub lookup.
URL_VARIABLES = {     # name: (the commands that read it, an example, a bare host allowed as the reader does)
    "HF_ENDPOINT": (("run", "classify", "baseline"), "https://hf-mirror.com", False),
    "MODELSCOPE_ENDPOINT": (("run", "classify", "baseline"), "https://modelscope.cn", True),
    "MODELSCOPE_DOMAIN": (("run", "classify", "baseline"), "modelscope.cn", True),    # modelscope's deprecated name
    "MIGRATOR_LLM_BASE_URL": (("run",), "http://127.0.0.1:8000/v1", False),
}


def check_environment(command: str, environ=None) -> None:
    """Every URL-valued environment variable `command` reads (URL_VARIABLES) is an http(s) URL with a host and a
    valid port, or unset / empty; MIGRATOR_DEVICE_MEMORY_BYTES a card size. Anything else: exit 2, naming the
    variable."""
    from urllib.parse import urlsplit

    from engine.environment import simulated_card_bytes

    environ = os.environ if environ is None else environ
    for name, (commands, example, bare_host) in URL_VARIABLES.items():
        raw = environ.get(name, "")
        if command not in commands or not raw.strip():
            continue
        text = raw.strip()
        text = text if "://" in text or not bare_host else f"https://{text}"
        try:
            parts = urlsplit(text)
            parts.port                      # noqa: B018 - raises ValueError for a port out of range or not a number
            good = parts.scheme in ("http", "https") and bool(parts.hostname) and not re.search(r"[\x00-\x20\x7f]", text)
        except ValueError:
            good = False
        if not good:
            shown = raw if len(raw) <= 80 else raw[:77] + "..."
            raise errors.InputError(f"{name}={shown!r} is not an http(s) URL with a host (e.g. {example}); "
                                    "set it to one, or unset it")
    if command in ("run", "demo", "baseline", "classify"):
        try:
            simulated_card_bytes(environ)       # recipes read it too: a bad value is refused before anything runs
        except ValueError as exc:
            raise errors.InputError(str(exc)) from None


def check_home_references(args) -> None:
    """A path argument of every command that starts `~name` where no user `name` exists: one line, exit 2
    (pathlib's expanduser raises a RuntimeError for it wherever the path is used)."""
    values = [getattr(args, key, None) for key in ("target", "path", "recipe", "output_dir", "weights", "summary",
                                                   "transformers_source", "reference_python", "record")]
    values += list(getattr(args, "recipes", None) or [])
    for value in values:
        if not isinstance(value, str) or "~" not in value:
            continue
        parts = Path(value).parts        # as pathlib reads it: './~x' is '~x' to its expanduser
        head = parts[0] if parts else ""
        if head.startswith("~") and os.path.expanduser(head) == head:
            raise errors.InputError(f"{value}: '{head}' names no user on this host; give the path without it, "
                                    "or an absolute one")


def check_text_args(**values) -> None:
    """Paths and names with control characters (a newline, a tab, NUL) end up broken in logs,
    YAML and shell lines: refuse them (exit 2)."""
    for option, value in values.items():
        if value is not None and re.search(r"[\x00-\x1f\x7f]", str(value)):
            raise errors.InputError(f"{option} {str(value)!r} contains control characters (newline, tab, …); "
                                    "rename it")


def check_output_dir(output_dir: str) -> None:
    """The output dir is created if needed; a file in the way or no permission is exit 2."""
    path = Path(output_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise errors.InputError(f"--output-dir {output_dir}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise errors.InputError(f"--output-dir {output_dir}: cannot be created ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise errors.InputError(f"--output-dir {output_dir}: not writable")


def check_npu_for_checkout(args, kind: str | None = None) -> None:
    """A migration into a cann-recipes-infer checkout (--target framework or legacy) runs upstream's
    executor, which imports torch_npu: on a host without a usable NPU it ends here with exit 4, before
    anything is written or downloaded, naming the stand-in run that validates it — as a command that works as
    printed: with `--reference-python` an interpreter that has the checkout's transformers where the run needs one,
    or the command that builds it first (transformers_source.run_advice). Under the stand-in
    (`migrator standin -- migrator run ...`) the run goes on."""
    from agent.recipe.npu_scan import npu_usable
    from npu_standin.environment import is_active

    kind = kind or choose_target(args.recipe_target, Path(args.output_dir))     # a bad --target is exit 2 first
    if not TARGETS[kind].inside_checkout or is_active() or npu_usable():
        return
    import shlex

    from agent.migrate import transformers_source
    from engine.environment import probe_torch_npu

    status = probe_torch_npu()["status"]
    why = status if status != "ok" else "torch_npu sees no NPU"
    # the next check of that command: an interpreter with the checkout's transformers (plan_for)
    extra, build = transformers_source.run_advice(checkout_root(Path(args.output_dir).expanduser()),
                                                  getattr(args, "transformers_source", None),
                                                  getattr(args, "reference_python", None))
    again = shlex.join(["migrator", "standin", "--", "migrator", *getattr(args, "typed", ["run", args.target]), *extra])
    again = f"{build} && {again}" if build else again
    raise errors.EnvironmentProblem(
        f"a {kind} recipe in {Path(args.output_dir).expanduser().resolve()} runs on upstream's executor, which needs "
        f"an Ascend NPU (torch_npu), and this host has none ({why}); nothing was written. Off an NPU, validate "
        f"the migration under the npu stand-in: `{again}`")


def check_device_here(device: str) -> None:
    """`--device npu` (or npu:N) on a host without a usable NPU: one line saying so, before any
    check of the target (whose NPU kernels would otherwise be the message) and before any write."""
    if not device.startswith("npu"):
        return
    try:
        select_device(device)
    except DeviceUnavailableError as exc:
        raise errors.EnvironmentProblem(f"no NPU here: {exc}") from exc


def is_recipe_folder(target: str) -> bool:
    path = Path(target).expanduser()
    return path.is_dir() and Recipe.at(path).is_recipe
