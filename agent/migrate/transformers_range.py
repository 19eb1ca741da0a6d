"""What each end of the supported transformers range (pyproject: >=5.0,<6) can migrate.

Upstream pins transformers 5.0.0; CI runs the family tests on 5.0.0 as well as on the tested newest
release (constraints-transformers-5.0.txt). An architecture whose source in an older release cannot be
vendored into a recipe is a row here: below its version the run stops before anything is written, with
one line naming the version it needs (exit 3), instead of failing halfway through vendoring.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from agent.errors import UnsupportedModelError
from engine.safe_load import load_json


@dataclass(frozen=True)
class NeedsNewer:
    model_type: str
    version: str        # the first release that works
    why: str            # what breaks below it


ROWS = (
    # Before 5.20 configuration_gemma3.py imports SiglipVisionConfig at module level (the multimodal
    # Gemma3Config lives in the same file): the vendored configuration keeps a transformers model import
    # (exit 7 after the checkpoint was read). Found by the family tests on 5.0.0; 5.19 -> 5.20 bisected.
    NeedsNewer("gemma3_text", "5.20.0", "its configuration module imports siglip's vision config"),
)
BY_TYPE = {row.model_type: row for row in ROWS}


def _version_tuple(text: str) -> tuple[int, ...]:
    out = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        out.append(int(digits[:12] or 0))     # a version of 5000 digits (a forged __init__.py): huge, never a crash
    return tuple(out)


def needed_version(model_type: str, installed: str | None = None) -> NeedsNewer | None:
    """The row refusing `model_type` on `installed` (default: the imported transformers), or None."""
    row = BY_TYPE.get(model_type)
    if row is None:
        return None
    if installed is None:
        import transformers

        installed = transformers.__version__
    return row if _version_tuple(installed) < _version_tuple(row.version) else None


def check_checkpoint_supported(model_dir: Path) -> None:
    """Exit 3 with one line when the installed transformers is too old for this checkpoint's model_type."""
    try:
        model_type = load_json((Path(model_dir) / "config.json")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return          # the checkpoint checks say what is wrong with config.json
    if not isinstance(model_type, str):
        return
    row = needed_version(model_type)
    if row is not None:
        import transformers

        raise UnsupportedModelError(
            f"model_type {model_type!r} needs transformers >= {row.version} ({row.why} before that); "
            f"transformers {transformers.__version__} is installed: pip install 'transformers>={row.version},<6'")
