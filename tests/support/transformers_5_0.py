"""The interpreter of .venv-tf5.0 (make install-tf50) and its site-packages holding transformers 5.0.0, the
release upstream pins."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from locations import REPO_ROOT


TF50_PYTHON = REPO_ROOT / ".venv-tf5.0" / "bin" / "python"


def tf50_site() -> tuple[Path, Path]:
    """(.venv-tf5.0's python, its site-packages holding transformers 5.0.0), or skip."""
    if not TF50_PYTHON.is_file():
        pytest.skip(f"no {TF50_PYTHON} (make install-tf50 builds it)")
    site = subprocess.run([str(TF50_PYTHON), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    if not (Path(site) / "transformers" / "__init__.py").is_file():
        pytest.skip(f"{site} holds no transformers")
    return TF50_PYTHON, Path(site)
