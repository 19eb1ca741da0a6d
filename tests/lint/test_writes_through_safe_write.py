"""Every write of a user's file goes through engine/safe_write.py (SPEC §6): a walk of the code fails on any
direct write, rename, delete, mkdir or chmod outside that module, but for the allowed places (each with why: a
private temporary folder, the migrator's own lock or store, a place the user named to create). Like
tests/lint/test_loads_through_safe_load.py for loads; the writer's own behaviour:
tests/unit/engine/test_safe_write.py."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from locations import REPO_ROOT


REPO = REPO_ROOT
CODE = ("agent", "engine", "npu_standin", "scripts/collect_baseline.py")
WRITER = REPO / "engine" / "safe_write.py"


OS_WRITES = {"remove", "unlink", "rename", "replace", "renames", "mkdir", "makedirs", "chmod", "lchmod", "chown",
             "lchown", "rmdir", "removedirs", "symlink", "link", "truncate", "utime", "mkfifo", "mknod"}
SHUTIL_WRITES = {"copy", "copy2", "copyfile", "copytree", "move", "rmtree", "copymode", "copystat", "make_archive",
                 "unpack_archive"}
PATH_WRITES = {"write_text", "write_bytes", "touch", "mkdir", "unlink", "rmdir", "symlink_to", "hardlink_to",
               "chmod", "lchmod", "rmtree"}
LIBRARY_WRITES = {"save_pretrained", "to_json_file", "save_file"}          # plus torch.save
OPEN_WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}
TEMP_MAKERS = {"mkstemp", "mkdtemp", "NamedTemporaryFile", "TemporaryDirectory", "TemporaryFile", "SpooledTemporaryFile"}


# Direct writes that are not into a user's folder, each with why ("path::function::call" -> reason). Each
# names a place the migrator owns (a private temporary folder, its own lock or store folder) or one the user
# named on the command line as a place to create; a user's recipe, checkout or checkpoint is never one.
PRIVATE_TMP = "a private temporary folder of the migrator's own (mkdtemp / TemporaryDirectory), removed at its end"
ALLOWED = {
    "agent/cli.py::_internal_error::tempfile.NamedTemporaryFile(dir=...)":
        "the crash report: a new file in the temporary folder outside the tree's own",
    "agent/workflow/inputs.py::check_output_dir::.mkdir()":
        "the --output-dir the user named, created as named; what goes in it is written through user_tree",
    "agent/cli.py::cmd_baseline::.mkdir()": "the folder of the --summary file the user named, created as named",
    "agent/measure/parity.py::shrunk_reference::shutil.copy": PRIVATE_TMP + " (`tiny`, made by its caller)",
    "agent/measure/parity.py::shrunk_reference::.write_text()": PRIVATE_TMP + " (`tiny`, made by its caller)",
    "agent/measure/parity.py::shrunk_reference::.save_pretrained()": PRIVATE_TMP + " (`tiny`, made by its caller)",
    "agent/recipe/fs_guard.py::check_writable::tempfile.TemporaryFile(dir=...)":
        "an unnamed probe file (O_TMPFILE): nothing appears in the folder",
    "agent/folder_lock.py::hold::.mkdir()": "the migrator's own lock folder under XDG_CACHE_HOME (0700)",
    "agent/folder_lock.py::hold::os.open(write flags)": "a lock file in that folder, opened O_NOFOLLOW",
    "agent/processes.py::owned_temp::tempfile.mkdtemp(dir=...)":
        "an owned temporary folder (the temporary folder, or the folder its caller names as its own)",
    "agent/processes.py::owned_temp::.mkdir()": PRIVATE_TMP + " (its work/ folder)",
    "agent/processes.py::owned_temp::shutil.rmtree": PRIVATE_TMP + " (the owned folder, at its end)",
    "agent/processes.py::_hold_owner_lock::os.open(write flags)":
        "the owner lock of that private folder, a new file (O_EXCL, O_NOFOLLOW)",
    "agent/processes.py::_hold_owner_lock::os.rename": "that lock file given its name once it is held",
    "agent/processes.py::remove_orphaned_temp::shutil.rmtree":
        "our own temp folders whose owner is gone (their owner lock is free: owned_temp), never a link or another's",
    "agent/recipe/native/decide.py::selfcheck::.write_text()": PRIVATE_TMP + " (the self-check's job file)",
    "agent/recipe/native/decide.py::checked::.write_text()": PRIVATE_TMP + " (the native file being checked)",
    "agent/workflow/store.py::store_dir::.mkdir()":
        "the per-user private folder (0700, owner checked) under the temporary folder for a checkout migration's store",
    "agent/workflow/store.py::publish::os.rename":
        "the migration's own staging folder (in its store) renamed onto the recipe folder it holds the lock of, "
        "the destination resolved by the output folder's tree first (no link on the way)",
    "agent/workflow/store.py::_adopt_run_checkpoints::os.rename":
        "the run checkpoints this migration wrote in the recipe folder it holds the lock of, renamed into its own "
        "staging folder (a real folder: real_dirs) just before that is renamed onto the recipe folder",
    "agent/workflow/store.py::restore_run_checkpoints::os.rename":
        "the same checkpoints renamed back from the staging folder after a kill, the destination resolved by the "
        "output folder's tree first",
    "agent/workflow/run.py::_drop_finished_store::shutil.rmtree": "that private folder's store, once its run ended",
    "agent/workflow/run.py::_drop_finished_store::os.open(write flags)": "its lock files, opened to test the lock",
    "agent/workflow/run.py::compiled_graph::.mkdir()": "the store folder store_dir made (real_dirs: no symlink)",
    "agent/workflow/run.py::compiled_graph::sqlite3.connect": "SQLite's own file in that store folder (the path was "
                                                              "checked not to be a symlink by _run_with_store)",
    "npu_standin/environment.py::bin_dir::.mkdir()": "a private copy (0700) of the stand-in's guards in the temporary folder",
    "npu_standin/environment.py::bin_dir::shutil.copyfile": "the same private copy",
    "npu_standin/environment.py::bin_dir::.chmod()": "the same private copy",
}


def _is_tree(node: ast.AST, trees: set[str]) -> bool:
    """A receiver that is a UserTree: a name bound from user_tree()/UserTree()/tree_of(), or by convention
    any name or attribute ending in `tree` (tree, recipe_tree, self.tree), or such a call itself."""
    if isinstance(node, ast.Name):
        return node.id in trees or node.id.endswith("tree")
    if isinstance(node, ast.Attribute):
        return node.attr.endswith("tree")
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        return name.endswith(("tree", "tree_of", "UserTree"))
    return False


def _mode(call: ast.Call, position: int) -> str:
    node = call.args[position] if len(call.args) > position else next(
        (k.value for k in call.keywords if k.arg == "mode"), None)
    if node is None:
        return "r"
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else "?"


def _method_open_mode(call: ast.Call) -> str:
    """Path.open(mode): a constant first argument or mode=; a first argument that is no string constant is
    another open (ZipFile.open(member), tarfile's), whose mode, if any, is a keyword."""
    if call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    node = next((k.value for k in call.keywords if k.arg == "mode"), None)
    if node is None:
        return "r"
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else "?"


def _writes_mode(mode: str) -> bool:
    return mode == "?" or any(c in mode for c in "wax+")


def _flag_names(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)} | \
           {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def direct_writes(path: Path, root: Path = REPO) -> list[str]:
    """'file::function:line: call' for each direct write in a Python file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    trees = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and _is_tree(node.value, set())
             for t in node.targets if isinstance(t, ast.Name)}
    modules: dict[str, str] = {}           # local name -> os / shutil / tempfile / torch / io
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ("os", "shutil", "tempfile", "torch", "io", "sqlite3"):
                    modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "shutil"):
            for alias in node.names:
                if alias.name in (OS_WRITES if node.module == "os" else SHUTIL_WRITES):
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def where(node: ast.AST) -> str:
        up = parents.get(node)
        while up is not None and not isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
            up = parents.get(up)
        return f"{path.relative_to(root).as_posix()}::{up.name if up is not None else '<module>'}"

    def in_tree_writer(node: ast.AST) -> bool:
        """A library writer handed to UserTree.write_with / fill_with (it writes the path the tree gives)."""
        up = parents.get(node)
        while up is not None:
            if isinstance(up, ast.Call) and isinstance(up.func, ast.Attribute) and \
                    up.func.attr in ("write_with", "fill_with") and _is_tree(up.func.value, trees):
                return True
            up = parents.get(up)
        return False

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func, what = node.func, None
        if isinstance(func, ast.Name):
            if func.id in ("FileHandler", "RotatingFileHandler"):
                what = f"{func.id}()"
            elif func.id == "open" and _writes_mode(_mode(node, 1)):
                what = f"open(mode={_mode(node, 1)!r})"
            elif modules.get(func.id, "").startswith(("os.", "shutil.")):
                what = modules[func.id]
        elif isinstance(func, ast.Attribute):
            base = modules.get(func.value.id) if isinstance(func.value, ast.Name) else None
            if base == "os" and func.attr in OS_WRITES:
                what = f"os.{func.attr}"
            elif base == "os" and func.attr == "open":
                what = "os.open(write flags)" if _flag_names(node) & OPEN_WRITE_FLAGS else None
            elif base == "os" and func.attr == "fdopen" and _writes_mode(_mode(node, 1)):
                what = "os.fdopen(write)"
            elif base == "io" and func.attr == "open" and _writes_mode(_mode(node, 1)):
                what = "io.open(write)"
            elif base == "shutil" and func.attr in SHUTIL_WRITES:
                what = f"shutil.{func.attr}"
            elif base == "tempfile" and func.attr in TEMP_MAKERS:
                if any(k.arg == "dir" for k in node.keywords):
                    what = f"tempfile.{func.attr}(dir=...)"       # without dir: a private temporary file
            elif base == "torch" and func.attr == "save":
                what = "torch.save"
            elif base == "sqlite3" and func.attr == "connect":
                what = "sqlite3.connect"
            elif func.attr in ("FileHandler", "RotatingFileHandler", "TimedRotatingFileHandler", "WatchedFileHandler"):
                what = f".{func.attr}()"
            elif _is_tree(func.value, trees):
                continue
            elif func.attr in PATH_WRITES:
                what = f".{func.attr}()"
            elif func.attr in ("rename", "replace") and len(node.args) == 1 and not node.keywords:
                what = f".{func.attr}()"                            # Path's; str.replace takes two
            elif func.attr == "open" and _writes_mode(_method_open_mode(node)):
                what = f".open(mode={_method_open_mode(node)!r})"
            elif func.attr in LIBRARY_WRITES:
                what = f".{func.attr}()"
        if what is not None and not in_tree_writer(node):
            found.append(f"{where(node)}:{node.lineno}: {what}")
    return found


def _code_files() -> list[Path]:
    files = []
    for entry in CODE:
        path = REPO / entry
        files += [path] if path.is_file() else sorted(p for p in path.rglob("*.py") if "__pycache__" not in p.parts)
    return [p for p in files if p != WRITER]


def _key(found: str) -> str:
    """'file::function:line: call' -> 'file::function::call' (the allow-list's key)."""
    place, call = found.split(": ", 1)
    return place.rsplit(":", 1)[0] + "::" + call


@functools.lru_cache(maxsize=1)
def _all_writes() -> tuple[str, ...]:
    return tuple(w for path in _code_files() for w in direct_writes(path))


def test_no_direct_write_outside_the_writer():
    offenders = [w for w in _all_writes() if _key(w) not in ALLOWED]
    assert not offenders, "direct writes (use engine.safe_write.UserTree / agent.recipe.fs_guard.user_tree):\n" + \
        "\n".join(offenders)


def test_every_allowed_entry_still_writes():
    """An allow-list entry whose function no longer writes directly is stale: the list stays exact."""
    used = {_key(w) for w in _all_writes()}
    assert not set(ALLOWED) - used, sorted(set(ALLOWED) - used)


def test_the_walk_finds_every_spelling(tmp_path):
    """The walk can fail: each way of spelling a direct write is found; the tree's own calls are not."""
    (tmp_path / "x.py").write_text(
        "import os, shutil, tempfile, torch, sqlite3, logging\nfrom os import replace as mv\nfrom pathlib import Path\n"
        "def f(p, q, tree):\n"
        "    open(p, 'w'); open(p, mode='ab'); open(p, m)\n"
        "    p.write_text('x'); p.write_bytes(b''); p.mkdir(); p.unlink(); p.chmod(0o755); p.touch()\n"
        "    p.rename(q); p.replace(q); p.open('w'); p.symlink_to(q)\n"
        "    os.rename(p, q); os.chmod(p, 1); mv(p, q); os.makedirs(p); os.open(p, os.O_WRONLY | os.O_CREAT)\n"
        "    shutil.copy(p, q); shutil.rmtree(p); shutil.move(p, q)\n"
        "    tempfile.mkstemp(dir=p); torch.save({}, p); model.save_pretrained(p)\n"
        "    sqlite3.connect(p); logging.FileHandler(p)\n"
        "    'a'.replace('a', 'b'); open(p); p.open(); os.open(p, os.O_RDONLY); tempfile.mkdtemp()\n"
        "    tree.write_text(p, 'x'); user_tree(p).mkdir(p); tree.write_with(p, lambda t: torch.save({}, t))\n")
    found = direct_writes(tmp_path / "x.py", tmp_path)
    assert len(found) == 26, "\n".join(found)
    assert all(w.startswith("x.py::f:") for w in found)


def test_the_engine_writer_needs_nothing_from_agent():
    """A standalone recipe carries engine/: the writer must import without infer-migrator's agent/."""
    tree = ast.parse(WRITER.read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
              {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in modules if m and m.split(".")[0] in ("agent", "npu_standin")}, modules


# ---- every writer anchored at the root it writes into ------------------------------------------------
# A tree rooted at the written file's own folder refuses a link at the file, but not one above it (a
# recipe's `config/` linked out: the tree's root is the link). So a writer of a recipe's, a checkout's or a
# cache's file anchors its tree at that root. The few trees of a file's own folder, each with why
# ("path::function::call" -> reason):
OWN_FOLDER_TREES = {
    "agent/recipe/fs_guard.py::parent_tree::UserTree(<file's folder>)": "the definition of parent_tree",
    "agent/cli.py::cmd_baseline::parent_tree": "the --summary file the user named (its folder is no recipe's)",
    "agent/measure/precision.py::main::tree_of": "the --out file its caller named in a private temporary folder",
    "agent/measure/reference.py::_hub_style_config::tree_of":
        "config.json at the top of the checkpoint folder: the file's folder is that root",
    "agent/measure/reference.py::tiny_yaml::tree_of": "the YAML a test or bench script names, in a copy it made",
    "agent/workflow/nodes.py::wrapper::user_tree(<file's folder>)":
        "the recipe folder a failed node made, removed from the output folder it was made in",
    "agent/workflow/store.py::_adopt_run_checkpoints::user_tree(<file's folder>)":
        "the recipe folder (holding only the run checkpoints just moved out) removed from the output folder it is in",
    "agent/workflow/store.py::restore_run_checkpoints::user_tree(<file's folder>)":
        "the recipe folder's state folder made again in the output folder that holds it, for the run checkpoints",
    "agent/workflow/store.py::publish::user_tree(<file's folder>)":
        "the recipe folder published into the output folder that holds it (the root a migration writes into)",
    "agent/cli.py::cmd_convert::user_tree(<file's folder>)":
        "the DEST folder `migrator convert` names, made (as a staging folder renamed into place) in its parent",
    "agent/migrate/convert.py::for_recipe::user_tree(<file's folder>)":
        "the new recipe's folder, where the converted checkpoint goes, in the output folder it is made in "
        "(removed from there when the conversion fails)",
}
FILE_FOLDER_TREES = ("tree_of", "parent_tree")
TREE_MAKERS = ("UserTree", "user_tree")


def _is_own_folder(node: ast.AST) -> bool:
    """`x.parent`, `os.path.dirname(x)`, `Path(...).parent`: a root taken from the written path."""
    if isinstance(node, ast.Attribute) and node.attr == "parent":
        return True
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "dirname"


def own_folder_trees(path: Path, root: Path = REPO) -> list[str]:
    """'file::function:line: call' for each tree rooted at a written file's own folder."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if name in FILE_FOLDER_TREES:
            what = name
        elif name in TREE_MAKERS and node.args and _is_own_folder(node.args[0]):
            what = f"{name}(<file's folder>)"
        else:
            continue
        up = parents.get(node)
        while up is not None and not isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
            up = parents.get(up)
        found.append(f"{path.relative_to(root).as_posix()}::{up.name if up else '<module>'}:{node.lineno}: {what}")
    return found


def _all_own_folder_trees() -> list[str]:
    return [w for path in _code_files() for w in own_folder_trees(path)]


def test_every_writer_is_anchored_at_the_root_it_writes_into():
    offenders = [w for w in _all_own_folder_trees() if _key(w) not in OWN_FOLDER_TREES]
    assert not offenders, ("trees rooted at the written file's own folder (anchor them at the recipe / checkout / "
                           "cache they write into):\n" + "\n".join(offenders))
    assert not set(OWN_FOLDER_TREES) - {_key(w) for w in _all_own_folder_trees()}, "stale OWN_FOLDER_TREES entries"


def test_the_own_folder_walk_finds_each_spelling(tmp_path):
    (tmp_path / "x.py").write_text(
        "import os\n"
        "def f(p, root):\n"
        "    tree_of(p).write_text(p, 'x'); parent_tree(p).mkdir(p); UserTree(p.parent).write_text(p, 'x')\n"
        "    user_tree(os.path.dirname(p)).unlink(p); user_tree(Path(p).parent, 'x').mkdir(p)\n"
        "    user_tree(root).write_text(p, 'x'); UserTree(root / 'a').mkdir(p); run_folder_tree(os.path.dirname(p))\n")
    found = own_folder_trees(tmp_path / "x.py", tmp_path)
    assert len(found) == 5, "\n".join(found)
