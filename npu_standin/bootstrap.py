"""Import hooks installed by the stand-in's sitecustomize.py (no torch import here).

* `torch_npu`, `torchair` and their submodules are served by the stand-in (a finder first on
  sys.meta_path), whatever is installed: the launcher has already refused to start where a real
  torch_npu works.
* `executor.core.model_worker.model_worker` (upstream's executor) has its forward calls marked as
  steps for the record (npu_standin.steps).
* When `torch` finishes importing, the stand-in activates (npu device, torch.npu, HCCL, kernels,
  compile backends) before any user code sees torch.
* When a recipe's `engine.environment` finishes importing, its `detect_environment` is wrapped so
  that the record it returns is the stand-in's (honest.mark_environment): the engine never names
  the stand-in.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

from npu_standin.meta_path import spec_after

SHIM_ROOTS = ("torch_npu", "torchair", "npugraph_ex")


class _ShimLoader(importlib.abc.Loader):
    def __init__(self, fullname: str):
        self.fullname = fullname

    def create_module(self, spec):
        import torch  # noqa: F401 - activation runs at the end of torch's import

        from npu_standin import shims

        module = shims.module_for(self.fullname)
        if module is None:
            raise shims.not_provided(self.fullname)
        return module

    def exec_module(self, module):
        return None


class ShimFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] not in SHIM_ROOTS:
            return None
        return importlib.machinery.ModuleSpec(fullname, _ShimLoader(fullname), is_package=True)


class _ThenLoader(importlib.abc.Loader):
    """The real loader of a module, then `then(module)` once the module has executed."""

    def __init__(self, real, then):
        self.real = real
        self.then = then

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        self.real.exec_module(module)
        self.then(module)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _activate(_torch) -> None:
    from npu_standin import activate

    activate.activate()


def _mark_environment(module) -> None:
    from npu_standin import honest

    honest.mark_environment_module(module)


class TorchHook(importlib.abc.MetaPathFinder):
    """Wraps the loader of `torch` so that the stand-in activates when torch's import completes."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        spec = spec_after(self, fullname, path, target, once=True)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenLoader(spec.loader, _activate)
        return spec


class EnvironmentRecordHook(importlib.abc.MetaPathFinder):
    """Wraps the loader of the engine's environment module (a recipe's or ours: both are
    `engine.environment`), so that its records are marked as made under the stand-in."""

    MODULE = "engine.environment"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.MODULE:
            return None
        spec = spec_after(self, fullname, path, target)
        if spec is None or spec.loader is None or isinstance(spec.loader, _ThenLoader):
            return spec
        spec.loader = _ThenLoader(spec.loader, _mark_environment)
        return spec


# torch's compiler stack builds type tables (`type(x) in (torch.device, ...)`) when its modules are
# imported: they must hold the real torch.device class, not the stand-in's `torch.device` (whose
# instances are real devices). Modules under these prefixes are imported with the real class in place.
SHIELDED = ("torch._dynamo", "torch._inductor", "torch._functorch", "torch._subclasses", "torch._export",
            "torch.export", "torch.fx")


class _ShieldedLoader(importlib.abc.Loader):
    def __init__(self, real):
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        torch = sys.modules.get("torch")
        real_device = getattr(sys.modules.get("npu_standin.device"), "_REAL_DEVICE", None)
        current = getattr(torch, "device", None)
        if real_device is None or current is real_device:
            return self.real.exec_module(module)
        torch.device = real_device
        try:
            self.real.exec_module(module)
        finally:
            torch.device = current

    def __getattr__(self, name):
        return getattr(self.real, name)


class CompilerImportShield(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(SHIELDED) or "torch" not in sys.modules:
            return None
        spec = spec_after(self, fullname, path, target)
        if spec is None or spec.loader is None or isinstance(spec.loader, _ShieldedLoader):
            return spec
        spec.loader = _ShieldedLoader(spec.loader)
        return spec


_installed = {"done": False}


def install() -> None:
    if _installed["done"]:
        return
    _installed["done"] = True
    sys.meta_path.insert(0, ShimFinder())
    sys.meta_path.insert(0, CompilerImportShield())
    sys.meta_path.insert(0, EnvironmentRecordHook())
    from npu_standin import steps      # the record's per-step counts: upstream's executor's forward calls

    steps.install()
    if "torch" in sys.modules:
        from npu_standin import activate

        activate.activate()
    else:
        sys.meta_path.insert(0, TorchHook())
    if EnvironmentRecordHook.MODULE in sys.modules:
        _mark_environment(sys.modules[EnvironmentRecordHook.MODULE])
