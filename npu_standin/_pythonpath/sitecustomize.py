"""sitecustomize of the npu stand-in (its folder is first on PYTHONPATH for a stand-in run).

Runs any other sitecustomize first (the one this one shadows), then, only when NPU_STANDIN is set
(cpu or cuda), loads npu_standin from NPU_STANDIN_HOME and installs its import hooks. Nothing
happens without NPU_STANDIN: the folder alone on PYTHONPATH never activates anything.
"""

import os
import sys


def _run_shadowed_sitecustomize():
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.origin is None or os.path.abspath(spec.origin) == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - as site.py does: report, continue
        print(f"Error in sitecustomize ({spec.origin}); set PYTHONVERBOSE for traceback: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)


def _load_standin():
    import importlib.util

    home = os.environ.get("NPU_STANDIN_HOME")
    if not home or not os.path.isfile(os.path.join(home, "__init__.py")):
        print(f"[npu-standin] error: NPU_STANDIN_HOME={home!r} is not the npu_standin package folder; "
              "the stand-in is not active", file=sys.stderr)
        return
    module = sys.modules.get("npu_standin")
    if module is None:
        spec = importlib.util.spec_from_file_location("npu_standin", os.path.join(home, "__init__.py"),
                                                      submodule_search_locations=[home])
        module = importlib.util.module_from_spec(spec)
        sys.modules["npu_standin"] = module
        spec.loader.exec_module(module)
    from npu_standin import bootstrap

    bootstrap.install()


_run_shadowed_sitecustomize()
if os.environ.get("NPU_STANDIN") in ("cpu", "cuda"):
    _load_standin()
