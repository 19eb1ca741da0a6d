"""On-disk cache of codemod results: vendoring the same source with the same codemods again (the
next recipe of an architecture, a re-run) reads the result instead of re-running libcst, which is
most of vendoring's time on large modeling files.

The key covers everything the output depends on: the source text, the package and sibling map the
imports are rewritten against, which codemods run, the code of every codemod module, and the libcst
version. Entries are written atomically; an unreadable entry is ignored and rewritten.
`MIGRATOR_NO_CODEMOD_CACHE=1` turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import libcst
from agent.paths import cache_home
from agent.recipe.fs_guard import user_tree
from engine.safe_load import load_json


def cache_dir() -> Path:
    root = cache_home()
    return root / "infer-migrator" / "codemods"


def _key(parts: list[str], code_files: list[Path]) -> str:
    digest = hashlib.sha256()
    for part in (*parts, getattr(libcst, "__version__", "?")):
        digest.update(part.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
    for path in code_files:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cached(compute: Callable[[], tuple[str, list[str]]], key_parts: list[str],
           code_files: list[Path]) -> tuple[str, list[str]]:
    """`compute()` -> (code, names of the codemods applied), through the cache. The key is
    `key_parts` (the source and every input of the codemods), the code of `code_files` (the
    codemods) and the libcst version."""
    if os.environ.get("MIGRATOR_NO_CODEMOD_CACHE"):
        return compute()
    entry = cache_dir() / f"{_key(key_parts, code_files)}.json"
    try:
        data = load_json(entry)
        if isinstance(data.get("code"), str) and isinstance(data.get("applied"), list) \
                and all(isinstance(a, str) for a in data["applied"]):
            return data["code"], list(data["applied"])
    except (OSError, ValueError, AttributeError):
        pass
    code, applied = compute()
    try:
        user_tree(cache_dir(), "the codemod cache", create=True).write_text(
            entry, json.dumps({"code": code, "applied": applied}))
    except (OSError, ValueError):
        pass   # a read-only home (or a link in the cache): vendoring still works, only slower next time

    return code, applied
