"""Rows across a communication group whose ranks may hold other requests: attention data parallel gives each
group of attn_tp_size ranks its own requests, so a group of `size` consecutive ranks that attn_tp_size does not
divide (moe_tp_group, embed_tp_group, lmhead_tp_group under attention DP) gathers every rank's rows, computes on
them all, and gives each rank its own back (upstream's deepseek_r1 embeds over a wider embed_tp_group so)."""

import torch
import torch.distributed as dist


def spans_requests(size, attn_tp_size):
    """Whether a group of `size` consecutive ranks holds ranks of more than one attention data-parallel group."""
    return size > 1 and attn_tp_size % size != 0


def gather_rows(x, group, size, is_prefill):
    """(every rank's rows of `group`, each rank's block padded to the longest, in rank order; this rank's own row
    count). A prefill's rows differ by rank (their requests' prompts); a decode's are the batch, padded alike on
    every rank by the executor (batch_size_per_dp_rank), so no count is read back to the host there."""
    rows = x.shape[0]
    if is_prefill:
        longest = torch.tensor([rows], dtype=torch.int64, device=x.device)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
        longest = int(longest.item())
        if longest > rows:
            x = torch.cat([x, x.new_zeros((longest - rows, *x.shape[1:]))])
    gathered = x.new_empty((size * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(gathered, x.contiguous(), group=group)
    return gathered, rows


def sum_own_rows(y, group, size, rows):
    """The sum over `group` of every rank's partial `y` of the gathered rows (gather_rows'), this rank's own rows."""
    out = y.new_empty((y.shape[0] // size, *y.shape[1:]))
    dist.reduce_scatter_tensor(out, y.contiguous(), group=group)
    return out[:rows]


def own_rows_whole(y, group, size, rows):
    """This rank's own rows of the gathered rows, their last axis whole: each rank of `group` holds its slice of
    that axis (a vocabulary shard of the logits) for every gathered row."""
    parts = torch.empty_like(y)
    dist.all_to_all_single(parts, y.contiguous(), group=group)
    block = y.shape[0] // size
    whole = parts.view(size, block, *y.shape[1:]).movedim(0, -2)
    return whole.reshape(block, *y.shape[1:-1], size * y.shape[-1])[:rows]
