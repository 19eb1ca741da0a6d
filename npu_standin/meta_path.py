"""One step of the stand-in's import hooks, shared by bootstrap.py and steps.py (no torch import here)."""

from __future__ import annotations

import sys


def spec_after(finder, fullname, path=None, target=None, once=False):
    """The spec the finders after `finder` on sys.meta_path give (`once`: `finder` leaves the list first, so
    none of them calls it again). A hook that wraps a module's loader asks them, not the path finder alone:
    another hook on the same module (the precision probe's on torch and on upstream's ModelWorker) still
    sees the import."""
    finders = sys.meta_path
    start = finders.index(finder) if finder in finders else 0
    if once and finder in finders:
        finders.remove(finder)
    elif finder in finders:
        start += 1
    for other in list(finders[start:]):
        find = getattr(other, "find_spec", None)
        spec = find(fullname, path, target) if find is not None else None
        if spec is not None:
            return spec
    return None
