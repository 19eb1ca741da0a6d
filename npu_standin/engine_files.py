"""infer-migrator's `engine/safe_load.py`, `engine/safe_write.py` and `engine/network.py`, for the stand-in.

The stand-in runs inside processes that are not the migrator's: a checkout's launcher venv without
infer-migrator (no `engine` at all) or a standalone recipe that carries an `engine` package of its own
(an older copy). Where `engine` is this project's own it is used as it is (one `LoadError` /
`WriteRefused` class for the CLI to catch); anywhere else the files are loaded by their path under
private names. They are self-contained (the standard library and yaml)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

ENGINE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine")


def _ours_is_importable() -> bool:
    loaded = sys.modules.get("engine")
    if loaded is not None:
        return os.path.dirname(os.path.abspath(getattr(loaded, "__file__", "") or "")) == ENGINE_DIR
    spec = importlib.util.find_spec("engine")
    return spec is not None and bool(spec.origin) and os.path.dirname(os.path.abspath(spec.origin)) == ENGINE_DIR


def _load(name: str):
    if _ours_is_importable():
        return importlib.import_module(f"engine.{name}")
    private = f"_npu_standin_engine_{name}"
    module = sys.modules.get(private)
    if module is None:
        spec = importlib.util.spec_from_file_location(private, os.path.join(ENGINE_DIR, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[private] = module
        spec.loader.exec_module(module)
    return module


safe_load = _load("safe_load")
safe_write = _load("safe_write")
network = _load("network")
