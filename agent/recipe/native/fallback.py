"""The one answer of every native probe that does not recognise what it reads: `NotNative(kind, reason)`,
the layer kind that keeps the adapter and why (agent.recipe.native.decide records both)."""

from __future__ import annotations


class NotNative(Exception):
    """The architecture is not written natively: `kind` is the layer kind that fell back, `reason` why."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"{kind}: {reason}")
        self.kind, self.reason = kind, reason
