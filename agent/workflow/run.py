"""`run_migration(state, resume, options=...)`: the one way to run the graph (the CLI, the benchmarks,
the tests).

It owns the compiled graph with its progress output, where the checkpoint store lives, the
thread key of a run, what `--resume` accepts from the store, and the graph's config: the thread and
the run options (agent.workflow.state.RunOptions), which are not part of the stored state.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import sqlite3
import sys
import types
import typing
import uuid
from pathlib import Path

from agent import errors
from agent.progress import step
from agent import folder_lock
from agent.recipe.fs_guard import user_tree
from agent.recipe.backup import atomic_write, start_backup_run
from agent.recipe.recipe import Recipe
from agent.workflow.checkpoint_serde import StateSerializer, UnsafeStoreError
from agent.workflow.state import OPTION_KEYS, MigrationState, RunOptions, summarise
from agent.workflow.store import store_dir
from engine.safe_load import load_json

RECURSION_LIMIT = 100


def progress(name: str, fn):
    """Each node as a step of agent.progress: its start, end and elapsed time on stderr (live on a
    terminal, plain lines otherwise)."""
    @functools.wraps(fn)            # the node's signature: LangGraph passes `config` to a node that takes it
    def wrapper(state, **config):
        with step(name):
            return fn(state, **config)
    return wrapper


def compiled_graph(checkpoint_db: Path):
    """The graph with a SQLite checkpointer whose serializer reads plain JSON data only: a tampered
    store is refused (UnsafeStoreError), nothing it names is imported or called."""
    # LangGraph (and the nodes, with every module they call) load only for a command that runs the graph.
    from langgraph.checkpoint.sqlite import SqliteSaver

    from agent.workflow.graph import build_graph

    checkpoint_db.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(checkpoint_db), check_same_thread=False)
    return build_graph(wrap=progress).compile(checkpointer=SqliteSaver(conn, serde=StateSerializer()))


def thread_key(state: dict) -> str:
    """The run's identity: same target, name and output dir -> same key (what --resume continues)."""
    output_dir = Path(state.get("output_dir") or "models").resolve()
    target = Path(state["target"]).expanduser()
    key = json.dumps([str(target.resolve()) if target.exists() else state["target"], state.get("name"),
                      str(output_dir)])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def checkpoint_home(state: dict) -> Path:
    """Checkpoints live with what they describe: in the recipe for B/C, in the output dir for A
    (never inside a checkpoint, even one that holds an infer.sh)."""
    target = Path(state["target"]).expanduser()
    recipe = Recipe.at(target) if target.is_dir() else None
    return recipe.path if recipe is not None and recipe.is_recipe else Path(state.get("output_dir") or "models").resolve()


def _unreadable_store(path: Path, why: str, fresh_run_avoids: bool) -> errors.InputError:
    """`fresh_run_avoids`: the fault is in the state of the run being resumed, which a run without --resume
    never reads (its advice then names that too); a fault of the store's files themselves meets a fresh run
    as well, so only their removal is advised."""
    rm = f"rm {'-r ' if path.is_dir() and not path.is_symlink() else ''}{path}"
    hint = f"remove it ({rm}) or run without --resume" if fresh_run_avoids else f"remove it ({rm})"
    why = " ".join(str(why).split())[:200]
    return errors.InputError(f"{path}: the --resume checkpoint store cannot be read safely ({why}); {hint}")


def _load_threads(threads_file: Path, resume: bool) -> dict:
    if not threads_file.is_file():
        return {}
    try:
        threads = load_json(threads_file)
    except (OSError, ValueError) as exc:
        raise _unreadable_store(threads_file, f"{exc.__class__.__name__}", False) from exc
    if not isinstance(threads, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in threads.items()):
        raise _unreadable_store(threads_file, "not a JSON object of thread ids", False)
    return threads


def conforms(value, hint) -> bool:
    """`value` is what the type `hint` says (a TypedDict: a dict whose known keys conform; extra keys
    are let through, so a record a node adds a key to still resumes)."""
    if value is None:
        return True
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        return conforms(value, typing.get_args(hint)[0])
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, arg) for arg in typing.get_args(hint))
    if typing.is_typeddict(hint):
        fields = typing.get_type_hints(hint)
        return isinstance(value, dict) and all(conforms(v, fields[k]) for k, v in value.items() if k in fields)
    if hint is typing.Any:
        return True
    if origin in (list, dict):
        args = typing.get_args(hint)
        if not isinstance(value, origin):
            return False
        if origin is list:
            return not args or all(conforms(v, args[0]) for v in value)
        return not args or all(conforms(k, args[0]) and conforms(v, args[1]) for k, v in value.items())
    if hint is bool:
        return isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint) and not (isinstance(value, bool) and hint is not bool)


def _check_resumed_state(values: dict, db: Path) -> None:
    """A store holds MigrationState's types, records included (a store of an earlier release does);
    anything else is refused."""
    hints = typing.get_type_hints(MigrationState, include_extras=True)
    for key, value in values.items():
        if key in hints and not conforms(value, hints[key]):
            raise _unreadable_store(db, f"state field {key!r} holds a {type(value).__name__} that is not "
                                        "what this release stores", True)


def store_root(home: Path, store: Path) -> Path:
    """The tree the store's files are written in: the recipe (or output folder) `home` when the store
    is its `.migrator/`, else the store itself (the private folder of a checkout migration)."""
    return home if home == store or home in store.parents else store


def _hold_run_lock(path: Path, state: dict, root: Path) -> int:
    """One run per recipe (and per identical migration) at a time: an exclusive flock, held until the
    run returns (the kernel drops it when the process dies, even on SIGKILL); a second run is refused
    with one line (exit 75, try again later). Returns the lock's file descriptor. `root`: the tree
    the lock file is in (store_root)."""
    fd = user_tree(root, "the run's state folder").open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = folder_lock.holder_of(os.read(fd, 512).decode(errors="replace").strip())
        os.close(fd)
        raise errors.MigratorError(f"another migrator run of {state.get('target')} is in progress ({holder}, "
                                   f"lock {path}); wait for it to end or stop it, then re-run",
                                   errors.EXIT_BUSY) from None
    os.ftruncate(fd, 0)
    os.write(fd, folder_lock.holder_line().encode()[:500])
    return fd


def _refuse_replacing_interrupted(app, thread_id: str) -> None:
    """A migration killed after it published its recipe, run again without --resume: its saved state is
    kept and the run refused (the recipe folder exists), so `--resume` still continues it. (Killed before,
    it left nothing in the output folder: the run starts again.)"""
    snapshot = app.get_state({"configurable": {"thread_id": thread_id}, "recursion_limit": RECURSION_LIMIT})
    recipe = (snapshot.values or {}).get("recipe_dir")
    if snapshot.next and recipe and Path(recipe).is_dir() and any(Path(recipe).iterdir()):
        raise errors.InputError(f"{recipe}: an interrupted migration of this target is saved (it stopped before "
                                f"{', '.join(snapshot.next)}); continue it: the same command with --resume; or undo "
                                f"it: `migrator rollback {recipe}`, then remove {recipe}")


def _migration_folder(state: dict, output_dir: Path) -> Path | None:
    """The recipe folder a migration of a checkpoint will write (OUTPUT/NAME), when it can be told before
    anything is fetched; None when only acquire can tell (it locks the folder then)."""
    from agent.migrate.acquire import name_hint
    from agent.recipe.templating import normalise_model_name

    try:
        if state.get("name"):
            return output_dir / normalise_model_name(state["name"], explicit=True)
        hint = name_hint(str(state["target"]))
        return output_dir / normalise_model_name(hint) if hint else None
    except (errors.MigratorError, OSError, ValueError):
        return None


def run_migration(state: dict, resume: bool = False, *, stop_after: str | None = None,
                  options: RunOptions | None = None) -> dict:
    """Run the graph with a SQLite checkpointer (durability "sync": each finished node is on disk
    before the next starts, so a killed run resumes where it was); returns the summary
    (agent.workflow.state.summarise). `resume` continues the latest interrupted run of the same
    target/name/output dir; a fresh run gets a new thread. `stop_after` ends the run after that
    node (e.g. "render": a recipe written, not run); `--resume` would continue it. `options`: the
    run options, in the graph's config (a state that holds them, as the benchmarks and tests build
    it, gives them up to the config)."""
    state = dict(state)
    options = {**{k: state.pop(k) for k in OPTION_KEYS if k in state}, **(options or {})}
    output_dir = Path(state.get("output_dir") or "models").resolve()
    key = thread_key(state)
    home = checkpoint_home(state)
    with folder_lock.released_at_end():    # the recipe folder's lock (agent.folder_lock), whoever takes it
        if home != output_dir:             # a recipe, repaired or measured in place: its folder, before any write
            folder_lock.hold(home, "run it")
        return _run_with_store(state, resume, stop_after, key, home, output_dir, options)


def _run_with_store(state, resume, stop_after, key, home, output_dir, options) -> dict:
    user_tree(home, "the output folder", create=True)
    store = store_dir(home, output_dir)

    threads_file = store / "threads.json"
    db = store / "checkpoints.sqlite"
    for path in (threads_file, db):
        if path.is_symlink():
            raise _unreadable_store(path, "it is a symlink", False)
        if os.path.lexists(path) and not path.is_file():     # a folder, a FIFO, a socket in its place
            raise _unreadable_store(path, "it is not a regular file", False)
    lock = _hold_run_lock(store / ("run.lock" if home != output_dir else f"run-{key}.lock"), state,
                          store_root(home, store))
    finished = []
    try:
        return _run_locked(state, resume, stop_after, key, home, output_dir, threads_file, db, options, finished)
    finally:
        os.close(lock)
        if finished and store.parent.parent.name == "checkouts":
            _drop_finished_store(store)


def _drop_finished_store(store: Path) -> None:
    """A checkout migration's store outside the checkout (store_dir) once its run has ended (nothing to
    resume): removed unless another run of the same output dir holds its lock meanwhile."""
    import shutil

    held = []
    try:
        for lock_file in store.glob("run-*.lock"):
            fd = os.open(lock_file, os.O_RDWR)
            held.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        shutil.rmtree(store.parent, ignore_errors=True)
    except (BlockingIOError, OSError):
        pass          # another run is in progress: its store stays
    finally:
        for fd in held:
            os.close(fd)


def _run_locked(state, resume, stop_after, key, home, output_dir, threads_file, db, options, finished=None) -> dict:
    """run_migration, under the run's lock; `finished` gets True appended when the run ended (no node left)."""
    app = compiled_graph(db)
    threads = _load_threads(threads_file, resume)
    if home == output_dir and (folder := _migration_folder(state, output_dir)) is not None:
        # the folder this migration writes, locked from its start to its end (released_at_end): a rollback or
        # another writer of it waits or is refused for the whole command, not only once acquire named it
        folder_lock.hold(folder, "run it")
    invoke = functools.partial(app.invoke, durability="sync", interrupt_after=[stop_after] if stop_after else None)
    try:
        if resume and key in threads:
            config = {"configurable": {**options, "thread_id": threads[key]}, "recursion_limit": RECURSION_LIMIT}
            snapshot = app.get_state(config)
            _check_resumed_state(snapshot.values or {}, db)
            if (snapshot.values or {}).get("recipe_dir") and snapshot.next:
                folder_lock.hold(Path(snapshot.values["recipe_dir"]), "resume it")   # the folder it goes on writing
            if snapshot.next:
                print(f"[migrator] resuming at {', '.join(snapshot.next)}", file=sys.stderr)
                return summarise(invoke(None, config))
            print("[migrator] the last run of this target finished; nothing to resume", file=sys.stderr)
            return summarise(snapshot.values)
        if resume:
            print("[migrator] no interrupted run of this target: starting from the beginning", file=sys.stderr)
        elif key in threads and home == output_dir:
            _refuse_replacing_interrupted(app, threads[key])
        threads[key] = f"{key}-{uuid.uuid4().hex[:8]}"
        if home != output_dir:
            start_backup_run(home, threads[key])   # a fresh run's rounds start at 1; earlier ones are kept
        atomic_write(threads_file, json.dumps(threads, indent=2).encode(), root=store_root(home, threads_file.parent),
                     what="the run's state folder")
        config = {"configurable": {**options, "thread_id": threads[key]}, "recursion_limit": RECURSION_LIMIT}
        result = summarise(invoke(state, config))
        if finished is not None and not app.get_state(config).next:
            finished.append(True)
        return result
    except UnsafeStoreError as exc:
        raise _unreadable_store(db, str(exc), resume) from None
    except sqlite3.DatabaseError as exc:
        fault = errors.filesystem_fault(exc, db)     # disk full / read-only / removed: the store is fine
        if fault is not None:
            raise fault from None
        raise _unreadable_store(db, f"{exc.__class__.__name__}: {exc}", False) from None
