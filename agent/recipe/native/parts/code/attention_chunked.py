"""Chunked local attention (llama4's chunked_attention layers): a prefill's packed prompts cut at their chunk
boundaries, each piece then attending causally as a sequence of its own."""

import torch


def chunk_bounds(cu_lengths, chunk):
    """The packed prompts' cumulative lengths with each prompt cut every `chunk` tokens: the pieces attend as sequences
    of their own (read on the host: a prefill runs eager)."""
    bounds, start = [], 0
    for end in cu_lengths.tolist():
        bounds += list(range(start + chunk, end, chunk)) + [end]
        start = end
    return torch.tensor(bounds, dtype=cu_lengths.dtype, device=cu_lengths.device)
