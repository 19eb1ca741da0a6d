"""Expert-parallel MC2 kernels: npu_moe_distribute_dispatch / _combine (v1) and _v2, over the host's backend.

On an NPU these fuse the EP all-to-all into the kernel: each rank sends every token to the ranks that
hold its top-k experts, the experts run on what each rank received, and combine sends each result back
the way it came and sums a token's K results with its routing weights. Here the same arithmetic runs
over a torch.distributed process group (gloo on the cpu): `group_ep` is the HCCL communicator name
upstream takes from `group._get_backend(npu).get_hccl_comm_name(rank)` (executor/utils/hccl_utils.py,
`get_group_name`), which the stand-in's process groups answer (npu_standin/dist.py, `comm_name`) and
`process_group_named` resolves back to the group.

Sources (Ascend/op-plugin@517f2e7d; hicann/ops-transformer for the kernels):

* docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_distribute_dispatch(_v2).md and _combine(_v2).md:
  dispatch = (optional quantization, refused here) then the EP domain's alltoallv; combine = "按dispatch
  算子收集数据的路径原路返回" (back along dispatch's path), then `x = Sum(expert_scales * ata_out +
  shared_expert_x)`. local_expert_num = moe_expert_num / (ep_world_size - shared_expert_rank_num); experts
  are laid out by rank: rank R holds experts [R*L, (R+1)*L). `expert_token_nums`: per local expert
  counts (expert_token_nums_type 1) or their prefix sum (0). `ep_recv_counts` (A3: shape
  (ep_world_size * local_expert_num,)): the tokens each local expert received from each rank, as a
  prefix sum. `tp_recv_counts` / `group_tp` / `tp_world_size`: "当前版本不支持TP域通信" — reserved, only
  0 or 1 (no TP domain); the values of expand_idx / assist_info_for_combine / ep_recv_counts may differ
  between versions and are only to be passed to combine.
* Shapes (op_plugin/ops/opapi/MoeDistributeDispatch(V2)KernelOpApi.cpp): A = global_bs_real *
  min(local_expert_num, K), global_bs_real = global_bs or BS * ep_world_size; expand_x (A, H) with the
  received rows first (`expert_token_nums` says how many), dynamic_scales (A,) float32, expand_idx
  (BS*K,) int32 (v1), assist_info_for_combine (max(BS*K, A*128),) int32 (v2), expert_token_nums (L,)
  int64, ep_recv_counts (W*L,) int32, tp_recv_counts (tp_world_size,) int32, expand_scales (A,) float32.
  global_bs 0 is documented for equal BS on every rank ("当每个rank的BS相同时，支持取值0或BS*ep_world_size";
  unequal BS needs max_bs * ep_world_size): refused otherwise, as it would overflow A on the NPU.
* The order of the received rows and what expand_idx holds: ops-transformer mc2/moe_distribute_dispatch_v2/
  docs/MoeDistributeDispatch-Combine算子设计介绍.md §2.2: for every (token i, slot j) in row-major order,
  expandIdx(i, j) = sendStatus(target rank, local expert)++ (the token's index among those this rank sends
  to that expert); the tokens to one rank are sent contiguous, by expert; §2.4: the receiving rank's
  (rank x local expert) count matrix is transposed and prefix-summed in row-major order into epRecvCount,
  and its tokens are laid out expert by expert, each expert's by source rank — expand_x row
  ep_recv_counts[e*W + r - 1] + expandIdx(i, j) holds source rank r's token i for local expert e. v2's
  assist_info_for_combine keeps, per received row, the triple (rank_id, token_id, topk_id)
  (op_kernel/moe_distribute_dispatch_v2.h, `EXPAND_IDX_INFO = 3U`); here in the first three of its 128
  entries per row of expand_x.
* Combine's sum (ops-transformer mc2/moe_distribute_combine_v2/op_kernel/arch22/moe_distribute_combine_v2.h,
  `ProcessExpert` / `ProcessMoeExpert` / `LocalWindowCopy`): a float32 accumulator set to 0, then for
  topk_id = 0..K-1 in order `sum += float(expert row) * expert_scales[i, topk_id]`, shared_expert_x added
  unweighted, one cast to the output dtype (`CAST_RINT`). The output has expand_x's dtype, shape (BS, H).

Refused with one line: quantization (quant_mode / comm_quant_mode != 0, scales), shared-expert ranks,
x_active_mask, the special (zero / copy / const) experts, elastic_info, performance_info, expert_scales
(A2's hierarchy layout) and a TP domain (tp_world_size > 1, which the current pages call unsupported).
Floating x of any dtype is accepted (the NPU takes bf16 / fp16; fp32 serves the fp32 checks, as the other
references do). A routing that another rank cannot take (an expert id out of range or repeated in a row,
an ep_rank_id that is not the rank's place in the group) is refused on every rank of the group together,
so no rank is left waiting in a collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from npu_standin.kernels import refuse, reference

TEST = "tests/unit/npu_standin/kernels/test_mc2.py"
ASSIST_STRIDE = 128          # assist_info_for_combine: (A * 128,), a row's triple in its first 3 entries


# ---- the group, the layout ------------------------------------------------------------------------
def _group(op: str, group_ep: str, ep_world_size: int):
    from npu_standin.dist import process_group_named

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"npu stand-in: {op}: no torch.distributed process group is initialised "
                           "(group_ep names an HCCL communicator of one)")
    group = process_group_named(group_ep)
    if group is None:
        raise RuntimeError(f"npu stand-in: {op}: group_ep {group_ep!r} names no process group of this process "
                           "(pass group._get_backend(device).get_hccl_comm_name(rank) of the EP group)")
    size = dist.get_world_size(group)
    if size != ep_world_size:
        raise RuntimeError(f"npu stand-in: {op}: ep_world_size={ep_world_size} but group_ep has {size} ranks")
    return group


def _owner(experts: torch.Tensor, local: int) -> torch.Tensor:
    """The EP rank that holds each expert: rank R holds experts [R*L, (R+1)*L)."""
    return torch.div(experts, local, rounding_mode="floor")


def _local_experts(op: str, moe_expert_num: int, ep_world_size: int) -> int:
    if moe_expert_num <= 0 or moe_expert_num % ep_world_size:
        raise ValueError(f"npu stand-in: {op}: moe_expert_num={moe_expert_num} is not a multiple of "
                         f"ep_world_size={ep_world_size} (moe_expert_num % (ep_world_size - shared_expert_rank_num) "
                         "must be 0)")
    return moe_expert_num // ep_world_size


def _received_rows(bs: int, k: int, ep_world_size: int, local: int, global_bs: int) -> int:
    """A: the rows expand_x holds (op-plugin's shape rule, no shared-expert ranks)."""
    global_bs_real = global_bs if global_bs else bs * ep_world_size
    return global_bs_real * min(local, k)


def _refusals(op: str, **given) -> None:
    """The documented modes this reference does not compute, one line each (same on every rank)."""
    for name, (value, default, why) in given.items():
        if value is None or (default is not None and value == default):
            continue
        refuse(op, f"{name}={'a tensor' if isinstance(value, torch.Tensor) else value!r} ({why})")


def _common_refusals(op: str, *, tp_world_size, shared_expert_num, shared_expert_rank_num, expert_shard_type,
                     x_active_mask, elastic_info, performance_info, zero_expert_num=0, copy_expert_num=0,
                     const_expert_num=0) -> None:
    if tp_world_size not in (0, 1):
        refuse(op, f"tp_world_size={tp_world_size} (a TP domain: the op-plugin page says the current version does "
                   "not support TP-domain communication, 0 or 1 only)")
    if shared_expert_rank_num:
        refuse(op, f"shared_expert_rank_num={shared_expert_rank_num} (shared-expert ranks)")
    _refusals(op, expert_shard_type=(expert_shard_type, 0, "only 0 is documented"),
              x_active_mask=(x_active_mask, None, "token masks"),
              elastic_info=(elastic_info, None, "elastic scaling down"),
              performance_info=(performance_info, None, "communication timing"),
              zero_expert_num=(zero_expert_num, 0, "special experts"),
              copy_expert_num=(copy_expert_num, 0, "special experts"),
              const_expert_num=(const_expert_num, 0, "special experts"))
    del shared_expert_num      # with no shared-expert rank it changes nothing (the kernel's is_shared_default)


def _agree(problem: str | None, group, row: torch.Tensor) -> torch.Tensor:
    """Exchange `row` (one per destination rank, int64 [W, n]) and whether each rank found a problem, in one
    all-to-all; raise on every rank when any did (a rank raising alone would leave the others waiting)."""
    flag = torch.full((row.shape[0], 1), 1 if problem else 0, dtype=torch.int64)
    sent = torch.cat([row.to(torch.int64), flag], dim=1).contiguous()
    got = torch.empty_like(sent)
    dist.all_to_all_single(got, sent, group=group)
    bad = got[:, -1].nonzero().flatten().tolist()
    if bad:
        raise ValueError(problem or f"npu stand-in: EP rank(s) {bad} of this group refused the call (see their line)")
    return got[:, :-1]


def _routing_problem(op: str, ids: torch.Tensor, moe_expert_num: int, group, ep_rank_id: int) -> str | None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= moe_expert_num):
        return f"npu stand-in: {op}: expert_ids outside [0, moe_expert_num={moe_expert_num})"
    if ids.shape[1] > 1 and bool((ids.sort(dim=1).values.diff(dim=1) == 0).any()):
        return f"npu stand-in: {op}: an expert repeated in one row of expert_ids (the K experts of a token must differ)"
    rank = dist.get_rank(group)
    if rank != ep_rank_id:
        return f"npu stand-in: {op}: ep_rank_id={ep_rank_id} but this rank is rank {rank} of group_ep"
    return None


# ---- dispatch --------------------------------------------------------------------------------------
def _dispatch(op: str, x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, global_bs,
              expert_token_nums_type, tp_world_size, assist: bool):
    if x.dim() != 2 or expert_ids.dim() != 2:
        raise ValueError(f"npu stand-in: {op}: x and expert_ids must be 2-D")
    if not x.is_floating_point():
        refuse(op, f"x of dtype {x.dtype} (int4 packed in int32: a quantized path)")
    if expert_token_nums_type not in (0, 1):
        raise ValueError(f"npu stand-in: {op}: expert_token_nums_type must be 0 or 1")
    group = _group(op, group_ep, ep_world_size)
    world, local = ep_world_size, _local_experts(op, moe_expert_num, ep_world_size)
    bs, h = x.shape
    k = expert_ids.shape[1]
    ids = expert_ids.long()
    flat = ids.reshape(-1)                                    # (token i, slot j) in row-major order
    problem = _routing_problem(op, ids, moe_expert_num, group, ep_rank_id)
    safe = flat.clamp(0, moe_expert_num - 1) if problem else flat
    # the slot of (rank, local expert) each (token i, slot j) goes to, in row-major order
    key = _owner(safe, local) * local + safe % local
    # rows sent: by destination rank, each rank's by its local expert, each expert's in (i, j) order; expand_idx:
    # each (i, j)'s index among the tokens this rank sends to its expert
    order = torch.sort(key, stable=True).indices
    per_key = torch.bincount(key, minlength=world * local)
    starts = per_key.cumsum(0) - per_key
    expand_idx = torch.empty_like(flat)
    expand_idx[order] = torch.arange(flat.numel()) - starts[key[order]]
    to_rank = per_key.view(world, local)                      # what each destination rank gets, per local expert
    info = torch.cat([to_rank, torch.full((world, 1), bs, dtype=torch.int64)], dim=1)
    got = _agree(problem, group, info)
    from_rank, their_bs = got[:, :local], got[:, local]      # [source rank r, local expert e], BS of rank r
    if global_bs == 0 and bool((their_bs != bs).any()):
        raise ValueError(f"npu stand-in: {op}: global_bs=0 with unequal BS across group_ep ({their_bs.tolist()}): "
                         "documented only for equal BS; pass global_bs = max_bs * ep_world_size")
    if global_bs and global_bs < int(their_bs.max()) * world:
        raise ValueError(f"npu stand-in: {op}: global_bs={global_bs} < max BS {int(their_bs.max())} x "
                         f"ep_world_size {world}")
    rows = _received_rows(bs, k, world, local, global_bs)
    send_split = to_rank.sum(1).tolist()
    recv_split = from_rank.sum(1).tolist()
    received = x.new_empty((sum(recv_split), h))
    dist.all_to_all_single(received, x[torch.div(order, k, rounding_mode="floor")].contiguous(), recv_split,
                           send_split, group=group)
    if assist:
        meta = torch.stack([torch.full_like(order, ep_rank_id), torch.div(order, k, rounding_mode="floor"),
                            order % k], dim=1)
        received_meta = meta.new_empty((sum(recv_split), 3))
        dist.all_to_all_single(received_meta, meta.contiguous(), recv_split, send_split, group=group)
    # received: by source rank, each rank's by local expert; expand_x: by local expert, each by source rank
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), from_rank.reshape(-1).cumsum(0)]).view(-1)
    pick = [torch.arange(int(offsets[r * local + e]), int(offsets[r * local + e + 1]))
            for e in range(local) for r in range(world)]
    pick = torch.cat(pick) if pick else torch.zeros(0, dtype=torch.int64)
    total = pick.numel()
    if total > rows:
        raise ValueError(f"npu stand-in: {op}: {total} tokens received, more than expand_x's {rows} rows "
                         "(global_bs too small)")
    expand_x = x.new_zeros((max(rows, rows * tp_world_size), h))
    expand_x[:total] = received[pick]
    recv_e_r = from_rank.t()                                 # [local expert e, source rank r]
    ep_recv_counts = recv_e_r.reshape(-1).cumsum(0).to(torch.int32)
    tokens = recv_e_r.sum(1)
    expert_token_nums = (tokens.cumsum(0) if expert_token_nums_type == 0 else tokens).to(torch.int64)
    if assist:
        info_out = torch.zeros(max(bs * k, rows * ASSIST_STRIDE), dtype=torch.int32)
        info_out[:rows * ASSIST_STRIDE].view(rows, ASSIST_STRIDE)[:total, :3] = received_meta[pick].to(torch.int32)
        index_out = info_out
    else:
        index_out = expand_idx.to(torch.int32)
    return (expand_x, torch.zeros(rows, dtype=torch.float32), index_out, expert_token_nums, ep_recv_counts,
            torch.zeros(tp_world_size, dtype=torch.int32), torch.zeros(rows, dtype=torch.float32))


def _dispatch_fake(op, x, expert_ids, ep_world_size, moe_expert_num, global_bs, tp_world_size, assist):
    bs, h = x.shape
    k = expert_ids.shape[1]
    local = _local_experts(op, moe_expert_num, ep_world_size)
    rows = _received_rows(bs, k, ep_world_size, local, global_bs)
    index = (x.new_empty((max(bs * k, rows * ASSIST_STRIDE),), dtype=torch.int32) if assist
             else x.new_empty((bs * k,), dtype=torch.int32))
    return (x.new_empty((max(rows, rows * tp_world_size), h)), x.new_empty((rows,), dtype=torch.float32), index,
            x.new_empty((local,), dtype=torch.int64), x.new_empty((ep_world_size * local,), dtype=torch.int32),
            x.new_empty((tp_world_size,), dtype=torch.int32), x.new_empty((rows,), dtype=torch.float32))


def _dispatch_v1_fake(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, scales=None,
                      x_active_mask=None, expert_scales=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                      expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, quant_mode=0, global_bs=0,
                      expert_token_nums_type=1):
    return _dispatch_fake("npu_moe_distribute_dispatch", x, expert_ids, ep_world_size, moe_expert_num, global_bs,
                          tp_world_size, assist=False)


@reference("npu_moe_distribute_dispatch(Tensor x, Tensor expert_ids, str group_ep, int ep_world_size, int ep_rank_id, "
           "int moe_expert_num, *, Tensor? scales=None, Tensor? x_active_mask=None, Tensor? expert_scales=None, "
           "str group_tp=\"\", int tp_world_size=0, int tp_rank_id=0, int expert_shard_type=0, "
           "int shared_expert_num=1, int shared_expert_rank_num=0, int quant_mode=0, int global_bs=0, "
           "int expert_token_nums_type=1) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
           formulation="all-to-all of each token to the ranks of its top-k experts (rank R holds experts "
                       "[R*L, (R+1)*L)) over group_ep's process group; expand_x by local expert then source rank; "
                       "expand_idx = the token's index among those sent to that expert; ep_recv_counts prefix sums; "
                       "unquantized, no TP domain",
           test=f"{TEST}::test_dispatch_then_combine_equals_the_single_process_moe",
           fake=_dispatch_v1_fake)
def npu_moe_distribute_dispatch(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, scales=None,
                                x_active_mask=None, expert_scales=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                                expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, quant_mode=0,
                                global_bs=0, expert_token_nums_type=1):
    op = "npu_moe_distribute_dispatch"
    _refusals(op, quant_mode=(quant_mode, 0, "a quantized path"), scales=(scales, None, "a quantized path"),
              expert_scales=(expert_scales, None, "A2's hierarchy layout"))
    _common_refusals(op, tp_world_size=tp_world_size, shared_expert_num=shared_expert_num,
                     shared_expert_rank_num=shared_expert_rank_num, expert_shard_type=expert_shard_type,
                     x_active_mask=x_active_mask, elastic_info=None, performance_info=None)
    return _dispatch(op, x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, global_bs=global_bs,
                     expert_token_nums_type=expert_token_nums_type, tp_world_size=tp_world_size, assist=False)


def _dispatch_v2_fake(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, scales=None,
                      x_active_mask=None, expert_scales=None, elastic_info=None, performance_info=None, group_tp="",
                      tp_world_size=0, tp_rank_id=0, expert_shard_type=0, shared_expert_num=1,
                      shared_expert_rank_num=0, quant_mode=0, global_bs=0, expert_token_nums_type=1, comm_alg="",
                      zero_expert_num=0, copy_expert_num=0, const_expert_num=0, y_dtype=None, x_dtype=None,
                      scales_dtype=None):
    return _dispatch_fake("npu_moe_distribute_dispatch_v2", x, expert_ids, ep_world_size, moe_expert_num, global_bs,
                          tp_world_size, assist=True)


@reference("npu_moe_distribute_dispatch_v2(Tensor x, Tensor expert_ids, str group_ep, int ep_world_size, "
           "int ep_rank_id, int moe_expert_num, *, Tensor? scales=None, Tensor? x_active_mask=None, "
           "Tensor? expert_scales=None, Tensor? elastic_info=None, Tensor? performance_info=None, str group_tp=\"\", "
           "int tp_world_size=0, int tp_rank_id=0, int expert_shard_type=0, int shared_expert_num=1, "
           "int shared_expert_rank_num=0, int quant_mode=0, int global_bs=0, int expert_token_nums_type=1, "
           "str comm_alg=\"\", int zero_expert_num=0, int copy_expert_num=0, int const_expert_num=0, "
           "int? y_dtype=None, int? x_dtype=None, int? scales_dtype=None) -> "
           "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
           formulation="as npu_moe_distribute_dispatch; assist_info_for_combine keeps each received row's "
                       "(source rank, token, top-k slot) in the first 3 of its 128 entries",
           test=f"{TEST}::test_dispatch_then_combine_equals_the_single_process_moe",
           fake=_dispatch_v2_fake)
def npu_moe_distribute_dispatch_v2(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                                   scales=None, x_active_mask=None, expert_scales=None, elastic_info=None,
                                   performance_info=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                                   expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, quant_mode=0,
                                   global_bs=0, expert_token_nums_type=1, comm_alg="", zero_expert_num=0,
                                   copy_expert_num=0, const_expert_num=0, y_dtype=None, x_dtype=None,
                                   scales_dtype=None):
    op = "npu_moe_distribute_dispatch_v2"
    _refusals(op, quant_mode=(quant_mode, 0, "a quantized path"), scales=(scales, None, "a quantized path"),
              expert_scales=(expert_scales, None, "A2's hierarchy layout"),
              y_dtype=(y_dtype, None, "a quantized output"), x_dtype=(x_dtype, None, "a packed input dtype"),
              scales_dtype=(scales_dtype, None, "a quantized path"))
    _common_refusals(op, tp_world_size=tp_world_size, shared_expert_num=shared_expert_num,
                     shared_expert_rank_num=shared_expert_rank_num, expert_shard_type=expert_shard_type,
                     x_active_mask=x_active_mask, elastic_info=elastic_info, performance_info=performance_info,
                     zero_expert_num=zero_expert_num, copy_expert_num=copy_expert_num,
                     const_expert_num=const_expert_num)
    return _dispatch(op, x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, global_bs=global_bs,
                     expert_token_nums_type=expert_token_nums_type, tp_world_size=tp_world_size, assist=True)


# ---- combine ---------------------------------------------------------------------------------------
def _combine(op: str, expand_x, expert_ids, index, ep_send_counts, expert_scales, group_ep, ep_world_size,
             ep_rank_id, moe_expert_num, *, shared_expert_x, assist: bool):
    if expand_x.dim() != 2 or expert_ids.dim() != 2:
        raise ValueError(f"npu stand-in: {op}: expand_x and expert_ids must be 2-D")
    group = _group(op, group_ep, ep_world_size)
    world, local = ep_world_size, _local_experts(op, moe_expert_num, ep_world_size)
    bs, k = expert_ids.shape
    h = expand_x.shape[1]
    ids = expert_ids.long()
    problem = _routing_problem(op, ids, moe_expert_num, group, ep_rank_id)
    if problem is None and tuple(expert_scales.shape) != (bs, k):
        problem = f"npu stand-in: {op}: expert_scales {tuple(expert_scales.shape)} is not expert_ids' {(bs, k)}"
    # what this rank's experts send back to each rank: ep_send_counts, prefix sums by (local expert, rank)
    ends = ep_send_counts.reshape(-1)[: world * local].long()
    counts = torch.diff(ends, prepend=torch.zeros(1, dtype=torch.int64)).view(local, world)   # [e, r]
    if problem is None and (int(ends[-1]) > expand_x.shape[0] or bool((counts < 0).any())):
        problem = f"npu stand-in: {op}: ep_send_counts does not fit expand_x's {expand_x.shape[0]} rows"
    flat = ids.reshape(-1).clamp(0, moe_expert_num - 1)
    owner = _owner(flat, local)
    mine = torch.zeros(world, local, dtype=torch.int64)      # what this rank sent to each (rank, local expert)
    mine.view(-1).index_add_(0, owner * local + flat % local, torch.ones_like(flat))
    # every rank learns what comes back to it; a mismatch with what it sent is a combine of another routing
    back = _agree(problem, group, counts.t())                 # [from rank R, local expert e]
    if not torch.equal(back, mine):
        problem = (f"npu stand-in: {op}: the experts' ranks return {back.tolist()} tokens per (rank, expert), "
                   f"this rank's expert_ids sent {mine.tolist()}: combine's expert_ids / ep_send_counts are not "
                   "dispatch's")
    _agree(problem, group, torch.zeros(world, 0, dtype=torch.int64))
    starts = ends.view(local, world) - counts
    pick = [torch.arange(int(starts[e, r]), int(starts[e, r] + counts[e, r])) for r in range(world) for e in range(local)]
    pick = torch.cat(pick) if pick else torch.zeros(0, dtype=torch.int64)
    send_split = counts.sum(0).tolist()
    recv_split = mine.sum(1).tolist()
    returned = expand_x.new_empty((sum(recv_split), h))
    dist.all_to_all_single(returned, expand_x[pick].contiguous(), recv_split, send_split, group=group)
    if assist:
        triples = index.reshape(-1)[: expand_x.shape[0] * ASSIST_STRIDE].view(-1, ASSIST_STRIDE)[:, :3].long()
        meta = triples[pick][:, 1:].contiguous()
        returned_meta = meta.new_empty((sum(recv_split), 2))
        dist.all_to_all_single(returned_meta, meta, recv_split, send_split, group=group)
        slot_of = returned_meta[:, 0] * k + returned_meta[:, 1]
    else:
        # v1: rank R's rows come back expert by expert, each in expand_idx order (the design doc's TokenAddr)
        before = mine.cumsum(1) - mine                        # rows of (R, e' < e) ahead of expert e's
        chunk = torch.tensor([0, *recv_split], dtype=torch.int64).cumsum(0)[:-1]
        row_of = chunk[owner] + before[owner, flat % local] + index.reshape(-1)[: bs * k].long()
        slot_of = torch.empty_like(row_of)
        slot_of[row_of] = torch.arange(bs * k)
    gathered = returned.new_zeros((bs * k, h))
    gathered[slot_of] = returned
    gathered = gathered.view(bs, k, h)
    scales = expert_scales.float()
    total = torch.zeros((bs, h), dtype=torch.float32)
    for slot in range(k):                                     # the kernel's order: topk_id 0..K-1, fp32
        total = total + gathered[:, slot].float() * scales[:, slot, None]
    if shared_expert_x is not None:
        total = total + shared_expert_x.float()
    return total.to(expand_x.dtype)


def _combine_v1_fake(expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group_ep, ep_world_size,
                     ep_rank_id, moe_expert_num, *, tp_send_counts=None, x_active_mask=None, activation_scale=None,
                     weight_scale=None, group_list=None, expand_scales=None, shared_expert_x=None, group_tp="",
                     tp_world_size=0, tp_rank_id=0, expert_shard_type=0, shared_expert_num=1,
                     shared_expert_rank_num=0, global_bs=0, out_dtype=0, comm_quant_mode=0, group_list_type=0):
    return expand_x.new_empty((expert_ids.shape[0], expand_x.shape[1]))


@reference("npu_moe_distribute_combine(Tensor expand_x, Tensor expert_ids, Tensor expand_idx, Tensor ep_send_counts, "
           "Tensor expert_scales, str group_ep, int ep_world_size, int ep_rank_id, int moe_expert_num, *, "
           "Tensor? tp_send_counts=None, Tensor? x_active_mask=None, Tensor? activation_scale=None, "
           "Tensor? weight_scale=None, Tensor? group_list=None, Tensor? expand_scales=None, "
           "Tensor? shared_expert_x=None, str group_tp=\"\", int tp_world_size=0, int tp_rank_id=0, "
           "int expert_shard_type=0, int shared_expert_num=1, int shared_expert_rank_num=0, int global_bs=0, "
           "int out_dtype=0, int comm_quant_mode=0, int group_list_type=0) -> Tensor",
           formulation="each expand_x row sent back to its source rank (ep_send_counts by expert and rank), placed by "
                       "expand_idx; x[i] = sum over topk_id 0..K-1 of expert_scales[i, k] * row, fp32, one rounding",
           test=f"{TEST}::test_dispatch_then_combine_equals_the_single_process_moe",
           fake=_combine_v1_fake)
def npu_moe_distribute_combine(expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group_ep,
                               ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None, x_active_mask=None,
                               activation_scale=None, weight_scale=None, group_list=None, expand_scales=None,
                               shared_expert_x=None, group_tp="", tp_world_size=0, tp_rank_id=0, expert_shard_type=0,
                               shared_expert_num=1, shared_expert_rank_num=0, global_bs=0, out_dtype=0,
                               comm_quant_mode=0, group_list_type=0):
    op = "npu_moe_distribute_combine"
    _refusals(op, comm_quant_mode=(comm_quant_mode, 0, "int8 communication"),
              activation_scale=(activation_scale, None, "reserved"), weight_scale=(weight_scale, None, "reserved"),
              group_list=(group_list, None, "reserved"), expand_scales=(expand_scales, None, "A2's hierarchy layout"),
              shared_expert_x=(shared_expert_x, None, "reserved in v1"))
    _common_refusals(op, tp_world_size=tp_world_size, shared_expert_num=shared_expert_num,
                     shared_expert_rank_num=shared_expert_rank_num, expert_shard_type=expert_shard_type,
                     x_active_mask=x_active_mask, elastic_info=None, performance_info=None)
    return _combine(op, expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group_ep, ep_world_size,
                    ep_rank_id, moe_expert_num, shared_expert_x=None, assist=False)


def _combine_v2_fake(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, group_ep,
                     ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None, x_active_mask=None,
                     expand_scales=None, shared_expert_x=None, elastic_info=None, ori_x=None,
                     const_expert_alpha_1=None, const_expert_alpha_2=None, const_expert_v=None, performance_info=None,
                     group_tp="", tp_world_size=0, tp_rank_id=0, expert_shard_type=0, shared_expert_num=1,
                     shared_expert_rank_num=0, global_bs=0, comm_quant_mode=0, comm_alg="", zero_expert_num=0,
                     copy_expert_num=0, const_expert_num=0):
    return expand_x.new_empty((expert_ids.shape[0], expand_x.shape[1]))


@reference("npu_moe_distribute_combine_v2(Tensor expand_x, Tensor expert_ids, Tensor assist_info_for_combine, "
           "Tensor ep_send_counts, Tensor expert_scales, str group_ep, int ep_world_size, int ep_rank_id, "
           "int moe_expert_num, *, Tensor? tp_send_counts=None, Tensor? x_active_mask=None, "
           "Tensor? expand_scales=None, Tensor? shared_expert_x=None, Tensor? elastic_info=None, Tensor? ori_x=None, "
           "Tensor? const_expert_alpha_1=None, Tensor? const_expert_alpha_2=None, Tensor? const_expert_v=None, "
           "Tensor? performance_info=None, str group_tp=\"\", int tp_world_size=0, int tp_rank_id=0, "
           "int expert_shard_type=0, int shared_expert_num=1, int shared_expert_rank_num=0, int global_bs=0, "
           "int comm_quant_mode=0, str comm_alg=\"\", int zero_expert_num=0, int copy_expert_num=0, "
           "int const_expert_num=0) -> Tensor",
           formulation="as npu_moe_distribute_combine, rows placed by assist_info_for_combine's (token, slot); "
                       "+ shared_expert_x unweighted, in the same fp32 sum",
           test=f"{TEST}::test_dispatch_then_combine_equals_the_single_process_moe",
           fake=_combine_v2_fake)
def npu_moe_distribute_combine_v2(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales,
                                  group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None,
                                  x_active_mask=None, expand_scales=None, shared_expert_x=None, elastic_info=None,
                                  ori_x=None, const_expert_alpha_1=None, const_expert_alpha_2=None,
                                  const_expert_v=None, performance_info=None, group_tp="", tp_world_size=0,
                                  tp_rank_id=0, expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0,
                                  global_bs=0, comm_quant_mode=0, comm_alg="", zero_expert_num=0, copy_expert_num=0,
                                  const_expert_num=0):
    op = "npu_moe_distribute_combine_v2"
    _refusals(op, comm_quant_mode=(comm_quant_mode, 0, "int8 communication"),
              expand_scales=(expand_scales, None, "A2's hierarchy layout"),
              ori_x=(ori_x, None, "special experts"), const_expert_alpha_1=(const_expert_alpha_1, None, "special experts"),
              const_expert_alpha_2=(const_expert_alpha_2, None, "special experts"),
              const_expert_v=(const_expert_v, None, "special experts"))
    _common_refusals(op, tp_world_size=tp_world_size, shared_expert_num=shared_expert_num,
                     shared_expert_rank_num=shared_expert_rank_num, expert_shard_type=expert_shard_type,
                     x_active_mask=x_active_mask, elastic_info=elastic_info, performance_info=performance_info,
                     zero_expert_num=zero_expert_num, copy_expert_num=copy_expert_num,
                     const_expert_num=const_expert_num)
    return _combine(op, expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, group_ep,
                    ep_world_size, ep_rank_id, moe_expert_num, shared_expert_x=shared_expert_x, assist=True)
