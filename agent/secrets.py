"""Secrets the migrator is handed (the LLM repairer's API key): held in this process, never written.

The CLI calls `hold_secrets()` first thing: the key leaves os.environ, so no child (trial runs of infer.sh,
the parity check, pip) inherits it and no run log can print it; `held()` gives it to the one client that
sends it. `redact()` replaces it (whole, and each line of a multi-line value) by *** in any text that may
reach a file or the terminal: notes, errors, the report and the summary.
"""

from __future__ import annotations

import os
import re

SECRET_VARS = ("MIGRATOR_LLM_API_KEY",)
_held: dict[str, str] = {}


def hold_secrets() -> None:
    for name in SECRET_VARS:
        value = os.environ.pop(name, None)
        if value is not None:
            _held[name] = value


def held(name: str) -> str | None:
    """The secret `name`: held by hold_secrets(), else (a library caller that did not hold) the environment."""
    return _held.get(name, os.environ.get(name))


def redact(text: str) -> str:
    values = [v for v in [*_held.values(), *(os.environ.get(n) for n in SECRET_VARS)] if v]
    pieces = {p.strip() for v in values for p in [v, *re.split(r"[\r\n]+", v)]}
    for piece in sorted((p for p in pieces if len(p) >= 4), key=len, reverse=True):
        text = text.replace(piece, "***")
    return text
