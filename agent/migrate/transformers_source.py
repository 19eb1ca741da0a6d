"""The transformers a recipe is vendored from when it is not the one installed.

A recipe for a cann-recipes-infer checkout runs with the transformers that checkout pins (its
AGENTS.md stack line, else its framework models' requirements.txt: 5.0.0 at fbc225d). When the
installed transformers is another release, the modeling code is copied from that release's *source
files* — a wheel, an unpacked folder or a site-packages folder holding `transformers/`
(`--transformers-source`), else a wheel `pip download` fetches into the cache — and never imported
here: the classes are still located with the installed transformers' auto mappings (the same module
paths in every 5.x), their files then read from the other tree.

The recipe's trial runs and the parity reference then need an interpreter with that release
(`reference_python`): `--reference-python PY`, else `python3` on PATH when its transformers is the
pinned one.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from agent.errors import EXIT_BAD_TRANSFORMERS_SOURCE, EXIT_NO_TRANSFORMERS_SOURCE, MigratorError
from agent.migrate.transformers_range import _version_tuple
from agent.paths import cache_home
from agent.recipe.fs_guard import user_tree

EXIT_NO_SOURCE, EXIT_BAD_SOURCE = EXIT_NO_TRANSFORMERS_SOURCE, EXIT_BAD_TRANSFORMERS_SOURCE
SUPPORTED = ((5, 0, 0), (6, 0, 0))      # pyproject: transformers>=5.0,<6
_VERSION = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.M)
_STACK_LINE = re.compile(r"\btransformers[ =]=?\s*(\d+\.\d+\.\d+)\b")
_REQUIREMENT = re.compile(r"^\s*transformers\s*==\s*(\d+\.\d+\.\d+)\s*$", re.M)


class NoTransformersSource(MigratorError):
    exit_code = EXIT_NO_SOURCE


class BadTransformersSource(MigratorError):
    exit_code = EXIT_BAD_SOURCE


@dataclass(frozen=True)
class SourceTree:
    version: str
    root: Path          # the folder holding transformers/
    origin: str         # what it was made from, for the report

    def module_file(self, module: str) -> Path | None:
        """The .py file of `transformers.x.y` in this tree, or None."""
        parts = module.split(".")
        if parts[0] != "transformers":
            return None
        path = self.root.joinpath(*parts).with_suffix(".py")
        return path if path.is_file() else None


def installed_version() -> str:
    import transformers

    return transformers.__version__


def in_range(version: str) -> bool:
    return SUPPORTED[0] <= _version_tuple(version) < SUPPORTED[1]


def checkout_pin(checkout: Path) -> tuple[str, str] | None:
    """(version, where it is written) of the transformers `checkout` pins, or None.

    Its AGENTS.md names the stack ("CANN 9.0.0 + PyTorch 2.8.0 + torch_npu 2.8.0 + transformers
    5.0.0"); without it, the release most of its models' requirements.txt pin within 5.x."""
    agents = checkout / "AGENTS.md"
    if agents.is_file():
        for line in agents.read_text(errors="replace").splitlines():
            if "torch" in line.lower() and (found := _STACK_LINE.search(line)) and in_range(found.group(1)):
                return found.group(1), "AGENTS.md"
    pins = Counter()
    for requirements in sorted((checkout / "models").glob("*/requirements.txt")):
        pins.update(v for v in _REQUIREMENT.findall(requirements.read_text(errors="replace")) if in_range(v))
    if pins:
        version, _ = pins.most_common(1)[0]
        return version, "models/*/requirements.txt"
    return None


def _tree_version(root: Path, what: str) -> str:
    init = root / "transformers" / "__init__.py"
    return _version_of(init.read_text(errors="replace") if init.is_file() else "", what)


def _version_of(init_text: str, what: str) -> str:
    found = _VERSION.search(init_text)
    if not found:
        raise BadTransformersSource(f"{what}: transformers/__init__.py has no __version__; give a transformers "
                                    "wheel or a folder holding transformers/ (an unpacked wheel, a site-packages)")
    version = found.group(1)
    if not in_range(version):
        raise BadTransformersSource(f"{what}: transformers {version} is outside the supported range >=5.0,<6; "
                                    "give the source of a 5.x release")
    return version


def cache_root() -> Path:
    return cache_home() / "infer-migrator" / "transformers"


# A transformers wheel unpacks to ~60 MB in ~2000 files; its largest .py is well under 2 MB.
WHEEL_MAX_MEMBERS = 20_000
WHEEL_MAX_MEMBER_BYTES = 32 * 2**20
WHEEL_MAX_TOTAL_BYTES = 512 * 2**20
WHEEL_MAX_BYTES = 1 * 2**30
INIT_MAX_BYTES = 4 * 2**20
_MEMBER_RE = re.compile(r"^[\w.+-]+(?:/[\w.+-]+)*$")


def _member_problem(info: zipfile.ZipInfo) -> str | None:
    name = info.filename
    if not _MEMBER_RE.match(name.rstrip("/")) or any(p in ("", ".", "..") for p in name.rstrip("/").split("/")):
        return f"member {name!r} is not a plain relative path"
    mode = (info.external_attr >> 16) & 0o170000
    if mode and mode not in (0o100000, 0o040000):
        return f"member {name!r} is not a regular file (a link or a special file)"
    if info.file_size > WHEEL_MAX_MEMBER_BYTES:
        return f"member {name!r} unpacks to {info.file_size} bytes (limit {WHEEL_MAX_MEMBER_BYTES})"
    return None


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int, sink=None) -> bytes:
    """A member's bytes, read in chunks and never past `limit` (whatever its header claims); with `sink`,
    written there and b"" returned."""
    got, chunks = 0, []
    with archive.open(info) as member:
        while True:
            chunk = member.read(2**20)
            if not chunk:
                break
            got += len(chunk)
            if got > limit:
                raise BadTransformersSource(f"member {info.filename!r} unpacks to more than {limit} bytes")
            if sink is not None:
                sink.write(chunk)
            else:
                chunks.append(chunk)
    return b"".join(chunks)


def _wheel_digest(wheel: Path) -> str:
    size = wheel.stat().st_size
    if size > WHEEL_MAX_BYTES:
        raise BadTransformersSource(f"{wheel}: {size} bytes, larger than any transformers wheel "
                                    f"(limit {WHEEL_MAX_BYTES}); not a wheel to unpack")
    digest = hashlib.sha256()
    with open(wheel, "rb") as f:
        for chunk in iter(lambda: f.read(2**20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _unpack_wheel(wheel: Path) -> Path:
    """The wheel's `transformers/` in the cache (once per wheel content), read member by member: its version
    is read first (a wheel outside the supported range is refused before anything is written); every member
    is checked (a plain relative path, a regular file, its size) and read with a cap, so a small archive that
    claims or holds gigabytes is refused without being unpacked, and a refused or failed unpacking leaves
    nothing in the cache."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            infos = [i for i in archive.infolist() if i.filename.startswith("transformers/")]
            if len(archive.infolist()) > WHEEL_MAX_MEMBERS:
                raise BadTransformersSource(f"{wheel}: more than {WHEEL_MAX_MEMBERS} members; not a transformers wheel")
            init = next((i for i in infos if i.filename == "transformers/__init__.py"), None)
            if init is None:
                raise BadTransformersSource(f"{wheel}: not a transformers wheel (no transformers/__init__.py in it)")
            for info in infos:
                problem = _member_problem(info)
                if problem:
                    raise BadTransformersSource(f"{wheel}: {problem}; not a wheel to trust")
            total = sum(i.file_size for i in infos)
            if total > WHEEL_MAX_TOTAL_BYTES:
                raise BadTransformersSource(f"{wheel}: transformers/ unpacks to {total} bytes (limit "
                                            f"{WHEEL_MAX_TOTAL_BYTES}); not a transformers wheel")
            try:
                init_text = _read_member(archive, init, INIT_MAX_BYTES).decode("utf-8", errors="replace")
            except BadTransformersSource as exc:
                raise BadTransformersSource(f"{wheel}: {exc}") from None
            _version_of(init_text, f"--transformers-source {wheel}")      # the version first, nothing written yet
            dest = cache_root() / "unpacked" / _wheel_digest(wheel)
            if (dest / "transformers" / "__init__.py").is_file():
                return dest
            from agent.processes import owned_temp, remove_orphaned_temp

            cache_tree = user_tree(cache_root(), "the transformers source cache", create=True, keep_links=False)
            cache_tree.mkdir(dest.parent, parents=True)
            # unpacked aside in a folder this process holds the lock of (the cache is shared by every pid
            # namespace and host of this user): one a SIGKILL cut short is removed by the next unpacking
            remove_orphaned_temp(dest.parent)
            try:
                with owned_temp("unpack", dest.parent) as partial:
                    written = 0
                    for info in infos:
                        if info.is_dir():
                            continue
                        target = partial.joinpath(*info.filename.split("/"))
                        with cache_tree.open(target, "xb") as sink:
                            _read_member(archive, info, min(info.file_size, WHEEL_MAX_MEMBER_BYTES), sink)
                        written += target.stat().st_size
                        if written > WHEEL_MAX_TOTAL_BYTES:
                            raise BadTransformersSource(f"unpacks to more than {WHEEL_MAX_TOTAL_BYTES} bytes")
                    if not (dest / "transformers" / "__init__.py").is_file():   # else another unpacking won
                        cache_tree.rmtree(dest)                                 # a damaged one: replaced
                        try:
                            cache_tree.replace(partial, dest)
                        except OSError:
                            if not (dest / "transformers" / "__init__.py").is_file():
                                raise
            except BadTransformersSource as exc:
                raise BadTransformersSource(f"{wheel}: {exc}; not a transformers wheel") from None
            return dest
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError) as exc:
        raise BadTransformersSource(f"{wheel}: not a wheel, or a damaged one ({type(exc).__name__}: "
                                    f"{' '.join(str(exc).split())[:120]}); give a transformers-X.whl or a "
                                    "folder holding transformers/") from None


def open_source(given: str | os.PathLike) -> SourceTree:
    """A transformers source tree from a wheel file or a folder holding transformers/ (bad input:
    BadTransformersSource, exit 10)."""
    path = Path(given).expanduser()
    if path.is_file():
        root = _unpack_wheel(path)
    elif path.is_dir():
        root = path.parent if path.name == "transformers" and (path / "__init__.py").is_file() else path
        if not (root / "transformers" / "__init__.py").is_file():
            raise BadTransformersSource(f"--transformers-source {given}: no transformers/ package in that folder; "
                                        "give a wheel or a folder holding transformers/ (e.g. a venv's site-packages)")
    else:
        raise BadTransformersSource(f"--transformers-source {given}: no such file or folder")
    version = _tree_version(root, f"--transformers-source {given}")
    return SourceTree(version, root.resolve(), f"transformers {version} source from {path.name}")


def fetch_source(version: str, timeout: int = 300) -> SourceTree:
    """transformers==version's wheel by `pip download` into the cache (once), unpacked there.
    Where the index cannot be reached: NoTransformersSource (exit 9) naming --transformers-source."""
    wheels = cache_root() / "wheels"
    found = sorted(wheels.glob(f"transformers-{version}-*.whl"))
    if not found:
        user_tree(cache_root(), "the transformers source cache", create=True).mkdir(wheels)

        print(f"[migrator] fetching transformers {version}'s source (pip download, no dependencies) into {wheels}",
              file=sys.stderr)
        try:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                                   "-d", str(wheels), f"transformers=={version}"],
                                  capture_output=True, text=True, timeout=timeout)
            failed = proc.returncode != 0
        except (OSError, subprocess.TimeoutExpired):
            failed = True
        found = sorted(wheels.glob(f"transformers-{version}-*.whl"))
        if failed or not found:
            raise NoTransformersSource(
                f"transformers {version}'s source could not be downloaded here (pip download transformers=={version} "
                f"failed); pass --transformers-source WHEEL|DIR (a transformers-{version} wheel, or a site-packages "
                "holding its transformers/)")
    tree = open_source(found[-1])
    if tree.version != version:
        raise BadTransformersSource(f"{found[-1]}: holds transformers {tree.version}, not {version}")
    return SourceTree(tree.version, tree.root, f"transformers {version} wheel (pip download)")


def python_transformers(python: str) -> tuple[str | None, str | None]:
    """(transformers' version in `python`, or None when it has none; None, or — when its transformers cannot be
    imported — the one line that says why and what fixes it). agent.migrate.import_probe runs there and imports
    the modules every model imports, not only transformers' lazy top level."""
    from agent.migrate import import_probe

    try:
        proc = subprocess.run([python, import_probe.__file__], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": ""})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{python}: cannot be run ({exc.strerror if isinstance(exc, OSError) else 'timed out'})"
    from engine.safe_load import LoadError, loads_json

    lines = proc.stdout.strip().splitlines()
    try:
        answer = loads_json(lines[-1], "the import probe's answer") if lines else None
    except LoadError:
        answer = None
    if not isinstance(answer, dict):
        from agent.child_failure import child_failure

        reason = child_failure(proc.stderr, proc.returncode, no_answer="it printed no answer")
        return None, f"{python}: cannot run the import probe ({reason})"
    version = answer.get("version") if isinstance(answer.get("version"), str) else None
    if isinstance(answer.get("failure"), dict):
        return version, import_probe.line(answer["failure"], python)
    if answer.get("error"):
        return version, f"{python}: cannot import transformers ({answer['error']})"
    return version, None


def python_version_of(python: str) -> str | None:
    """The transformers version `python` imports, or None when it cannot run, has none or cannot import it."""
    version, problem = python_transformers(python)
    return None if problem else version


def reference_python(version: str, given: str | None) -> str:
    """The interpreter the recipe and its parity reference run with: `given` (checked to have
    transformers==version, importable), else `python3` on PATH when it has it. EnvironmentProblem (exit 4)
    otherwise, naming an import failure with its fix."""
    from agent.errors import EnvironmentProblem

    if given:
        # absolute, links kept (a venv's python is a link out of it): the checks and runs start in other folders
        python = os.path.abspath(shutil.which(given) or given)
        found, problem = python_transformers(python)
        if found == version and problem:
            raise EnvironmentProblem(f"--reference-python {given}: {problem}")
        if found != version:
            raise EnvironmentProblem(f"--reference-python {given}: " + (f"has transformers {found}" if found else
                                     "cannot import transformers") + f", the recipe pins {version}; give an "
                                     f"interpreter with transformers=={version} (the checkout's launcher environment)")
        return python
    from npu_standin.environment import launcher_path

    python3 = shutil.which("python3", path=launcher_path())     # under the stand-in too: the user's python3
    found, problem = python_transformers(python3) if python3 else (None, None)
    if found == version and problem:        # the launcher environment the user meant, broken
        raise EnvironmentProblem(f"python3 on PATH: {problem}")
    if found == version:
        return python3
    other = interpreter_with(version)
    where = f": {other} has it" if other else f"; `{build_command(version)[1]}` builds one"
    raise EnvironmentProblem(
        f"the recipe pins transformers {version} (the checkout's) and runs with it, but this interpreter has "
        f"{installed_version()} and python3 on PATH has no transformers {version}: pass --reference-python PY (an "
        f"interpreter with transformers=={version}, the checkout's launcher environment) for its trial runs and "
        f"parity{where}")


# ---- an interpreter with the pin, for the advice of a refusal --------------------------------------------
PROJECT = Path(__file__).resolve().parents[2]       # a checkout of this project (make install-tf50), or site-packages
VENV_BASE_PTH = "_infer_migrator_base.pth"


def _make_target(version: str) -> tuple[str, Path] | None:
    """(the make target, the interpreter it builds) when this project is a checkout whose Makefile builds a venv
    with transformers==version (install-tf50: VENV_TF50 from constraints-transformers-5.0.txt)."""
    makefile, constraints = PROJECT / "Makefile", PROJECT / "constraints-transformers-5.0.txt"
    if not (makefile.is_file() and constraints.is_file()):
        return None
    text = makefile.read_text(errors="replace")
    venv = re.search(r"^VENV_TF50\s*\?=\s*(\S+)\s*$", text, re.M)
    pinned = re.search(r"^transformers==(\S+)\s*$", constraints.read_text(errors="replace"), re.M)
    if not (venv and pinned and pinned.group(1) == version and re.search(r"^install-tf50:", text, re.M)):
        return None
    return "install-tf50", PROJECT / venv.group(1) / "bin" / "python"


def cache_venv(version: str) -> Path:
    """Where build_command's venv recipe puts an interpreter with transformers==version."""
    return cache_root() / "venvs" / f"transformers-{version}"


def build_command(version: str) -> tuple[Path, str]:
    """(the interpreter, the one shell line that builds it): this checkout's `make install-tf50` where it builds
    that release, else a venv in the cache that sees the migrator's packages (a .pth, as make's .venv-tf5.0 does)
    and holds transformers==version of its own."""
    import json
    import shlex
    import sysconfig

    made = _make_target(version)
    if made is not None:
        return made[1], f"make -C {shlex.quote(str(PROJECT))} {made[0]}"
    venv = cache_venv(version)
    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    pth = f"import site; site.addsitedir({json.dumps(sysconfig.get_paths()['purelib'])})"   # one quoting for the shell
    python = venv / "bin" / "python"
    return python, (f"{shlex.quote(sys.executable)} -m venv {shlex.quote(str(venv))} && echo {shlex.quote(pth)} > "
                    f"{shlex.quote(str(site / VENV_BASE_PTH))} && {shlex.quote(str(python))} -m pip install -q "
                    f"transformers=={version}")


def interpreter_with(version: str) -> str | None:
    """An interpreter here, besides python3 on PATH, whose transformers==version imports: this checkout's venvs
    (.venv-tf*), then build_command's cache venv."""
    candidates = sorted(PROJECT.glob(".venv-tf*/bin/python")) + [cache_venv(version) / "bin" / "python"]
    for python in candidates:
        if python.is_file() and python_transformers(str(python)) == (version, None):
            return str(python)
    return None


def run_advice(checkout: Path | None, given_source: str | None, given_python: str | None) -> tuple[list[str], str | None]:
    """What a `migrator run` into `checkout` needs added to work as typed, for the interpreter plan_for asks
    for: (arguments to add, a command to run first or None). An interpreter here with the pin: `--reference-python`
    it; none: the command that builds one, and `--reference-python` the one it builds. A given --reference-python
    is checked as plan_for checks it (its own exit-4 line)."""
    installed = installed_version()
    if given_source == INSTALLED:
        return [], None
    pin = checkout_pin(checkout) if checkout is not None else None
    version = open_source(given_source).version if given_source else (pin[0] if pin else installed)
    if version == installed:
        return [], None
    if given_python:
        reference_python(version, given_python)
        return [], None
    from npu_standin.environment import launcher_path

    python3 = shutil.which("python3", path=launcher_path())
    if python3 and python_transformers(python3) == (version, None):
        return [], None
    found = interpreter_with(version)
    if found:
        return ["--reference-python", found], None
    python, build = build_command(version)
    return ["--reference-python", str(python)], build


@dataclass(frozen=True)
class Plan:
    """What a migration vendors from and runs with (None tree: the installed transformers)."""
    version: str
    tree: SourceTree | None
    python: str | None


INSTALLED = "installed"     # --transformers-source installed: the installed release, whatever the checkout pins


def check_source_fits(given: str | None, inside_checkout: bool) -> None:
    """--transformers-source is for a recipe vendored into a checkout: refused (exit 2) for a standalone one,
    before its archive is opened or anything is written."""
    if given not in (None, INSTALLED) and not inside_checkout:
        from agent.errors import InputError

        raise InputError("--transformers-source is for a recipe in a cann-recipes-infer checkout (--target framework "
                         "or legacy): a standalone recipe is vendored from the installed transformers")


def plan_for(checkout: Path | None, given_source: str | None, given_python: str | None) -> Plan:
    """The transformers a recipe is vendored from: the checkout's pin when it differs from the
    installed one (its source given, else fetched), else the installed one. A source of another
    release than the pin vendors from that source; `installed` vendors from the installed release."""
    installed = installed_version()
    if given_source == INSTALLED:
        return Plan(installed, None, given_python)
    tree = open_source(given_source) if given_source else None
    pin = checkout_pin(checkout) if checkout is not None else None
    version = tree.version if tree else (pin[0] if pin else installed)
    if version == installed:
        return Plan(version, None, given_python)    # the installed release's own files
    python = reference_python(version, given_python)     # before a download: without it nothing can run
    return Plan(version, tree or fetch_source(version), python)
