"""A migration's recipe appears whole or not at all, and a killed one is continued or undone by every command
(agent/workflow/store.py, the vendor and render nodes, agent/recipe/registry.py).

A SIGKILL cannot be caught, so "killed" here is the undecorated node stopped by an exception nobody handles
(what the kill leaves is what the node had written), then the node run again as --resume runs it (the same
thread) or as a fresh run does (vendor first). The real kills are tests/e2e/test_framework_target.py's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent import errors
from agent.recipe.registry import RECORD, register, registered_names, unregister
from agent.workflow import nodes
from agent.workflow.store import staging_dir


class Killed(BaseException):
    """What SIGKILL does to a node, in process: it stops where it is and nothing cleans up."""


def _state(checkpoint: Path, out: Path) -> dict:
    return {"target": str(checkpoint), "model_dir": str(checkpoint), "model_name": "m", "model_source": str(checkpoint),
            "recipe_dir": str(out / "m"), "recipe_target": "standalone", "output_dir": str(out), "transformers": {},
            "max_new_tokens": 4}


def _config(thread: str) -> dict:
    return {"configurable": {"thread_id": thread, "device": "cpu"}}


def _vendored(state: dict) -> dict:
    return {**state, **nodes.node_vendor(state)}


def test_nothing_appears_in_the_output_folder_until_the_whole_recipe_is_published(tiny_checkpoints, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    state = _vendored(_state(tiny_checkpoints("llama"), out))
    assert sorted(p.name for p in out.iterdir()) == [".migrator"]        # the store only: no recipe folder yet
    assert (staging_dir(out / "m") / "models").is_dir()
    rendered = nodes.node_render(state, config=_config("t1"))
    recipe = out / "m"
    assert (recipe / "infer.sh").is_file() and (recipe / "models").is_dir() and "infer.sh" in rendered["rendered"]
    assert not staging_dir(recipe).exists() or not any(staging_dir(recipe).iterdir())


@pytest.mark.parametrize("then", ["resume", "fresh_run"])
def test_a_render_killed_halfway_leaves_nothing_and_is_continued(tiny_checkpoints, tmp_path, monkeypatch, then):
    out = tmp_path / "out"
    out.mkdir()
    state = _vendored(_state(tiny_checkpoints("llama"), out))
    real_render = nodes.render_recipe

    def half(recipe_dir, context, family, target, write_to):
        (Path(write_to) / "infer.sh").write_text("#!/bin/bash\necho half")       # one file, torn
        raise Killed()

    monkeypatch.setattr(nodes, "render_recipe", half)
    with pytest.raises(Killed):
        nodes.node_render.__wrapped__(state, config=_config("t1"))
    assert not (out / "m").exists()                          # the output folder holds no part of it
    monkeypatch.setattr(nodes, "render_recipe", real_render)
    if then == "fresh_run":                                 # the same command without --resume: vendor again
        state = _vendored(_state(tiny_checkpoints("llama"), out))
    nodes.node_render(state, config=_config("t1" if then == "resume" else "t2"))
    assert "echo half" not in (out / "m" / "infer.sh").read_text()


def test_a_render_killed_after_publishing_answers_the_same_when_resumed(tiny_checkpoints, tmp_path):
    """The kill came after the recipe was published but before the store saved the node: --resume runs render
    again on the published recipe; it answers what it answered, writes nothing. Another run is refused."""
    out = tmp_path / "out"
    out.mkdir()
    state = _vendored(_state(tiny_checkpoints("llama"), out))
    first = nodes.node_render(state, config=_config("t1"))
    before = {p: p.read_bytes() for p in (out / "m").rglob("*") if p.is_file()}
    again = nodes.node_render(state, config=_config("t1"))
    assert again["rendered"] == first["rendered"]
    assert {p: p.read_bytes() for p in (out / "m").rglob("*") if p.is_file()} == before
    with pytest.raises(errors.InputError, match="cannot be put in place"):
        nodes.node_render(_vendored(state), config=_config("another-run"))
    assert {p: p.read_bytes() for p in (out / "m").rglob("*") if p.is_file()} == before


# ---- the checkpoint a migration writes for its recipe to run (a conversion, --quantize's output, a view) ----------
def _with_run_checkpoint(tiny_checkpoints, out: Path) -> tuple[dict, Path]:
    """What node_acquire leaves for a converted checkpoint: the recipe folder holding only its run checkpoint."""
    import shutil

    from agent.recipe.targets import run_checkpoints_dir

    checkpoint = run_checkpoints_dir(out / "m") / "bfloat16"
    shutil.copytree(tiny_checkpoints("llama"), checkpoint)
    return {**_state(tiny_checkpoints("llama"), out), "model_dir": str(checkpoint)}, checkpoint


def test_the_run_checkpoint_is_published_with_the_recipe_and_a_kill_between_is_continued(tiny_checkpoints, tmp_path,
                                                                                          monkeypatch):
    """The staged recipe is renamed onto a folder that already holds the run checkpoint (written on the recipe's
    filesystem before the recipe exists): it takes the checkpoint into its state folder first. A kill between the
    two renames leaves the checkpoint in the staging folder; --resume puts it back and publishes."""
    import os

    from agent.workflow import store

    out = tmp_path / "out"
    out.mkdir()
    state, checkpoint = _with_run_checkpoint(tiny_checkpoints, out)
    state = _vendored(state)
    staging, rename = staging_dir(out / "m"), os.rename

    def killed_before_the_recipe_lands(src, dst, *args, **kwargs):
        if Path(src) == staging:
            raise Killed()
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(store.os, "rename", killed_before_the_recipe_lands)
    with pytest.raises(Killed):
        nodes.node_render.__wrapped__(state, config=_config("t1"))
    monkeypatch.setattr(store.os, "rename", rename)
    assert not (out / "m").exists() and (staging / ".migrator" / "checkpoints" / "bfloat16" / "config.json").is_file()
    nodes.node_render(state, config=_config("t1"))                      # --resume
    assert (out / "m" / "infer.sh").is_file() and (checkpoint / "model.safetensors").is_file()
    assert str(checkpoint) in next((out / "m" / "config").glob("*.yaml")).read_text()
    with pytest.raises(errors.InputError, match="cannot be put in place"):      # a published recipe: not merged
        nodes.node_render(_vendored(state), config=_config("another-run"))


def test_a_failed_render_or_a_fresh_run_takes_back_the_run_checkpoint_an_unpublished_migration_wrote(
        tiny_checkpoints, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    state, _ = _with_run_checkpoint(tiny_checkpoints, out)
    state = _vendored(state)

    def broken(*args, **kwargs):
        raise RuntimeError("template error")

    monkeypatch.setattr(nodes, "render_recipe", broken)
    with pytest.raises(RuntimeError):
        nodes.node_render(state, config=_config("t1"))
    assert not (out / "m").exists()              # nothing in the output folder blocks the next run
    # a migration killed after acquire: a fresh run (its lock is ours) makes the run checkpoint again
    from agent import folder_lock

    _with_run_checkpoint(tiny_checkpoints, out)
    with folder_lock.released_at_end():
        acquired = nodes.node_acquire({"target": str(tiny_checkpoints("llama")), "name": "m", "output_dir": str(out),
                                       "recipe_target": "standalone", "transformers_source": None})
    assert acquired["model_dir"] == str(tiny_checkpoints("llama")) and not (out / "m").exists()
    assert "removing the checkpoint an interrupted migration wrote" in capsys.readouterr().err
    # anything else in the folder is not a leftover of ours: refused as before
    (out / "m").mkdir()
    (out / "m" / "notes.txt").write_text("mine")
    with folder_lock.released_at_end(), pytest.raises(errors.InputError, match="already exists"):
        nodes.node_acquire({"target": str(tiny_checkpoints("llama")), "name": "m", "output_dir": str(out),
                            "recipe_target": "standalone", "transformers_source": None})
    assert (out / "m" / "notes.txt").read_text() == "mine"


# ---- the registry line: recorded before it is written, registered once, only under the recipe's lock -------
def _checkout(tmp_path: Path) -> tuple[Path, Path, bytes]:
    checkout = tmp_path / "co"
    registry = checkout / "executor" / "core" / "support_models.py"
    registry.parent.mkdir(parents=True)
    original = b'_specs = {\n    "qwen": [("models.qwen.models.modeling_qwen", "Qwen")],\n}\n'
    registry.write_bytes(original)
    state = checkout / "models" / "m" / "res" / ".migrator"
    state.mkdir(parents=True)
    return registry, state, original


ENTRY = [("models.m.models.modeling_m", "MForCausalLM"), ("models.m.models.configuration_m", "MConfig")]


def test_registering_again_after_a_kill_adds_the_line_once_and_rollback_takes_it_out(tmp_path, monkeypatch):
    registry, state, original = _checkout(tmp_path)
    checkout = registry.parents[2]
    from engine.safe_write import UserTree

    real_write = UserTree.write_bytes

    def killed_at_the_registry(self, path, *args, **kwargs):
        if Path(path) == registry:
            raise Killed()
        return real_write(self, path, *args, **kwargs)

    monkeypatch.setattr(UserTree, "write_bytes", killed_at_the_registry)
    with pytest.raises(Killed):                       # killed between the record and the registry's write
        register(checkout, "m", ENTRY, state)
    monkeypatch.setattr(UserTree, "write_bytes", real_write)
    assert registry.read_bytes() == original and (state / RECORD).is_file()
    register(checkout, "m", ENTRY, state)           # --resume: registers
    register(checkout, "m", ENTRY, state)           # killed after the write, resumed: the line is its own
    assert registry.read_bytes().count(b'"m": [') == 1 and "m" in registered_names(registry)
    assert unregister(state) == registry and registry.read_bytes() == original


def test_a_record_whose_line_never_landed_is_undone_without_touching_the_registry(tmp_path):
    registry, state, original = _checkout(tmp_path)
    register(registry.parents[2], "m", ENTRY, state)
    registry.write_bytes(original)                    # as a kill before the registry's write leaves it
    assert unregister(state) is None and registry.read_bytes() == original
    assert (state / (RECORD + ".undone")).is_file()


def _hold(path: Path, namespace: str = "this") -> subprocess.Popen:
    from locations import REPO_ROOT
    from pid_namespace import in_other_pid_namespace

    command = [sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
               "from agent import folder_lock\nfolder_lock.hold(Path(sys.argv[1]), 'run it')\n"
               "print('held', flush=True)\ntime.sleep(float(sys.argv[2]))\n", str(path), "600"]
    holder = subprocess.Popen(in_other_pid_namespace(command) if namespace == "other" else command,
                              stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.parametrize("holder_namespace", ["this", "other"])
def test_nothing_takes_a_recipes_registry_line_while_another_command_holds_the_recipe(tmp_path, capsys,
                                                                                      holder_namespace):
    """A rollback ran during a framework migration and took its registry line out: the registry line of a recipe
    is changed only by the holder of the recipe's folder lock, whoever calls it, whatever pid namespace the
    holder runs in (the lock is an flock on a file both see)."""
    from agent.cli import main

    registry, state, original = _checkout(tmp_path)
    register(registry.parents[2], "m", ENTRY, state)
    registered = registry.read_bytes()
    recipe = state.parent.parent
    holder = _hold(recipe, holder_namespace)
    try:
        with pytest.raises(errors.MigratorError) as refused:
            unregister(state)
        assert refused.value.exit_code == errors.EXIT_BUSY
        capsys.readouterr()
        assert main(["rollback", str(recipe)]) == errors.EXIT_BUSY
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(lines) == 1 and "being written by another migrator command" in lines[0], lines
        # a pid of another namespace means nothing here: the holder is named by where it runs
        assert ("in another pid namespace" in lines[0]) == (holder_namespace == "other"), lines
        assert bool(re.search(r"\(pid \d+: ", lines[0])) == (holder_namespace == "this"), lines
        assert registry.read_bytes() == registered
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 30          # the namespace's process dies with its unshare, a moment later
    while True:
        try:
            assert unregister(state) == registry and registry.read_bytes() == original      # once it ended
            break
        except errors.MigratorError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_a_registry_edit_waits_for_another_recipes_edit_of_the_same_registry(tmp_path):
    """Two migrations into one checkout: each holds its own recipe, and both edit support_models.py; the second
    waits for the first (a read-modify-write would lose a line), never refused for a short edit."""
    import time

    registry, state, _ = _checkout(tmp_path)
    from locations import REPO_ROOT

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
                               "from agent import folder_lock\nfolder_lock.hold(Path(sys.argv[1]), 'register')\n"
                               "print('held', flush=True)\ntime.sleep(1.5)\n", str(registry)],
                              stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        register(registry.parents[2], "m", ENTRY, state)
        assert time.monotonic() - start > 0.5 and "m" in registered_names(registry)
    finally:
        holder.kill()
        holder.wait()
