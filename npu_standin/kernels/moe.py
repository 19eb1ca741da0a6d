"""MoE routing ops: gating, token permutation by expert, un-permutation with weights.

Orderings follow the op-plugin pages' equivalent numpy logic (stable sorts by expert id), so the
permuted layouts, not only the final sums, are what torch_npu produces.
"""

from __future__ import annotations

import torch

from npu_standin.kernels import refuse, reference


# ---- gating ---------------------------------------------------------------------------------
def _gating_softmax_fake(x, finished=None, k=1):
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int32), x.new_empty(shape, dtype=torch.int32)


@reference("npu_moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1) -> (Tensor, Tensor, Tensor)",
           formulation="softmax(x, -1) in fp32, top-k (values, int32 indices); row_idx = arange(rows*k)"
                       ".reshape(k, rows).T",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py"
                "::test_moe_gating_top_k_softmax_matches_per_row_sort",
           fake=_gating_softmax_fake)
def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    if finished is not None and bool(finished.any()):
        refuse("npu_moe_gating_top_k_softmax", "finished rows set (their outputs are not documented)")
    probs = torch.softmax(x.float(), dim=-1)
    values, indices = torch.topk(probs, k, dim=-1)
    rows = x.numel() // x.shape[-1]
    row_idx = torch.arange(rows * k, dtype=torch.int32, device=x.device).reshape(k, rows).t().reshape(indices.shape)
    return values.to(x.dtype), indices.to(torch.int32), row_idx.contiguous()


def _gating_top_k_fake(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                       group_select_mode=0, renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                       eps=1e-20):
    return (x.new_empty((x.shape[0], k)), x.new_empty((x.shape[0], k), dtype=torch.int32),
            x.new_empty(x.shape, dtype=torch.float32))


@reference("npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, Tensor? input_ids=None, Tensor? tid2eid=None, "
           "int k_group=1, int group_count=1, int group_select_mode=0, int renorm=0, int norm_type=0, "
           "bool out_flag=False, float routed_scaling_factor=1.0, float eps=1e-20) -> (Tensor, Tensor, Tensor)",
           formulation="softmax (norm_type 0) or sigmoid (1) of x, + bias for selection, top k_group groups by max "
                       "(mode 0) or top-2 sum (mode 1), top-k experts; y = norm(x)[idx], renormalised for "
                       "sigmoid, * routed_scaling_factor",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py"
                "::test_moe_gating_top_k_matches_deepseek_v3_router",
           fake=_gating_top_k_fake)
def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                         group_select_mode=0, renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                         eps=1e-20):
    if input_ids is not None or tid2eid is not None:
        refuse("npu_moe_gating_top_k", "input_ids/tid2eid (hash routing)")
    if renorm != 0:
        refuse("npu_moe_gating_top_k", f"renorm={renorm} (only 0 is documented)")
    x32 = x.float()
    normed = torch.softmax(x32, dim=-1) if norm_type == 0 else torch.sigmoid(x32)
    scores = normed + bias.float() if bias is not None else normed
    if group_count > 1:
        grouped = scores.reshape(scores.shape[0], group_count, -1)
        if group_select_mode == 0:
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = _stable_topk_indices(group_scores, k_group)
        mask = torch.ones_like(group_scores, dtype=torch.bool)
        mask.scatter_(1, keep, False)
        scores = grouped.masked_fill(mask[..., None], float("-inf")).reshape(scores.shape[0], -1)
    idx = _stable_topk_indices(scores, k)
    y = torch.gather(normed, 1, idx)
    if norm_type == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    return y.to(x.dtype), idx.to(torch.int32), normed


def _stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """numpy's argsort(-scores, kind="stable")[:, :k]: ties keep the lower index first."""
    return torch.sort(-scores, dim=-1, stable=True).indices[:, :k]


# ---- v1 routing (with npu_moe_gating_top_k_softmax's row_idx) -------------------------------
def _init_routing_fake(x, row_idx, expert_idx, active_num):
    rows, k = expert_idx.shape
    return (x.new_empty((min(rows, active_num) * k, x.shape[-1])),
            x.new_empty((rows * k,), dtype=torch.int32), x.new_empty((rows * k,), dtype=torch.int32))


@reference("npu_moe_init_routing(Tensor x, Tensor row_idx, Tensor expert_idx, int active_num) -> (Tensor, Tensor, Tensor)",
           formulation="stable sort of expert_idx (row-major); sorted_row = row_idx taken in that order; "
                       "expanded_row_idx[sorted_row[i]] = i; expanded_x[i] = x[sorted_row[i] % rows]",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py"
                "::test_moe_init_routing_matches_op_plugin_numpy_logic",
           fake=_init_routing_fake)
def npu_moe_init_routing(x, row_idx, expert_idx, active_num):
    rows, k = expert_idx.shape
    order = torch.sort(expert_idx.reshape(-1), stable=True)
    dst_to_src = row_idx.reshape(-1).long()[order.indices]
    expanded_row_idx = torch.empty_like(dst_to_src)
    expanded_row_idx[dst_to_src] = torch.arange(dst_to_src.numel(), device=x.device)
    active = min(active_num, rows) * k
    expanded_x = x[dst_to_src[:active] % rows]
    return expanded_x, expanded_row_idx.to(torch.int32), order.values.to(torch.int32)


@reference("npu_moe_compute_expert_tokens(Tensor sorted_expert_for_source_row, int num_expert) -> Tensor",
           formulation="for each expert e, the end row of its run: searchsorted(sorted, e, right) (cumulative counts)",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py"
                "::test_moe_compute_expert_tokens_is_cumulative_count",
           fake=lambda sorted_experts, num_expert: sorted_experts.new_empty((num_expert,)))
def npu_moe_compute_expert_tokens(sorted_expert_for_source_row, num_expert):
    experts = torch.arange(num_expert, device=sorted_expert_for_source_row.device,
                           dtype=sorted_expert_for_source_row.dtype)
    ends = torch.searchsorted(sorted_expert_for_source_row.contiguous(), experts, right=True)
    return ends.to(sorted_expert_for_source_row.dtype)


def _finalize_fake(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                   export_for_source_row, drop_pad_mode=0, k=1):
    if scales is not None:
        rows = scales.shape[0]
    else:
        rows = expanded_src_to_dst_row.shape[0] // (k or 1)
    return expanded_permuted_rows.new_empty((rows, expanded_permuted_rows.shape[-1]))


@reference("npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, "
           "Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, int? drop_pad_mode=0, "
           "int? k=1) -> Tensor",
           formulation="out[i] = skip1[i] + skip2[i] + sum_k scales[i,k] * (rows[src_to_dst[i + k*R]] "
                       "+ bias[expert[i,k]]), fp32 accumulate; drop_pad_mode 2: src_to_dst[i*K + k] (by row)",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py"
                "::test_moe_routing_chain_matches_transformers_gpt_oss_experts",
           fake=_finalize_fake)
def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0, k=1):
    if drop_pad_mode not in (None, 0, 2):
        refuse("npu_moe_finalize_routing", f"drop_pad_mode={drop_pad_mode} (expert capacity dropping)")
    if scales is not None:
        rows, topk = scales.shape
    else:
        topk = k or 1
        rows = expanded_src_to_dst_row.shape[0] // topk
    permuted = expanded_permuted_rows.float()
    if drop_pad_mode == 2:         # "by row": position i*k + j, as npu_moe_init_routing_v2 writes it
        src_to_dst = expanded_src_to_dst_row.long().reshape(rows, topk).t()
    else:                          # "by column": position i + j*rows
        src_to_dst = expanded_src_to_dst_row.long().reshape(topk, rows)       # [k, rows]
    gathered = permuted[src_to_dst]                                         # [k, rows, H]
    if bias is not None:
        experts = export_for_source_row.long().t()                          # [k, rows]
        gathered = gathered + bias.float()[experts]
    weights = scales.float().t().unsqueeze(-1) if scales is not None else 1.0
    out = (gathered * weights).sum(dim=0)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.float()
    return out.to(expanded_permuted_rows.dtype)


# ---- v2 routing (expert_idx only) -----------------------------------------------------------
def _init_routing_v2_fake(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                          expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                          quant_mode=-1, active_expert_range=(), row_idx_type=0, x_dtype=None):
    rows, k = expert_idx.shape
    start, end = (active_expert_range if active_expert_range else (0, expert_num))
    total = rows * k if active_num in (0, -1) else min(active_num, rows * k)
    count_shape = (end - start, 2) if expert_tokens_num_type == 2 else (end - start,)
    return (x.new_empty((total, x.shape[-1]), dtype=torch.int8 if quant_mode == 1 else x.dtype),
            x.new_empty((rows * k,), dtype=torch.int32),
            x.new_empty(count_shape, dtype=torch.int64), x.new_empty((total,), dtype=torch.float32))


@reference("npu_moe_init_routing_v2(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, "
           "int active_num=-1, int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, "
           "int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=-1, "
           "int[2] active_expert_range=[], int row_idx_type=0, int? x_dtype=None) -> (Tensor, Tensor, Tensor, Tensor)",
           formulation="op-plugin's cpu_op_exec: stable sort of experts in the active range, "
                       "expanded_x[i] = x[sorted[i] // k]; gather (0) or scatter (1) row index; per-expert counts "
                       "(1), cumsum (0) or (expert, count) pairs (2); drop_pad_mode 0; quant_mode 1: per-row int8 "
                       "of expanded_x * scale[expert] (kernels/quant.py routing_quantize)",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py"
                "::test_moe_init_routing_v2_matches_op_plugin_numpy_logic",
           fake=_init_routing_v2_fake)
def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=-1, active_expert_range=(), row_idx_type=0, x_dtype=None):
    if quant_mode not in (-1, 1):
        refuse("npu_moe_init_routing_v2", f"quant_mode={quant_mode} (static quantization)")
    if drop_pad_mode != 0:
        refuse("npu_moe_init_routing_v2", f"drop_pad_mode={drop_pad_mode} (expert capacity dropping)")
    rows, k = expert_idx.shape
    if active_expert_range:
        start, end = int(active_expert_range[0]), int(active_expert_range[1])
    else:
        if expert_num is None or expert_num <= 0:
            raise ValueError("npu_moe_init_routing_v2: give expert_num or active_expert_range")
        start, end = 0, int(expert_num)
    flat = expert_idx.reshape(-1).long()
    in_range = (flat >= start) & (flat < end)
    total = int(in_range.sum())
    keyed = torch.where(flat < start, torch.full_like(flat, torch.iinfo(torch.int32).max), flat)
    order = torch.sort(keyed, stable=True)
    sorted_indices, sorted_experts = order.indices, order.values
    if row_idx_type == 1:
        expanded_row_idx = sorted_indices.to(torch.int32)
    else:
        expanded_row_idx = torch.full((rows * k,), -1, dtype=torch.int32, device=x.device)
        expanded_row_idx[sorted_indices[:total]] = torch.arange(total, dtype=torch.int32, device=x.device)
    counts = torch.bincount(sorted_experts[:total] - start, minlength=end - start)[: end - start]
    if expert_tokens_num_type == 0:
        tokens = counts.cumsum(0)
    elif expert_tokens_num_type == 1:
        tokens = counts
    else:
        experts = torch.arange(start, end, device=x.device)
        tokens = torch.stack((experts, counts), dim=1)
    active = total if active_num in (0, -1) else min(active_num, total)
    expanded_x = x[sorted_indices[:active] // k]
    if quant_mode == 1:     # dynamic int8 of each expanded row (kernels/quant.py)
        from npu_standin.kernels.quant import routing_quantize

        expanded_x, expanded_scale = routing_quantize(expanded_x, sorted_experts[:active], scale, start)
        return expanded_x, expanded_row_idx, tokens.to(torch.int64), expanded_scale
    expanded_scale = (scale[sorted_indices[:active] // k].float() if scale is not None
                      else torch.empty((active,), dtype=torch.float32, device=x.device))
    return expanded_x, expanded_row_idx, tokens.to(torch.int64), expanded_scale


def _re_routing_fake(tokens, expert_token_num_per_rank, *, per_token_scales=None, expert_token_num_type=1,
                     idx_type=0, tokens_dtype=None):
    scales = (per_token_scales.new_empty(per_token_scales.shape) if per_token_scales is not None
              else tokens.new_empty((tokens.shape[0],), dtype=torch.float32))
    return (torch.empty_like(tokens), scales, tokens.new_empty((tokens.shape[0],), dtype=torch.int32),
            expert_token_num_per_rank.new_empty((expert_token_num_per_rank.shape[1],)))


@reference("npu_moe_re_routing(Tensor tokens, Tensor expert_token_num_per_rank, *, Tensor? per_token_scales=None, "
           "int expert_token_num_type=1, int idx_type=0, int? tokens_dtype=None) -> (Tensor, Tensor, Tensor, Tensor)",
           formulation="tokens arrive grouped by (source rank, expert); reorder to (expert, source rank); gather "
                       "index permute_token_idx; per-expert counts",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py::test_moe_re_routing_regroups_by_expert",
           fake=_re_routing_fake)
def npu_moe_re_routing(tokens, expert_token_num_per_rank, *, per_token_scales=None, expert_token_num_type=1,
                       idx_type=0, tokens_dtype=None):
    if expert_token_num_type != 1 or idx_type != 0:
        refuse("npu_moe_re_routing", f"expert_token_num_type={expert_token_num_type}, idx_type={idx_type} "
                                     "(only 1 and 0 are documented)")
    counts = expert_token_num_per_rank.long()
    ranks, experts = counts.shape
    src_start = torch.cat([counts.new_zeros(1), counts.reshape(-1).cumsum(0)[:-1]]).reshape(ranks, experts)
    order = []
    for e in range(experts):
        for r in range(ranks):
            n = int(counts[r, e])
            start = int(src_start[r, e])
            order.extend(range(start, start + n))
    gather = torch.tensor(order, dtype=torch.long, device=tokens.device)
    scales = (per_token_scales[gather] if per_token_scales is not None
              else torch.empty((tokens.shape[0],), dtype=torch.float32, device=tokens.device))
    return (tokens[gather], scales, gather.to(torch.int32),
            counts.sum(dim=0).to(expert_token_num_per_rank.dtype))
