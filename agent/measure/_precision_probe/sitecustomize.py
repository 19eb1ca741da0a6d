"""sitecustomize of the precision probe (its folder is on PYTHONPATH for every trial run, after the
npu stand-in's where there is one, whose sitecustomize runs this one).

Runs the sitecustomize it shadows first (one after it on sys.path), then, only when
MIGRATOR_PRECISION_RECORD names a folder, loads agent/measure/precision_probe.py by its path (the
recipe's process must not import `agent`: the project's own `models` folder would shadow a
checkout's) and installs its hooks.
"""

import os
import sys


def _run_shadowed_sitecustomize():
    import importlib.machinery
    import importlib.util

    # Only the entries after this folder: one before it (the npu stand-in's) has already run this one.
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [os.path.abspath(p or os.curdir) for p in sys.path]
    others = sys.path[paths.index(here) + 1:] if here in paths else list(sys.path)
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.origin is None or os.path.abspath(spec.origin) == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - as site.py does: report, continue
        print(f"Error in sitecustomize ({spec.origin}): {type(exc).__name__}: {exc}", file=sys.stderr)


def _install_probe():
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "precision_probe.py")
    spec = importlib.util.spec_from_file_location("_migrator_precision_probe", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.install(os.environ["MIGRATOR_PRECISION_RECORD"])


# Once per process: another sitecustomize that runs the one it shadows (the npu stand-in's, which
# skips only its own folder) runs this file a second time.
if "_migrator_precision_site" not in sys.modules:
    sys.modules["_migrator_precision_site"] = sys.modules.get(__name__)
    _run_shadowed_sitecustomize()
    if os.environ.get("MIGRATOR_PRECISION_RECORD"):
        _install_probe()
