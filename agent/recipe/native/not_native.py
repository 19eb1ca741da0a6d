"""The native generator's one fall-back answer, for every layer kind (the parts' probes under
agent.recipe.native.parts raise it; agent.recipe.native.compose names the slot no part takes; decide keeps the
adapter on it)."""


class NotNative(Exception):
    """The architecture is not written natively: `kind` is the layer kind that fell back, `reason` why."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"{kind}: {reason}")
        self.kind, self.reason = kind, reason
