"""The native generator's one fall-back answer, for every layer kind (agent.recipe.native.features and the
per-kind readers it consults, mla_features / moe_features, raise it; decide keeps the adapter on it)."""


class NotNative(Exception):
    """The architecture is not written natively: `kind` is the layer kind that fell back, `reason` why."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"{kind}: {reason}")
        self.kind, self.reason = kind, reason
