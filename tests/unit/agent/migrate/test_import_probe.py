"""An interpreter whose transformers cannot be imported (agent/migrate/import_probe.py): the failure classified
from the traceback of a real import — which installed package raised, which one's import brought it in, the
error's own message and the fix from the importer's metadata — in one line and exit 4, never exit 70 "internal
error". Packages installed here for the cases (a site folder with dist-info metadata, as pip writes it); the real
case, transformers 5.0.0 beside kernels >= 0.11 in a venv built from PyPI, is the slow test at the end."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent.migrate import import_probe
from locations import REPO_ROOT

KERNELS_ERROR = "Either a revision or a version must be specified."


def _package(site: Path, name: str, version: str, files: dict[str, str], requires: tuple[str, ...] = ()) -> None:
    for rel, text in files.items():
        path = site / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\n" f"Name: {name}\nVersion: {version}\n" +
                                   "".join(f"Requires-Dist: {r}\n" for r in requires))
    (info / "top_level.txt").write_text(name + "\n")
    (info / "RECORD").write_text("".join(f"{name}/{rel},,\n" for rel in files))


@pytest.fixture
def site(tmp_path, monkeypatch):
    """Installed packages: `hostlib` 5.0.0, whose lazily imported `hostlib.act` imports `plug` (hostlib asks for
    plug<0.11,>=0.10.2 in an extra, as transformers asks for kernels), `plug` 0.19.1 raising at import; a package
    needing a module nobody installed; one that raises in its own code at import; one that imports fine."""
    site = tmp_path / "site"
    _package(site, "hostlib", "5.0.0", {"__init__.py": "__version__ = '5.0.0'\n",
                                         "act.py": "from .integrations import hub\n",
                                         "integrations/__init__.py": "", "integrations/hub.py": "import plug\n"},
             requires=("plug<0.11,>=0.10.2; extra == \"hub\"", "other>=1"))
    _package(site, "plug", "0.19.1", {"__init__.py": "from .layer import Repo\nREPO = Repo()\n",
                                      "layer.py": f"class Repo:\n    def __init__(self):\n        raise ValueError({KERNELS_ERROR!r})\n"})
    _package(site, "needy", "1.2.0", {"__init__.py": "import absentdep\n"}, requires=("absentdep>=2",))
    _package(site, "selfbroken", "3.0.0", {"__init__.py": "raise RuntimeError('compiled for another torch')\n"})
    _package(site, "fine", "1.0.0", {"__init__.py": "def boom():\n    raise KeyError('not an import')\n"})
    _package(site, "pinned", "2.0.0", {"__init__.py": "import plug\n"}, requires=("plug>=0.19",))
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    yield site
    for name in list(sys.modules):
        if name.split(".")[0] in ("hostlib", "plug", "needy", "selfbroken", "fine", "pinned", "absentdep"):
            del sys.modules[name]


def _raised(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the exception is what the test classifies
        return exc
    raise AssertionError("nothing raised")


def test_a_package_that_breaks_its_importer_is_named_with_the_importers_requirement(site):
    found = import_probe.failure(_raised(lambda: importlib.import_module("hostlib.act")))
    assert found == {"error": f"ValueError: {KERNELS_ERROR}", "module": "hostlib.act", "package": "plug",
                     "package_version": "0.19.1", "missing": False, "importer": "hostlib", "importer_version": "5.0.0",
                     "requirement": "<0.11,>=0.10.2", "optional": True}
    assert import_probe.line(found, "/v/bin/python") == (
        f"/v/bin/python: hostlib 5.0.0 cannot be imported: importing hostlib.act fails in plug 0.19.1 (ValueError: "
        f"{KERNELS_ERROR}); hostlib 5.0.0 asks for plug<0.11,>=0.10.2: `/v/bin/python -m pip install "
        "'plug<0.11,>=0.10.2'`, or `/v/bin/python -m pip uninstall -y plug` (hostlib 5.0.0 needs it only for an extra)")


def test_a_lazy_attribute_import_from_our_own_code_is_classified_too(site):
    """The migrator's own frames first (as `hasattr(transformers, arch)` in vendor.locate_source): still the
    installed packages' failure."""
    def ours():
        return importlib.import_module("hostlib.act")
    found = import_probe.failure(_raised(ours))
    assert found["package"] == "plug" and found["importer"] == "hostlib"


@pytest.mark.parametrize("module,expected", [
    ("needy", "/v/bin/python: needy 1.2.0 cannot be imported: importing needy fails (ModuleNotFoundError: No module "
              "named 'absentdep'); install it: `/v/bin/python -m pip install 'absentdep>=2'`"),
    ("selfbroken", "/v/bin/python: selfbroken 3.0.0 cannot be imported: importing selfbroken fails (RuntimeError: "
                   "compiled for another torch); reinstall it: `/v/bin/python -m pip install --force-reinstall "
                   "'selfbroken==3.0.0'`"),
    ("pinned", "/v/bin/python: pinned 2.0.0 cannot be imported: importing pinned fails in plug 0.19.1 (ValueError: "
               f"{KERNELS_ERROR}); install a plug release pinned 2.0.0 works with, or `/v/bin/python -m pip uninstall "
               "-y plug` if nothing else needs it"),
])
def test_other_import_failures_get_their_own_fix(site, module, expected):
    found = import_probe.failure(_raised(lambda: importlib.import_module(module)))
    assert import_probe.line(found, "/v/bin/python") == expected


def test_what_is_not_an_installed_packages_import_failure_is_left_to_the_internal_error(site):
    import fine

    assert import_probe.failure(_raised(fine.boom)) is None                     # raised by a call, not at import
    assert import_probe.failure(_raised(lambda: {}["x"])) is None               # our own code
    assert import_probe.failure(_raised(lambda: importlib.import_module("agent.nonexistent_module"))) is None


def test_the_cli_answers_an_import_failure_in_one_line_and_exit_4(site, monkeypatch, capsys):
    from agent import cli

    monkeypatch.setattr(cli, "cmd_env", lambda args: importlib.import_module("hostlib.act"))
    code = cli.main(["env"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 4 and len(err) == 1, err
    assert err[0].startswith(f"migrator: error: {sys.executable}: hostlib 5.0.0 cannot be imported: importing "
                             "hostlib.act fails in plug 0.19.1") and "internal error" not in err[0]


def test_the_probe_script_answers_for_another_interpreter(site, tmp_path):
    """Run as a script, as transformers_source runs it in a reference interpreter (PYTHONPATH cleared there:
    the interpreter here is given the site folder by a wrapper, as a venv's .pth would)."""
    from agent.migrate.transformers_source import python_transformers

    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    probe = subprocess.run([str(wrapper), import_probe.__file__, "hostlib.act"], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert '"package": "plug"' in probe.stdout, probe.stderr
    version, problem = python_transformers(sys.executable)       # this interpreter's transformers imports
    assert version and problem is None


# ---- the real case: transformers 5.0.0 beside kernels >= 0.11 -----------------------------------------------
@pytest.fixture(scope="module")
def broken_launcher_env(tmp_path_factory):
    """A venv layered like .venv-tf5.0 (a .pth to this interpreter's packages; transformers 5.0.0 of its own) with
    `kernels>=0.11` from PyPI, as a newer transformers pulls it in."""
    import sysconfig

    venv = tmp_path_factory.mktemp("tf50_kernels") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "_infer_migrator_base.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "-c",
                           str(REPO_ROOT / "constraints-transformers-5.0.txt"), "transformers", "kernels>=0.11"],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.skip(f"PyPI not reachable here: {proc.stderr.strip().splitlines()[-1:]}")
    return python


@pytest.mark.slow
def test_transformers_5_0_beside_kernels_0_11_is_one_line_naming_the_fix(broken_launcher_env, tmp_path):
    """The maintainer's environment, for real: `migrator run` from it (exit 70 before) and `--reference-python`
    naming it (exit 1 'unknown failure' at the trial run before) are exit 4 with the import error's message and
    the pip command; the pip command, run, mends it."""
    from agent.errors import EnvironmentProblem
    from agent.measure import reference as upstream
    from agent.migrate.transformers_source import python_transformers, reference_python

    python = str(broken_launcher_env)
    version, problem = python_transformers(python)
    assert version == "5.0.0" and problem.startswith(f"{python}: transformers 5.0.0 cannot be imported: importing "
                                                     "transformers.activations fails in kernels ")
    assert f"(ValueError: {KERNELS_ERROR}); transformers 5.0.0 asks for kernels<0.11,>=0.10.2" in problem
    with pytest.raises(EnvironmentProblem) as caught:
        reference_python("5.0.0", python)
    assert caught.value.exit_code == 4 and str(caught.value) == f"--reference-python {python}: {problem}"
    checkpoint = upstream.tiny_checkpoint("qwen3", tmp_path / "ckpt")
    run = subprocess.run([python, "-m", "agent.cli", "run", str(checkpoint), "--output-dir", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 4 and len(lines) == 1 and "internal error" not in run.stderr, run.stderr[-2000:]
    assert "transformers 5.0.0 cannot be imported" in lines[0] and f"install 'kernels<0.11,>=0.10.2'" in lines[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    fix = lines[0].split("asks for kernels<0.11,>=0.10.2: `")[1].split("`")[0]
    subprocess.run(fix, shell=True, check=True, capture_output=True, timeout=900)
    assert python_transformers(python) == ("5.0.0", None)
