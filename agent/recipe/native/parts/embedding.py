"""The input embedding: module.linear's VocabParallelEmbedding, scaled by sqrt(hidden_size) where the architecture
scales it (gemma's normaliser) — read from what reaches the first layer."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.part import Match, Part


def first_layer_input(probe):
    """(what reaches the first layer, the embedding rows of the same tokens), of equal shape."""
    import torch

    base, seen = probe.base, {}

    def keep(module, args, kwargs):
        seen.setdefault("x", (args[0] if args else kwargs["hidden_states"]).detach())

    handle = base.layers[0].register_forward_pre_hook(keep, with_kwargs=True)
    ids = torch.tensor([[3, 5, 7]])
    try:
        with torch.no_grad():
            probe.model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    table = base.embed_tokens.weight.detach()[ids[0]]
    return seen["x"].reshape(table.shape), table


def embed_scale(probe) -> bool:
    """Whether the model multiplies the embedding lookup by sqrt(hidden_size) (in the model's dtype) before the
    first layer; anything other than that or nothing is not native."""
    import torch

    got, table = first_layer_input(probe)
    hidden = probe.hidden
    if torch.allclose(got, table, rtol=1e-5, atol=1e-6):
        return False
    if torch.allclose(got, table * torch.tensor(hidden ** 0.5, dtype=table.dtype), rtol=1e-5, atol=1e-6):
        return True
    raise NotNative("model", "the embedding is scaled by something other than 1 or sqrt(hidden_size)")


def _probe(probe, chosen):
    return Match(EMBEDDING, options={"EMBED_SCALE": embed_scale(probe)})


EMBEDDING = Part(
    slot="embedding", name="embedding", code=None, provides=None, reads=("vocab_size", "hidden_size", "pad_token_id"),
    probe=_probe, options=("EMBED_SCALE",),
    kernels=lambda m: ((), ("embedding scale sqrt(hidden_size): plain torch multiply",) if m.options["EMBED_SCALE"] else ()))
