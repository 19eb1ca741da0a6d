"""Every global name a module reads is defined there (assigned, imported or a builtin): in agent/, engine/,
npu_standin/ and scripts/. The class: an import moved into a code string (scripts/bench_recipe.py's and
bench_standin.py's `loads_json` went into the RENDER source their subprocess runs, and `render` died of a
NameError the first time a user ran the benchmark)."""

from __future__ import annotations

import builtins
import symtable
from pathlib import Path

from locations import REPO_ROOT

MODULE_NAMES = {"__file__", "__name__", "__doc__", "__spec__", "__loader__", "__builtins__", "__package__", "__path__",
                "__annotations__", "__dict__"}
KNOWN = set(dir(builtins)) | MODULE_NAMES


def undefined_globals(source: str, filename: str = "<source>") -> list[tuple[str, str]]:
    """(scope, name) for each global name read and never defined at module level."""
    top = symtable.symtable(source, filename, "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}

    def declared(table):           # `global x` then `x = …` in a function defines x too
        for child in table.get_children():
            defined.update(s.get_name() for s in child.get_symbols() if s.is_declared_global() and s.is_assigned())
            declared(child)

    declared(top)
    found = [("<module>", s.get_name()) for s in top.get_symbols()
             if s.is_referenced() and s.get_name() not in defined and s.get_name() not in KNOWN]

    def walk(table):
        for child in table.get_children():
            found.extend((child.get_name(), s.get_name()) for s in child.get_symbols()
                         if s.is_global() and s.get_name() not in defined and s.get_name() not in KNOWN)
            walk(child)

    walk(top)
    return found


def test_the_check_finds_an_import_moved_into_a_string():
    source = ('CODE = """\nfrom engine.safe_load import loads_json\n"""\n'
              "def render(text):\n    return loads_json(text)\n")
    assert undefined_globals(source) == [("render", "loads_json")]
    assert undefined_globals("from json import loads as loads_json\ndef render(t):\n    return loads_json(t)\n") == []
    assert undefined_globals("def f():\n    global seen\n    seen = 1\n") == []


def test_every_global_name_read_is_defined():
    offenders = []
    for base in ("agent", "engine", "npu_standin", "scripts"):
        for path in sorted(Path(REPO_ROOT / base).rglob("*.py")):
            rel = path.relative_to(REPO_ROOT).as_posix()
            offenders += [f"{rel}: {scope} reads {name}"
                          for scope, name in undefined_globals(path.read_text(encoding="utf-8"), rel)]
    assert not offenders, f"names read but never defined (a NameError when that code runs): {offenders}"
