"""scripts/native_coverage.py --types-of PYTHON: the population another interpreter's transformers registers
(upstream pins 5.0.0), read by running that interpreter, and a one-line error where it cannot be read."""

from __future__ import annotations

import sys

import pytest

from locations import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import native_coverage  # noqa: E402 - the script's folder on sys.path first


def test_an_interpreter_without_transformers_is_one_line(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named transformers' >&2\nexit 1\n")
    python.chmod(0o755)
    with pytest.raises(ValueError) as err:
        native_coverage.types_of(str(python))
    assert "does not import (ModuleNotFoundError" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="cannot run it"):
        native_coverage.types_of(str(tmp_path / "missing"))


@pytest.mark.skipif(not (REPO_ROOT / ".venv-tf5.0" / "bin" / "python").exists(), reason="make install-tf50 first")
def test_upstreams_pin_registers_types_the_installed_one_lacks():
    version, types = native_coverage.types_of(str(REPO_ROOT / ".venv-tf5.0" / "bin" / "python"))
    assert version == "5.0.0" and len(types) < len(native_coverage.all_types())
    assert set(types) - set(native_coverage.all_types())       # code_llama: an alias 5.24 dropped
    assert "llama" in types and types == sorted(types)


def test_an_interpreter_that_prints_nothing_is_one_line(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    with pytest.raises(ValueError, match="printed nothing"):
        native_coverage.types_of(str(python))
