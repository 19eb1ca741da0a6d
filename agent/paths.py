"""Where templates/, scripts/ and skills/ live: beside the packages (checkout or editable
install) or under <prefix>/share/infer-migrator/ (regular install)."""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def asset_dir(name: str) -> Path:
    candidates = [REPO_ROOT / name]
    for prefix in {sys.prefix, sysconfig.get_paths()["data"]}:
        candidates.append(Path(prefix) / "share" / "infer-migrator" / name)
    for path in candidates:
        if path.is_dir():
            return path
    raise FileNotFoundError(f"infer-migrator asset folder '{name}' not found; reinstall the package")


def templates_dir() -> Path:
    return asset_dir("templates")


def skills_dir() -> Path:
    return asset_dir("skills")


def demo_model_dir() -> Path:
    """The shipped demo checkpoint (trained by scripts/train_demo_model.py)."""
    return asset_dir("demo/tiny-attention-llama")


def cache_home() -> Path:
    """The user's cache folder: $XDG_CACHE_HOME when it is an absolute path, else ~/.cache. A relative one is
    ignored, as the XDG spec says (it would put our caches and locks under whatever folder a command runs in)."""
    given = os.environ.get("XDG_CACHE_HOME") or ""
    return Path(given) if os.path.isabs(given) else Path.home() / ".cache"


OUTER_TMP_ENV = "MIGRATOR_OUTER_TMPDIR"   # set for a process tree: the temporary folder outside its own


def outer_tempdir() -> Path:
    """The temporary folder outside every process tree's own (a tree's TMPDIR, agent.processes, is removed
    when the tree ends): where what must outlive a tree goes — a checkout migration's resume store, locks,
    crash reports, the compile cache."""
    import tempfile

    return Path(os.environ.get(OUTER_TMP_ENV) or tempfile.gettempdir())
