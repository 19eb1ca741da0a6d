"""Whether an interpreter can import transformers — and when it cannot, which installed package fails, with the
import error's own message and the fix, in one line.

transformers imports lazily: `import transformers` succeeds where the modules every model imports do not (5.0.0
beside `kernels` >= 0.11, which a newer transformers pulls in: `ValueError: Either a revision or a version must
be specified.` at import of transformers.activations). So the probe imports what upstream's models and the
vendored code import, and a failure is classified from the traceback: the package whose code raised, the package
whose import brought it in, their versions, and what the importer's metadata asks of the failing one.

Stdlib only: it runs as a script in a reference interpreter that need not have the migrator
(`python import_probe.py` prints one JSON line), and in the migrator's own process on an exception
(`failure(exc)`, agent/cli.py)."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import sys
import sysconfig

# what upstream's models and the vendored modeling code import (transformers' own lazy modules)
MODULES = ("transformers", "transformers.activations", "transformers.modeling_utils")
_PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_STDLIB = {os.path.realpath(sysconfig.get_paths()[key]) for key in ("stdlib", "platstdlib")}


def _roots() -> list[str]:
    """Import roots, longest first: a file's top-level package is its path's first part below one."""
    return sorted({os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)}, key=len, reverse=True)


def _top_package(filename: str, roots: list[str]) -> str | None:
    """The top-level package of an installed file (not the standard library's, not this project's), or None."""
    if not filename or filename.startswith("<"):
        return None
    path = os.path.realpath(filename)
    if path.startswith(_PROJECT + os.sep) or any(path.startswith(s + os.sep) and "-packages" not in path
                                                 for s in _STDLIB):
        return None
    for root in roots:
        if path.startswith(root + os.sep):
            first = path[len(root) + 1:].split(os.sep)[0]
            return first[:-3] if first.endswith(".py") else first
    return None


def _distribution(package: str) -> tuple[str, str | None]:
    """(distribution name, version) of a top-level package; the package's own name when no metadata maps it."""
    names = importlib.metadata.packages_distributions().get(package) or [package]
    for name in names:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return names[0], None


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement(importer: str, package: str) -> tuple[str | None, bool]:
    """(the version specifier `importer`'s metadata gives `package`, whether only an extra asks for it)."""
    try:
        lines = importlib.metadata.requires(importer) or []
    except importlib.metadata.PackageNotFoundError:
        return None, False
    found, optional = None, True
    for line in lines:
        match = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*(?:\[[^]]*\])?\s*([^;]*)(?:;(.*))?$", line)
        if not match or _normal(match.group(1)) != _normal(package):
            continue
        spec = match.group(2).strip().strip("()").replace(" ", "")
        found = found or spec or None
        optional = optional and "extra" in (match.group(3) or "")
    return found, optional and found is not None


def _satisfies(version: str | None, spec: str | None) -> bool | None:
    if not version or not spec:
        return None
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:
        return None
    return version in SpecifierSet(spec)


def failure(exc: BaseException) -> dict | None:
    """An exception raised while an installed package's module was being imported, as {error, module, package,
    package_version, importer, importer_version, requirement, optional}; None for any other exception (a fault
    of this project's code, or no import involved)."""
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    roots = _roots()
    importing = [i for i, f in enumerate(frames) if f.f_code.co_filename.startswith("<frozen importlib")]
    modules = [(i, _top_package(f.f_code.co_filename, roots), f.f_globals.get("__name__"))
               for i, f in enumerate(frames) if f.f_code.co_name == "<module>"]
    modules = [(i, package, name) for i, package, name in modules if package and importing and importing[0] < i]
    missing = isinstance(exc, ModuleNotFoundError) and exc.name
    if not modules and not missing:
        return None
    packages = [p for p in (_top_package(f.f_code.co_filename, roots) for f in frames) if p]
    if missing:
        failing = exc.name.split(".")[0]
        importer = next((p for p in reversed(packages) if p != failing), None)
    else:
        failing = packages[-1]
        importer = next((p for p in reversed(packages) if p != failing), failing)
    if importer is None:
        return None                     # this project's own import of something absent: not an installed package's
    importer_dist, importer_version = _distribution(importer)
    failing_dist, failing_version = _distribution(failing) if not missing else (failing, None)
    requirement, optional = _requirement(importer_dist, failing_dist) if failing_dist != importer_dist else (None, False)
    module = next((name for _, package, name in modules if package == importer), None) or \
        (modules[0][2] if modules else importer)
    return {"error": " ".join(f"{type(exc).__name__}: {exc}".split())[:300], "module": module,
            "package": failing_dist, "package_version": failing_version, "missing": bool(missing),
            "importer": importer_dist, "importer_version": importer_version,
            "requirement": requirement, "optional": optional}


def line(found: dict, python: str) -> str:
    """The one line: which interpreter, what fails in which package, the error's own message, and the fix."""
    importer = f"{found['importer']} {found['importer_version'] or ''}".strip()
    package = f"{found['package']} {found['package_version'] or ''}".strip()
    pip = f"{python} -m pip"
    spec = found["requirement"]
    head = f"{python}: {importer} cannot be imported: importing {found['module']} fails"
    if found["missing"]:
        want = f"{found['package']}{spec or ''}"
        return f"{head} ({found['error']}); install it: `{pip} install '{want}'`"
    if found["package"] == found["importer"]:
        return (f"{head} ({found['error']}); reinstall it: `{pip} install --force-reinstall "
                f"'{found['importer']}=={found['importer_version']}'`" if found["importer_version"] else
                f"{head} ({found['error']}); reinstall {found['importer']}")
    where = f"{head} in {package} ({found['error']})"
    if spec and _satisfies(found["package_version"], spec) is False:
        remove = f", or `{pip} uninstall -y {found['package']}` ({importer} needs it only for an extra)" \
            if found["optional"] else ""
        return f"{where}; {importer} asks for {found['package']}{spec}: `{pip} install '{found['package']}{spec}'`{remove}"
    return (f"{where}; install a {found['package']} release {importer} works with, or `{pip} uninstall -y "
            f"{found['package']}` if nothing else needs it")


def probe(modules=MODULES) -> dict:
    """{"version": transformers' version or None, "failure": failure(...) or None, "error": when not an installed
    package's import failure}."""
    try:
        for module in modules:
            importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - whatever an import raises is the answer
        found = failure(exc)
        return {"version": _distribution("transformers")[1], "failure": found,
                "error": None if found else " ".join(f"{type(exc).__name__}: {exc}".split())[:300]}
    return {"version": sys.modules["transformers"].__version__, "failure": None, "error": None}


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1:] or MODULES)))
