"""Where things are: the checkout under test and the suite's data."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS = REPO_ROOT / "tests"
DATA = TESTS / "data"
