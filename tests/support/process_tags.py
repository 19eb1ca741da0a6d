"""The live processes of a test: each test tags the environment of what it starts (FIELD_TAG), and the tag finds
every process of the tree it started, wherever it was reparented."""

from __future__ import annotations

from pathlib import Path


def _tagged(tag: str) -> list[int]:
    """Live processes whose environment carries the tag."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"FIELD_TAG={tag}".encode() in (entry / "environ").read_bytes():
                status = (entry / "status").read_text()
                if "State:\tZ" not in status:
                    found.append(int(entry.name))
        except OSError:
            continue
    return found
