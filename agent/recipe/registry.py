"""The line a framework recipe adds to its checkout's `executor/core/support_models.py`, and its undo.

upstream's registry is a dict literal `_specs = {name: [(module, class), ...], ...}` that
`load_model_classes(name)` imports from lazily. `register` inserts one entry before the dict's
closing brace: the file's other bytes (its line endings, comments, the other entries) are kept, the
original is copied to the recipe's state folder first, and what was inserted is recorded there.
`unregister` takes exactly those bytes out again (it refuses when they are no longer in the file
as written, e.g. edited by hand since).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from agent.errors import InputError
from agent.recipe.fs_guard import user_tree
from agent.recipe.targets import REGISTRY
from engine.safe_load import load_json

RECORD = "registry_edit.json"


@dataclass(frozen=True)
class RegistryEdit:
    registry: Path            # the checkout's support_models.py
    offset: int               # where the entry was inserted (bytes)
    inserted: bytes
    backup: Path              # the file as it was before


def _specs_dict(tree: ast.Module) -> ast.Dict | None:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "_specs" for t in targets) and isinstance(node.value, ast.Dict):
            return node.value
    return None


def registered_names(registry: Path) -> set[str]:
    """The model names the registry knows (keys of `_specs`); empty when it has no such dict."""
    try:
        specs = _specs_dict(ast.parse(registry.read_bytes()))
    except (OSError, SyntaxError, ValueError):
        return set()
    if specs is None:
        return set()
    return {k.value for k in specs.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def entry_text(name: str, classes: list[tuple[str, str]], newline: str = "\n") -> str:
    lines = [f"    {json.dumps(name)}: ["]
    lines += [f"        ({json.dumps(module)}, {json.dumps(cls)})," for module, cls in classes]
    lines.append("    ],")
    return newline.join(lines) + newline


def register(checkout: Path, name: str, classes: list[tuple[str, str]], state_dir: Path) -> RegistryEdit:
    """Add `name` to the checkout's registry (see the module docs). InputError when the registry
    cannot take it (no `_specs` dict, the name already there). Only while this process holds the recipe's
    folder lock, and one registry edit at a time (another recipe's waits). The record of the edit is
    written before the edit: a run killed between the two is resumed by registering again (this recipe's
    own line is found, not added twice), or undone by rollback."""
    from agent import folder_lock

    registry = checkout / REGISTRY
    with folder_lock.holding(_recipe_folder(state_dir), "run it"), \
            folder_lock.holding(registry, "register a model", wait_s=REGISTRY_WAIT_S):
        return _register(checkout, registry, name, classes, state_dir)


REGISTRY_WAIT_S = 60.0     # another recipe's registry edit takes milliseconds


def _register(checkout: Path, registry: Path, name: str, classes: list[tuple[str, str]],
              state_dir: Path) -> RegistryEdit:
    checkout_tree = user_tree(checkout, "the checkout")
    checkout_tree.resolve(registry)          # a link out of the checkout: refused before anything is written
    state_tree = _state_tree(state_dir)
    state_tree.resolve(state_dir / RECORD)
    data = registry.read_bytes()
    try:
        specs = _specs_dict(ast.parse(data))
    except SyntaxError as exc:
        raise InputError(f"{registry}: does not parse ({exc.msg}, line {exc.lineno}); fix it before migrating") from None
    if specs is None:
        raise InputError(f"{registry}: no `_specs = {{...}}` dict to register {name} in; is this a cann-recipes-infer "
                         "checkout of 2026 or later?")
    mine = recorded_edit(state_dir)
    if name in registered_names(registry):
        if mine is not None and mine.get("name") == name and mine["inserted"].encode() in data:
            # this recipe's own line, added by its migration before a kill: registered already
            return RegistryEdit(registry, data.index(mine["inserted"].encode()), mine["inserted"].encode(),
                                Path(mine["backup"]))
        raise InputError(f"{registry}: {name!r} is registered already; choose another --name")
    lines = data.splitlines(keepends=True)
    close_line = lines[specs.end_lineno - 1]
    # the closing brace; end_col_offset counts UTF-8 bytes, as we do
    brace = specs.end_col_offset - 1
    if close_line[brace:brace + 1] != b"}":
        raise InputError(f"{registry}: cannot find the end of `_specs`; add the entry by hand")
    newline = "\r\n" if b"\r\n" in data else "\n"
    offset = sum(len(line) for line in lines[:specs.end_lineno - 1])
    if close_line[:brace].strip():
        # `... }` on a line with entries: put ours on lines of its own before the brace
        offset += brace
        inserted = (newline + entry_text(name, classes, newline)).encode()
    else:
        inserted = entry_text(name, classes, newline).encode()
    backup = state_dir / "support_models.py.orig"
    state_tree.write_bytes(backup, data)
    new = data[:offset] + inserted + data[offset:]
    # recorded first: a kill between the two leaves a record whose line is not in the file (rollback says so)
    state_tree.write_text(state_dir / RECORD, json.dumps({
        "registry": str(registry), "name": name, "offset": offset, "inserted": inserted.decode(),
        "backup": str(backup), "sha256_before": hashlib.sha256(data).hexdigest(),
        "sha256_after": hashlib.sha256(new).hexdigest()}, indent=2) + "\n")
    checkout_tree.write_bytes(registry, new)     # write-and-rename: another hard link keeps the old bytes
    if name not in registered_names(registry):       # never leave the checkout's registry broken
        checkout_tree.write_bytes(registry, data)
        state_tree.unlink(state_dir / RECORD)
        raise InputError(f"{registry}: the entry for {name} did not take; left the file as it was")
    return RegistryEdit(registry, offset, inserted, backup)


def was_registered(state_dir: Path) -> bool:
    """Whether this recipe's migration added a registry entry (taken out since or not)."""
    return (state_dir / RECORD).is_file() or (state_dir / (RECORD + ".undone")).is_file()


RECORD_SCHEMA = {"registry": str, "name": str, "offset": int, "inserted": str, "backup": str, "sha256_before": str,
                 "sha256_after": str}


def recorded_edit(state_dir: Path) -> dict | None:
    """The recorded registry edit, schema-checked (a received recipe's state is untrusted): the fields of
    RECORD_SCHEMA with their types, and a `registry` that is the support_models.py of the checkout holding
    the recipe, nothing else; InputError (exit 2) for a record that names another file."""
    path = state_dir / RECORD
    if not os.path.lexists(path):
        return None
    forged = "not a record this tool wrote: remove it if the recipe was received from elsewhere"
    try:
        record = load_json(path, max_bytes=2**20)
    except (OSError, ValueError) as exc:      # a FIFO, a folder, a link loop, bad JSON: refused, not "nothing"
        shown = " ".join(str(exc).split())
        raise InputError(f"{shown if str(path) in shown else f'{path}: {shown}'}; {forged}") from None
    if not isinstance(record, dict) or not {"registry", "inserted"} <= set(record):
        raise InputError(f"{path}: {'no registry or inserted field' if isinstance(record, dict) else 'not a JSON object'}; "
                         f"{forged}")
    for key, kind in RECORD_SCHEMA.items():
        value = record.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise InputError(f"{state_dir / RECORD}: {key!r} is not a {kind.__name__}; not a record this tool wrote")
    from agent.recipe.targets import checkout_root

    folder = state_dir.parent.parent if state_dir.parent.name == "res" else state_dir.parent
    checkout = checkout_root(folder)
    expected = (checkout / REGISTRY).resolve() if checkout is not None else None
    if expected is None or Path(record["registry"]).resolve() != expected or not record["inserted"].strip():
        raise InputError(f"{state_dir / RECORD}: names {record['registry'][:200]!r} as the registry it edited, not "
                         f"{expected or 'the support_models.py of a checkout holding the recipe'}; the migrator "
                         "edits no other file: remove the record if the recipe was received from elsewhere")
    return record


def unregister(state_dir: Path) -> Path | None:
    """Take the recorded entry out of the registry, keeping every other byte (edits made since
    elsewhere in the file stay). Returns the registry path; None when nothing was recorded or it
    is out already. InputError when the entry was changed by hand. Only while this process holds the
    recipe's folder lock (a run of the recipe in progress refuses it, exit 75), one registry edit at a time."""
    from agent import folder_lock

    record = recorded_edit(state_dir)
    if record is None:
        return None
    with folder_lock.holding(_recipe_folder(state_dir), "roll it back"), \
            folder_lock.holding(Path(record["registry"]), "register a model", wait_s=REGISTRY_WAIT_S):
        return _unregister(state_dir)


def _unregister(state_dir: Path) -> Path | None:
    record = recorded_edit(state_dir)
    if record is None:
        return None
    registry = Path(record["registry"])
    data = registry.read_bytes()
    inserted = record["inserted"].encode()
    count = data.count(inserted)
    if count == 0:
        if record.get("name") in registered_names(registry):
            raise InputError(f"{registry}: the entry for {record.get('name')!r} was edited since it was added; "
                             f"remove it by hand (the file before the migration: {record.get('backup')})")
        _state_tree(state_dir).replace(state_dir / RECORD, state_dir / (RECORD + ".undone"))
        return None
    offset = record.get("offset")
    if not (isinstance(offset, int) and data[offset:offset + len(inserted)] == inserted):
        if count > 1:
            raise InputError(f"{registry}: the entry for {record.get('name')!r} appears {count} times; remove it by hand")
        offset = data.index(inserted)
    # recorded_edit: `registry` is the checkout's own executor/core/support_models.py
    user_tree(registry.parents[len(REGISTRY.parts) - 1], "the checkout").write_bytes(
        registry, data[:offset] + data[offset + len(inserted):])

    _state_tree(state_dir).replace(state_dir / RECORD, state_dir / (RECORD + ".undone"))
    return registry


def _recipe_folder(state_dir: Path) -> Path:
    """The recipe (model folder) whose state folder `state_dir` is (`res/.migrator` in a checkout)."""
    return state_dir.parent.parent if state_dir.parent.name == "res" else state_dir.parent


def _state_tree(state_dir: Path):
    return user_tree(_recipe_folder(state_dir), "the recipe")

