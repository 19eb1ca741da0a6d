"""engine/safe_write.py is the one way the migrator writes a user's files (SPEC §6): every write, rename,
delete, mkdir and chmod into a recipe, a checkout, a checkpoint folder or a cache we fill goes through a
UserTree anchored at that folder (the walk that fails on any direct write elsewhere:
tests/lint/test_writes_through_safe_write.py). A table builds link variants nobody listed (names, depths,
symlink vs hard link vs a linked folder, a link at the top vs in the middle) and none gets a byte outside its
root."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from engine.safe_write import UserTree, WriteRefused, tree_of


# ---- the class: links out of the root, by kind, name and depth ----------------------------------------
def _snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under `root` (links not followed): kind, bytes, permission bits, link target."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            body = os.readlink(path) if path.is_symlink() else path.read_bytes() if stat.S_ISREG(st.st_mode) else None
            found[path.relative_to(root).as_posix()] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), body)
    return found


def _outside(tmp: Path) -> Path:
    outside = tmp / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "victim.txt").write_bytes(b"the user's own file\n")
    (outside / "sub" / "f.txt").write_bytes(b"shared\n")
    os.chmod(outside / "victim.txt", 0o640)
    return outside


def _folder_link(kind: str):
    """Setup of a folder link at `at` (inside the root) that leads out of it."""
    def make(root: Path, at: Path, outside: Path) -> None:
        at.parent.mkdir(parents=True, exist_ok=True)
        if kind == "absolute":
            at.symlink_to(outside, target_is_directory=True)
        elif kind == "relative":
            at.symlink_to(os.path.relpath(outside, at.parent), target_is_directory=True)
        elif kind == "chain":             # the first hop stays inside, the second leaves
            (root / ".hop").symlink_to(outside, target_is_directory=True)
            at.symlink_to(os.path.relpath(root / ".hop", at.parent), target_is_directory=True)
        elif kind == "up":                # a bind-like link to the root's own parent
            at.symlink_to(os.path.relpath(root.parent, at.parent), target_is_directory=True)
        elif kind == "to_root_of_fs":
            at.symlink_to("/", target_is_directory=True)
    return make


FOLDER_LINKS = ["absolute", "relative", "chain", "up", "to_root_of_fs"]
NAMES = [".migrator", "res", "config", "baseline", "models", "x y", "ünï", "-rf"]
DEPTHS = [(), ("a",), ("a", "b", "c")]
OPERATIONS = {
    "write_bytes": lambda t, p: t.write_bytes(p, b"x"),
    "write_text": lambda t, p: t.write_text(p, "x"),
    "open_w": lambda t, p: t.open(p, "w").close(),
    "open_a": lambda t, p: t.open(p, "ab").close(),
    "append": lambda t, p: t.append_bytes(p, b"x"),
    "mkdir": lambda t, p: t.mkdir(p),
    "unlink": lambda t, p: t.unlink(p),
    "rmtree": lambda t, p: t.rmtree(p.parent),
    "replace_into": lambda t, p: t.replace(t.root / "mine.txt", p),
    "chmod": lambda t, p: t.chmod(p, 0o777),
    "copy": lambda t, p: t.copy(t.root / "mine.txt", p),
    "symlink": lambda t, p: t.symlink("/etc/passwd", p),
    "write_with": lambda t, p: t.write_with(p, lambda tmp: Path(tmp).write_bytes(b"x")),
    "open_lock": lambda t, p: os.close(t.open_lock(p)),
}


def _cases():
    for kind in FOLDER_LINKS:
        for i, name in enumerate(NAMES):
            depth = DEPTHS[i % len(DEPTHS)]
            for op in OPERATIONS:
                yield pytest.param(kind, name, depth, op, id=f"{kind}-{name}-{len(depth)}-{op}")


@pytest.mark.parametrize("kind, name, depth, op", list(_cases()))
def test_a_folder_link_out_of_the_root_is_refused_before_anything_is_written(tmp_path, kind, name, depth, op):
    outside = _outside(tmp_path)
    root = tmp_path / "recipe"
    root.mkdir()
    (root / "mine.txt").write_bytes(b"mine\n")
    link = root.joinpath(*depth, name)
    _folder_link(kind)(root, link, outside)
    before_out, before_root = _snapshot(outside), _snapshot(root)
    target = link / "sub" / "f.txt"
    with pytest.raises(WriteRefused) as info:
        OPERATIONS[op](UserTree(root, "the recipe"), target)
    line = str(info.value)
    assert "\n" not in line and "outside the recipe" in line, line
    shown = link.relative_to(root).as_posix() if kind != "chain" else None
    assert shown is None or line.startswith(f"{shown} is a symlink"), line
    assert _snapshot(outside) == before_out
    assert _snapshot(root) == before_root


FILE_LINKS = {
    "symlink_abs": lambda at, victim: at.symlink_to(victim),
    "symlink_rel": lambda at, victim: at.symlink_to(os.path.relpath(victim, at.parent)),
    "symlink_dangling": lambda at, victim: at.symlink_to(victim.with_name("not_yet.txt")),
}


@pytest.mark.parametrize("op", list(OPERATIONS))
@pytest.mark.parametrize("link", list(FILE_LINKS))
@pytest.mark.parametrize("rel", ["support_models.py", "config/x.yaml", ".migrator/runs/running.pids", "a/b/c/d/e.py"])
def test_a_file_linked_out_of_the_root_is_neither_written_through_nor_detached(tmp_path, op, link, rel):
    outside = _outside(tmp_path)
    root = tmp_path / "recipe"
    (root / rel).parent.mkdir(parents=True)
    (root / "mine.txt").write_bytes(b"mine\n")
    FILE_LINKS[link](root / rel, outside / "victim.txt")
    before_out, before_root = _snapshot(outside), _snapshot(root)
    with pytest.raises(WriteRefused) as info:
        target = root / rel
        OPERATIONS[op](UserTree(root, "the recipe"), target if op != "rmtree" else target / "x")
    assert str(info.value).startswith(f"{rel} is a symlink") or op == "rmtree", str(info.value)
    assert _snapshot(outside) == before_out and _snapshot(root) == before_root


# what a hard-linked file becomes: replaced by a file of its own (write-and-rename), or refused
HARD_LINK_OUTCOME = {"write_bytes": "replaced", "write_text": "replaced", "open_w": "replaced", "copy": "replaced",
                     "write_with": "replaced", "chmod": "replaced", "replace_into": "replaced", "symlink": "replaced",
                     "unlink": "removed", "rmtree": "removed", "open_a": "refused", "append": "refused",
                     "open_lock": "refused", "mkdir": "refused"}


@pytest.mark.parametrize("op", list(OPERATIONS))
@pytest.mark.parametrize("rel", ["executor/core/support_models.py", "config/qwen.yaml", "README.md"])
def test_a_hard_linked_file_is_never_edited_in_place(tmp_path, op, rel):
    outside = _outside(tmp_path)
    root = tmp_path / "recipe"
    (root / rel).parent.mkdir(parents=True)
    (root / "mine.txt").write_bytes(b"mine\n")
    os.link(outside / "victim.txt", root / rel)
    before_out = _snapshot(outside)
    tree = UserTree(root, "the recipe")
    outcome = HARD_LINK_OUTCOME[op]
    if outcome == "refused":
        with pytest.raises((WriteRefused, FileExistsError)) as info:
            OPERATIONS[op](tree, root / rel)
        assert "\n" not in str(info.value)
    else:
        OPERATIONS[op](tree, root / rel if op != "rmtree" else root / rel / "x")
    assert _snapshot(outside) == before_out, op
    assert (outside / "victim.txt").stat().st_nlink == (1 if outcome in ("replaced", "removed") else 2)


def test_links_that_stay_inside_are_followed_and_the_root_may_be_a_link(tmp_path):
    real = tmp_path / "real_recipe"
    (real / "shared").mkdir(parents=True)
    (real / "config").symlink_to("shared", target_is_directory=True)      # inside: fine
    (real / "shared" / "x.yaml").write_text("a: 1\n")
    (real / "y.yaml").symlink_to("shared/x.yaml")
    named = tmp_path / "named"
    named.symlink_to(real, target_is_directory=True)                     # the folder the user named is a link
    tree = UserTree(named, "the recipe")
    tree.write_text(named / "config" / "x.yaml", "a: 2\n")
    tree.write_text("y.yaml", "a: 3\n")                                  # relative to the root; through an inner link
    assert (real / "shared" / "x.yaml").read_text() == "a: 3\n" and (real / "y.yaml").is_symlink()
    tree.mkdir(named / "config" / "deep" / "er")
    assert (real / "shared" / "deep" / "er").is_dir()


@pytest.mark.parametrize("path", ["../escape.txt", "/etc/x", "a/../../escape.txt"])
def test_a_path_outside_the_root_by_name_is_refused(tmp_path, path):
    root = tmp_path / "recipe"
    root.mkdir()
    with pytest.raises(WriteRefused, match="not inside the recipe"):
        UserTree(root, "the recipe").write_text(path, "x")
    assert not (tmp_path / "escape.txt").exists()


def test_a_folder_swapped_for_a_link_after_the_check_is_refused(tmp_path, monkeypatch):
    """The O_NOFOLLOW walk: a folder replaced by a link between the check and the write is not followed."""
    outside = _outside(tmp_path)
    root = tmp_path / "recipe"
    (root / "config").mkdir(parents=True)
    tree = UserTree(root, "the recipe")
    checked = UserTree.resolve

    def swap_after_check(self, path, *args, **kwargs):
        real = checked(self, path, *args, **kwargs)
        if (root / "config").is_dir() and not (root / "config").is_symlink():
            os.rmdir(root / "config")
            (root / "config").symlink_to(outside, target_is_directory=True)
        return real

    monkeypatch.setattr(UserTree, "resolve", swap_after_check)
    before = _snapshot(outside)
    with pytest.raises(WriteRefused, match="changed while the migrator wrote"):
        tree.write_text(root / "config" / "victim.txt", "x")
    assert _snapshot(outside) == before


@pytest.mark.parametrize("mode, expected", [(0o4755, 0o755), (0o2775, 0o775), (0o1777, 0o777), (0o7777, 0o777),
                                            (0o100644, 0o644), (0o600, 0o600)])
def test_modes_are_permission_bits_only(tmp_path, mode, expected):
    tree = UserTree(tmp_path, "the recipe")
    tree.write_bytes(tmp_path / "w.sh", b"x", mode)
    tree.write_bytes(tmp_path / "c.sh", b"x")
    tree.chmod(tmp_path / "c.sh", mode)
    src = tmp_path / "src.sh"
    src.write_bytes(b"x")
    os.chmod(src, mode & 0o7777)
    tree.copy(src, tmp_path / "copied.sh")
    for name in ("w.sh", "c.sh", "copied.sh"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == expected, name


def test_a_write_leaves_no_temporary_file_behind_when_the_writer_fails(tmp_path):
    tree = UserTree(tmp_path, "the recipe")

    def fails(tmp):
        Path(tmp).write_bytes(b"half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        tree.write_with(tmp_path / "dump.pt", fails)
    assert list(tmp_path.iterdir()) == []


def test_tree_of_a_file_refuses_a_link_out_of_its_folder(tmp_path):
    outside = _outside(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "pids").symlink_to(outside / "victim.txt")
    with pytest.raises(WriteRefused, match="pids is a symlink"):
        tree_of(tmp_path / "d" / "pids").write_bytes(tmp_path / "d" / "pids", b"{}")
    assert (outside / "victim.txt").read_bytes() == b"the user's own file\n"


# ---- the cases #31 named, through the code that writes them -------------------------------------------
from types import SimpleNamespace  # noqa: E402

from agent.recipe.fs_guard import WriteOutsideRecipe  # noqa: E402

REGISTRY_TEXT = b'_specs = {\n    "qwen": [\n        ("models.qwen.models.modeling_qwen", "QwenForCausalLM"),\n    ],\n}\n'


def _checkout(tmp: Path) -> Path:
    checkout = tmp / "checkout"
    (checkout / "executor" / "core").mkdir(parents=True)
    (checkout / "executor" / "scripts").mkdir(parents=True)
    (checkout / "executor" / "scripts" / "infer.sh").write_text("#!/bin/bash\n")
    (checkout / "executor" / "core" / "support_models.py").write_bytes(REGISTRY_TEXT)
    (checkout / "models" / "mine" / "config").mkdir(parents=True)
    return checkout


# (where the recipe is, which folder of it links out): the runs folder and every folder above it
RUN_LINKS = [("standalone", ".migrator/runs"), ("standalone", ".migrator"),
             ("checkout", "res/.migrator/runs"), ("checkout", "res/.migrator"), ("checkout", "res")]


@pytest.mark.parametrize("where, linked", RUN_LINKS)
@pytest.mark.parametrize("kind", ["absolute", "up"])
def test_a_trial_run_through_a_linked_runs_folder_is_refused_before_it_starts(tmp_path, where, linked, kind):
    """`.migrator/runs` (or `res/.migrator/runs` of an upstream recipe) linked out of the recipe: exit 2
    naming the link before the run starts; no log, no parity dump, no pids file outside."""
    from agent.recipe.recipe import RunPlan
    from agent.run.trial_run import trial_run

    outside = _outside(tmp_path)
    recipe = tmp_path / "recipe" if where == "standalone" else _checkout(tmp_path) / "models" / "mine"
    (recipe / "config").mkdir(parents=True, exist_ok=True)
    (recipe / "config" / "x.yaml").write_text("a: 1\n")
    _folder_link(kind)(recipe, recipe / linked, outside)
    before = _snapshot(outside), _snapshot(tmp_path / "recipe" if where == "standalone" else tmp_path / "checkout")
    with pytest.raises(WriteOutsideRecipe) as info:
        trial_run(SimpleNamespace(path=recipe), "trial0", RunPlan(recipe / "config" / "x.yaml", 1))
    assert info.value.exit_code == 2 and str(info.value).startswith(f"{linked} is a symlink"), str(info.value)
    assert before == (_snapshot(outside), _snapshot(tmp_path / "recipe" if where == "standalone"
                                                     else tmp_path / "checkout"))
    assert not list(tmp_path.rglob("output.txt")) and not list(tmp_path.rglob("running.pids"))


@pytest.mark.parametrize("linked", ["res", "res/.migrator", "res/.migrator/standin"])
def test_the_tiny_checkpoint_is_not_built_through_a_linked_res(tmp_path, linked):
    """`--standin --tiny` builds its checkpoint under res/.migrator/standin/: a link out of the recipe on
    the way is refused before a byte of the checkpoint is written."""
    from agent.run.standin import build_tiny

    outside = _outside(tmp_path)
    recipe = _checkout(tmp_path) / "models" / "mine"
    _folder_link("absolute")(recipe, recipe / linked, outside)
    before = _snapshot(outside)
    with pytest.raises(WriteOutsideRecipe) as info:
        build_tiny(SimpleNamespace(path=recipe), "llama")
    assert str(info.value).startswith(f"{linked} is a symlink"), str(info.value)
    assert _snapshot(outside) == before


@pytest.mark.parametrize("link", ["symlink", "relative_symlink", "hard_link", "linked_core_folder"])
def test_the_checkout_registry_is_never_edited_through_a_link(tmp_path, link):
    """executor/core/support_models.py (or executor/core/) linked to a file outside the checkout: a symlink
    is refused (exit 2, nothing written, not even our record); a hard link is replaced by a file of the
    checkout's own, so the other name keeps its bytes through register and unregister."""
    from agent.recipe.registry import register, registered_names, unregister
    from agent.recipe.targets import state_dir

    checkout = _checkout(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shared = outside / "support_models.py"
    registry = checkout / "executor" / "core" / "support_models.py"
    os.replace(registry, shared)
    if link == "symlink":
        registry.symlink_to(shared)
    elif link == "relative_symlink":
        registry.symlink_to(os.path.relpath(shared, registry.parent))
    elif link == "hard_link":
        os.link(shared, registry)
    else:
        (checkout / "executor" / "core").rename(outside / "core")
        os.replace(shared, outside / "core" / "support_models.py")
        shared = outside / "core" / "support_models.py"
        (checkout / "executor" / "core").symlink_to(outside / "core", target_is_directory=True)
    recipe = checkout / "models" / "mine"
    before_out, before_recipe = _snapshot(outside), _snapshot(recipe)
    classes = [("models.mine.models.modeling_mine", "MineForCausalLM")]
    if link != "hard_link":
        with pytest.raises(WriteOutsideRecipe) as info:
            register(checkout, "mine", classes, state_dir(recipe))
        assert info.value.exit_code == 2 and "is a symlink" in str(info.value) and "\n" not in str(info.value)
        assert _snapshot(outside) == before_out and _snapshot(recipe) == before_recipe
        return
    register(checkout, "mine", classes, state_dir(recipe))
    assert "mine" in registered_names(registry) and shared.read_bytes() == REGISTRY_TEXT
    assert registry.stat().st_nlink == 1 and shared.stat().st_nlink == 1
    unregister(state_dir(recipe))
    assert registry.read_bytes() == REGISTRY_TEXT and _snapshot(outside) == before_out


@pytest.mark.parametrize("edit", ["edit_yaml_line", "write_source", "restore_formats"])
def test_a_hard_linked_recipe_yaml_is_repaired_as_a_copy_and_rolled_back(tmp_path, edit):
    """A recipe YAML hard-linked to a file outside: the repair writes the recipe's own copy (the file
    outside keeps its bytes), and rollback restores the recipe's side to what it was."""
    from agent.recipe.backup import backup_round, rollback
    from agent.recipe.textfile import restore_formats, write_source
    from agent.repair.rules._util import edit_yaml_line

    outside = tmp_path / "shared"
    outside.mkdir()
    original = b"model_config:\r\n  dtype: float16\r\n"
    (outside / "x.yaml").write_bytes(original)
    recipe = tmp_path / "recipe"
    (recipe / "config").mkdir(parents=True)
    (recipe / "infer.sh").write_text("#!/bin/bash\n")
    yaml_file = recipe / "config" / "x.yaml"
    os.link(outside / "x.yaml", yaml_file)
    with backup_round(recipe, 1):
        if edit == "edit_yaml_line":
            edit_yaml_line(yaml_file, "model_config", "dtype", "float32", root=recipe)
        elif edit == "write_source":
            write_source(yaml_file, "model_config:\n  dtype: float32\n", root=recipe)
        else:
            snap = {"config/x.yaml": (yaml_file.read_bytes(), yaml_file.stat().st_mode & 0o777)}   # before the fix
            UserTree(recipe).write_bytes(yaml_file, b"model_config:\n  dtype: float32\n")
            restore_formats(recipe, snap)
    assert b"float32" in yaml_file.read_bytes()
    assert (outside / "x.yaml").read_bytes() == original and (outside / "x.yaml").stat().st_nlink == 1
    rollback(recipe)
    assert yaml_file.read_bytes() == original and (outside / "x.yaml").read_bytes() == original


def test_a_journal_is_never_appended_through_a_hard_link(tmp_path):
    from agent.recipe.backup import RoundBackup

    recipe = tmp_path / "recipe"
    recipe.mkdir()
    (recipe / "infer.sh").write_text("#!/bin/bash\n")
    round_backup = RoundBackup(recipe, 1)
    victim = tmp_path / "victim"
    victim.write_bytes(b"")
    round_backup.journal.unlink()
    os.link(victim, round_backup.journal)
    with pytest.raises(WriteRefused, match="other hard link"):
        round_backup.save("infer.sh")
    assert victim.read_bytes() == b""


def test_run_of_a_recipe_whose_runs_folder_links_out_is_exit_2_naming_the_link(working_recipe, tmp_path):
    """End to end, as a user sees it: `migrator run RECIPE` with .migrator/runs linked to a folder outside
    the recipe is one line, exit 2, naming the link; nothing is written in the folder outside."""
    from migrator_cli import run_cli

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (working_recipe / ".migrator").mkdir(exist_ok=True)
    (working_recipe / ".migrator" / "runs").symlink_to(outside, target_is_directory=True)
    proc = run_cli("run", str(working_recipe), "--device", "cpu")
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("migrator:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and ".migrator/runs is a symlink to" in lines[0], lines
    assert list(outside.iterdir()) == []


# ---- every writer anchored at the root it writes into ------------------------------------------------
# The writers that were handed only a file (a repair's edits, the codemod driver, the state writers, the
# run's own writers), now anchored at the recipe: a link anywhere between the recipe and the file that
# leads out is refused by the tree, by kind, name and depth, before a byte is written.
def _write_source(root: Path, path: Path) -> None:
    from agent.recipe.textfile import write_source
    write_source(path, "model_config:\n  dtype: float32\n", root=root)


def _edit_yaml_line(root: Path, path: Path) -> None:
    from agent.repair.rules._util import edit_yaml_line
    edit_yaml_line(path, "model_config", "dtype", "float32", root=root)


def _rewrite_file(root: Path, path: Path) -> None:
    from agent.codemods.commands.blank_line_whitespace import BlankLineWhitespaceCommand
    from agent.codemods.driver import rewrite_file
    assert rewrite_file(path, [BlankLineWhitespaceCommand], root=root)


def _atomic_write(root: Path, path: Path) -> None:
    from agent.recipe.backup import atomic_write
    atomic_write(path, b"x: 2\n", 0o644, root=root)


def _pids_file(root: Path, path: Path) -> None:
    from agent.processes import stop_leftovers
    stop_leftovers(path, root)


def _run_folder_writer(root: Path, path: Path) -> None:
    """A run's own writer (parity dump, logs, precision records) under the migrator's WRITE_ROOT_ENV."""
    from engine.safe_write import WRITE_ROOT_ENV, run_folder_tree
    old = os.environ.get(WRITE_ROOT_ENV)
    os.environ[WRITE_ROOT_ENV] = str(root)
    try:
        run_folder_tree(path.parent, create=True).write_with(path, lambda tmp: Path(tmp).write_bytes(b"dump"))
    finally:
        os.environ.pop(WRITE_ROOT_ENV) if old is None else os.environ.__setitem__(WRITE_ROOT_ENV, old)


def _report_writer(root: Path, path: Path) -> None:
    from agent.workflow.report import _write
    _write(path, "{}\n", root)


ANCHORED_WRITERS = {
    "write_source": (_write_source, b"model_config:\n  dtype: float16\n"),
    "edit_yaml_line": (_edit_yaml_line, b"model_config:\n  dtype: float16\n"),
    "rewrite_file": (_rewrite_file, b"def f():\n    x = 1\n    \n    return x\n"),
    "atomic_write": (_atomic_write, b"x: 1\n"),
    "stop_leftovers": (_pids_file, b'{"pgid": 1, "pids": {}}'),
    "run_folder_tree": (_run_folder_writer, b"old dump"),
    "report": (_report_writer, b"{\"old\": 1}\n"),
}


def _anchored_cases():
    for w, writer in enumerate(ANCHORED_WRITERS):
        for k, kind in enumerate(FOLDER_LINKS):
            for d, depth in enumerate(DEPTHS):
                name = NAMES[(w + k + d) % len(NAMES)]          # every name meets every writer across the grid
                yield pytest.param(writer, kind, name, depth, id=f"{writer}-{kind}-{name}-{len(depth)}")


@pytest.mark.parametrize("writer, kind, name, depth", list(_anchored_cases()))
def test_a_writer_handed_a_file_refuses_a_link_above_its_folder(tmp_path, writer, kind, name, depth):
    call, content = ANCHORED_WRITERS[writer]
    outside = _outside(tmp_path)
    root = tmp_path / "recipe"
    root.mkdir()
    link = root.joinpath(*depth, name)
    _folder_link(kind)(root, link, outside)
    victim = outside / "sub" / "deep" / "f.txt"          # the file the writer is handed, through the link
    victim.parent.mkdir()
    victim.write_bytes(content)
    target = link / victim.relative_to(os.path.realpath(link))
    assert target.read_bytes() == content                # the writer's own folder is real: only a link above it
    before_out, before_root = _snapshot(outside), _snapshot(root)
    with pytest.raises(WriteRefused) as info:
        call(root, target)
    line = str(info.value)
    assert "\n" not in line and "outside the recipe" in line, line
    assert kind == "chain" or line.startswith(f"{link.relative_to(root).as_posix()} is a symlink"), line
    assert _snapshot(outside) == before_out and _snapshot(root) == before_root


@pytest.mark.parametrize("writer", list(ANCHORED_WRITERS))
def test_an_anchored_writer_still_writes_inside_the_recipe(tmp_path, writer):
    """The same writers on a real folder of the recipe (and through a link that stays inside) write."""
    call, content = ANCHORED_WRITERS[writer]
    root = tmp_path / "recipe"
    (root / "shared" / "deep").mkdir(parents=True)
    (root / "config").symlink_to("shared", target_is_directory=True)
    target = root / "config" / "deep" / "f.txt"
    target.write_bytes(content)
    call(root, target)
    assert not target.exists() if writer == "stop_leftovers" else target.read_bytes() != content
