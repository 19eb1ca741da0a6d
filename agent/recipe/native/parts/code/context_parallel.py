"""Prefill context parallel as upstream's executor lays it out (executor/core/engine/execution_engine.py
_apply_prefill_cp, forward_metadata.cp_metadata): every CP rank gets the whole batch, each request padded to
2 * cp_size equal segments; rank r computes segments r and 2 * cp_size - 1 - r of every request (zigzag: equal
causal work per rank). Its queries attend over the keys and values gathered from every rank: the earlier segment
over the request's first r + 1 segments (kv_len_prev), the later over its first 2 * cp_size - r (kv_len_next),
causal from the bottom right. The cache keeps only the requests this rank decodes (persistent_valid_indices into
persistent_slot_mapping, the executor's request_cp_rank)."""

import torch
import torch.distributed as dist


def prefill_cp(forward_metadata):
    """The prefill's context-parallel metadata, None when this step is not split over CP ranks."""
    cp = getattr(forward_metadata, "cp_metadata", None)
    return cp if forward_metadata.is_prefill and cp is not None and cp.enabled else None


def gather_cp(local, cp, group):
    """Every CP rank's local rows (the same count on each) -> the padded batch's rows in its token order."""
    parts = [torch.empty_like(local) for _ in range(cp.cp_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts).index_select(0, cp.restore_indices.to(local.device))


def cp_key_rows(cp, kv_lens):
    """Per request, the padded batch's rows its segment attends to (the first kv_len of the request's padded
    rows; kv_lens: cp_metadata.kv_len_prev or kv_len_next) and their cumulative lengths (actual_seq_kvlen)."""
    cumulative = cp.actual_seq_q_prev.tolist()
    segments = [end - start for start, end in zip([0] + cumulative[:-1], cumulative)]
    rows, start = [], 0
    for segment, kv_len in zip(segments, kv_lens.tolist()):
        rows.extend(range(start, start + kv_len))
        start += 2 * cp.cp_size * segment
    device = cp.actual_seq_q_prev.device
    return torch.tensor(rows, dtype=torch.long, device=device), kv_lens.long().cumsum(0).to(device)
