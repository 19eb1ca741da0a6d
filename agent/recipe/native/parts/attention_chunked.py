"""Chunked local attention (llama4's config.layer_types "chunked_attention" layers): a query at position p attends to
the keys of its own chunk alone, positions floor(p / attention_chunk_size) x attention_chunk_size .. p (transformers'
chunked causal mask). The fused attention's CHUNKED (parts/code/attention_fused.py): a prefill cuts each prompt at its
chunk boundaries and runs the pieces as sequences of their own (causal within each); a decode reads its chunk's blocks
alone from the block table, as a sliding window reads its window's (the chunk a multiple of the block size: a chunk
starts on a block). Read numerically on the model's own mask: the first chunked layer's attention, called with the
mask and positions the model hands it on a config with a small chunk, must not see keys before its query's chunk,
must see the keys of it up to the query, and a full-attention layer must see them all."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative

CHUNK_KEY = "attention_chunk_size"
CHUNKED_KIND = "chunked_attention"
PROBE_CHUNK = 4         # the probe's chunk: its 2 x PROBE_CHUNK tokens are two chunks
SMALL_CHUNK = 8         # the family setting's chunk: a multiple of the self-check's block size (4) that its prompts
                        # (13 tokens) and decode steps (to 18) cross


def _layer_call(probe, index: int, length: int):
    """(args, kwargs) of layer `index`'s attention as the base model calls it on `length` tokens."""
    import torch

    seen = {}

    def keep(module, args, kwargs):
        seen.setdefault("call", (args, kwargs))

    attention = probe.layers[index].self_attn
    handle = attention.register_forward_pre_hook(keep, with_kwargs=True)
    ids = torch.randint(0, probe.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(13))
    try:
        with torch.no_grad():
            probe.base(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    return seen["call"]


def _sees(probe, index: int, call, query: int, key: int) -> bool:
    """Whether layer `index`'s attention output at `query` changes with its input at `key`, called as `call` (the
    model's own mask: _layer_call)."""
    import torch

    args, kwargs = call
    attention = probe.layers[index].self_attn
    x = kwargs.get("hidden_states", args[0] if args else None)
    moved = x.clone()
    moved[:, key] += torch.randn(moved[:, key].shape, generator=torch.Generator().manual_seed(14))
    outputs = []
    for hidden in (x, moved):
        call = {**kwargs, "hidden_states": hidden} if "hidden_states" in kwargs else kwargs
        with torch.no_grad():
            out = attention(*((hidden,) + tuple(args[1:]) if "hidden_states" not in kwargs else args), **call)
        outputs.append(out[0] if isinstance(out, tuple) else out)
    return not torch.allclose(outputs[0][:, query], outputs[1][:, query], rtol=1e-5, atol=1e-6)


def chunked_attention(probe) -> bool:
    """CHUNKED: whether config.layer_types names chunked_attention layers (memoised); NotNative where their
    attention is not transformers' chunked causal mask of attention_chunk_size."""
    if "chunked_attention" in probe.memo:
        return probe.memo["chunked_attention"]
    kinds = list(getattr(probe.config, "layer_types", None) or [])
    found = CHUNKED_KIND in kinds
    if found:
        chunk = getattr(probe.config, CHUNK_KEY, None)
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise NotNative("attention", f"chunked_attention layers with {CHUNK_KEY} {chunk!r}: no chunk to attend in")
        small = probe.variant({CHUNK_KEY: PROBE_CHUNK})
        chunked = kinds.index(CHUNKED_KIND)
        full = next((i for i, kind in enumerate(kinds) if kind == "full_attention"), None)
        c = PROBE_CHUNK
        try:
            call = _layer_call(small, chunked, 2 * c)
            readings = (_sees(small, chunked, call, c + 1, c - 1), _sees(small, chunked, call, c + 1, c),
                        _sees(small, chunked, call, c + 1, c + 2),
                        _sees(small, full, _layer_call(small, full, 2 * c), c + 1, 0) if full is not None else True)
        except Exception as exc:  # noqa: BLE001 - a layer transformers' model does not call so: not this form
            raise NotNative("attention", f"chunked local attention ({CHUNK_KEY}): its layers' attention could not be "
                                         "read on the model's mask") from exc
        if readings != (False, True, False, True):
            raise NotNative("attention", f"chunked_attention layers whose attention is not each query's own chunk of "
                                         f"{CHUNK_KEY} up to it (keys before / in / after its chunk, and a full "
                                         f"layer's: seen {readings})")
    probe.memo["chunked_attention"] = found
    return found


def small_chunk_setting(config) -> dict:
    """The family setting that brings the chunk boundaries within the self-check's prompts."""
    return {CHUNK_KEY: SMALL_CHUNK}
