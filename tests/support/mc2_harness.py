"""The stand-in's MC2 kernels (npu_standin/kernels/mc2.py) on N gloo ranks: every rank dispatches its own random
tokens, applies the experts it holds to what it received, combines, and compares with the single-process MoE
computation of its tokens (sum over its top-k of routing weight x expert output). Run by
tests/unit/npu_standin/kernels/test_mc2.py as

    python -m torch.distributed.run --standalone --nproc-per-node=N tests/support/mc2_harness.py OUT_DIR

Each rank writes OUT_DIR/rank_R.json: per case, what it found. The experts are elementwise (tanh(x * a_e + b_e)):
a token's output does not depend on which tokens share its batch, so the reference is the same arithmetic and
the kernels' answer must equal it exactly (the combine's fp32 sum in top-k order, one rounding), and a token
given another expert's output differs by far more than rounding."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[2]
HIDDEN, EXPERTS, TOP_K = 32, 8, 3


def experts_table(seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(EXPERTS, HIDDEN, generator=g), torch.randn(EXPERTS, HIDDEN, generator=g)


def expert(e: int, rows: torch.Tensor, table) -> torch.Tensor:
    a, b = table
    return torch.tanh(rows.float() * a[e] + b[e]).to(rows.dtype)


def tokens(rank: int, bs: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(bs, HIDDEN, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(bs)]).to(torch.int32)
    weights = torch.softmax(torch.randn(bs, TOP_K, generator=g), -1)
    return x, ids, weights


def single_process(x, ids, weights, table) -> torch.Tensor:
    """The MoE computation on one process: per token, sum over its top-k (in order, fp32) of weight x output."""
    total = torch.zeros(x.shape, dtype=torch.float32)
    for slot in range(ids.shape[1]):
        outs = torch.stack([expert(int(e), row[None], table)[0] for row, e in zip(x, ids[:, slot])])
        total += outs.float() * weights[:, slot, None].float()
    return total.to(x.dtype)


def run_experts(expand_x, expert_token_nums, counts_type: int, rank: int, local: int, table) -> torch.Tensor:
    """This rank's experts on the rows dispatch gave it, as a grouped matmul would (rows past the tokens: 0)."""
    counts = expert_token_nums.tolist()
    if counts_type == 0:
        counts = [b - a for a, b in zip([0, *counts], counts)]
    out, start = torch.zeros_like(expand_x), 0
    for e, n in enumerate(counts):
        out[start:start + n] = expert(rank * local + e, expand_x[start:start + n], table)
        start += n
    return out


def moe(version: int, x, ids, weights, name, world, rank, table, combine_ids=None, **options):
    """dispatch -> local experts -> combine (of `combine_ids`, default the same); returns (combined, dispatch's
    outputs)."""
    ops = torch.ops.npu
    dispatch = ops.npu_moe_distribute_dispatch_v2 if version == 2 else ops.npu_moe_distribute_dispatch
    combine = ops.npu_moe_distribute_combine_v2 if version == 2 else ops.npu_moe_distribute_combine
    tp = options.pop("tp_world_size", 0)
    counts_type = options.pop("expert_token_nums_type", 1)
    out = dispatch(x, ids, name, world, rank, EXPERTS, tp_world_size=tp, expert_token_nums_type=counts_type,
                   **options)
    expand_x, _, index, expert_token_nums, ep_recv_counts, tp_recv_counts = out[:6]
    y = run_experts(expand_x, expert_token_nums, counts_type, rank, EXPERTS // world, table)
    combined = combine(y, ids if combine_ids is None else combine_ids, index, ep_recv_counts, weights.float(), name, world, rank, EXPERTS,
                       tp_send_counts=tp_recv_counts, tp_world_size=tp, global_bs=options.get("global_bs", 0))
    return combined, out


def gathered(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Every rank's `t` (their shapes may differ)."""
    out = [None] * world
    dist.all_gather_object(out, t)
    return out


def layout_facts(version, x, ids, out, world, rank) -> dict:
    """What dispatch's outputs say, checked against every rank's tokens (the documented layout)."""
    expand_x, _, index, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales = out
    local = EXPERTS // world
    xs, idss = gathered(x.float(), world), gathered(ids.long(), world)
    # expected: the tokens each of my local experts gets from each rank, prefix-summed in (expert, rank) order
    counts = torch.tensor([[int((idss[r] == rank * local + e).sum()) for r in range(world)] for e in range(local)])
    facts = {"ep_recv_counts_ok": ep_recv_counts.tolist() == counts.reshape(-1).cumsum(0).tolist(),
             "expert_token_nums_ok": expert_token_nums.tolist() == counts.sum(1).tolist(),
             "shapes": [list(t.shape) for t in out], "dtypes": [str(t.dtype) for t in out]}
    rows_ok = True
    if version == 1:
        # my expand_idx: (i, j)'s index among my tokens to expert ids[i, j], in row-major order
        flat = ids.reshape(-1).tolist()
        want = [flat[:n].count(e) for n, e in enumerate(flat)]
        facts["expand_idx_ok"] = index.tolist() == want
        idxs = gathered(index.long(), world)
        starts = [0, *ep_recv_counts.tolist()]
        for r in range(world):
            for n, e in enumerate(idss[r].reshape(-1).tolist()):
                if e // local == rank:
                    row = starts[(e % local) * world + r] + int(idxs[r][n])
                    rows_ok &= torch.equal(expand_x[row].float(), xs[r][n // TOP_K])
    else:
        triples = index[: expand_x.shape[0] * 128].view(-1, 128)[: int(counts.sum()), :3].tolist()
        for row, (r, i, j) in enumerate(triples):
            rows_ok &= torch.equal(expand_x[row].float(), xs[r][i]) and int(idss[r][i, j]) // local == rank
        facts["assist_triples"] = len(triples)
    facts["rows_ok"] = bool(rows_ok)
    return facts


def fake_shapes(version: int, x, ids, name, world, rank, **options):
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = torch.ops.npu
    dispatch = ops.npu_moe_distribute_dispatch_v2 if version == 2 else ops.npu_moe_distribute_dispatch
    with FakeTensorMode() as mode:
        out = dispatch(mode.from_tensor(x), mode.from_tensor(ids), name, world, rank, EXPERTS, **options)
        return [list(t.shape) for t in out]


def one_line_error(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return None


def main() -> int:
    from npu_standin import dist as standin_dist, kernels
    from npu_standin.kernels import mc2

    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    kernels.install()
    standin_dist._comm_names()
    ep = dist.new_group(list(range(world)))
    name = ep._get_backend(torch.device("cpu")).get_hccl_comm_name(rank)       # as upstream's hccl_utils asks
    table = experts_table()
    results: dict = {"name": name, "resolves": standin_dist.process_group_named(name) is ep}
    for version in (1, 2):
        for dtype in (torch.bfloat16, torch.float32):
            x, ids, weights = tokens(rank, 5, dtype)
            combined, out = moe(version, x, ids, weights, name, world, rank, table)
            want = single_process(x, ids, weights, table)
            case = f"v{version}_{str(dtype).split('.')[-1]}"
            results[case] = {"equal": torch.equal(combined, want), "dtype": str(combined.dtype),
                             "max_abs": (combined.float() - want.float()).abs().max().item(),
                             **layout_facts(version, x, ids, out, world, rank),
                             "fake_shapes": fake_shapes(version, x, ids, name, world, rank)}
        x, ids, weights = tokens(rank, 4, torch.bfloat16, seed=1)
        want = single_process(x, ids, weights, table)
        variants = {}
        for tp in (0, 1):
            for counts_type in (0, 1):
                combined, out = moe(version, x, ids, weights, name, world, rank, table, tp_world_size=tp,
                                    expert_token_nums_type=counts_type)
                variants[f"tp{tp}_type{counts_type}"] = {"equal": torch.equal(combined, want),
                                                         "tp_recv_counts": list(out[5].shape),
                                                         "expert_token_nums": out[3].tolist()}
        results[f"v{version}_variants"] = variants
        results[f"v{version}_tp2"] = one_line_error(lambda: moe(version, x, ids, weights, name, world, rank, table,
                                                               tp_world_size=2))
        # unequal BS per rank: documented with global_bs = max_bs * ep_world_size, refused with 0
        xs, idss, ws = tokens(rank, 2 + rank, torch.bfloat16, seed=2)
        results[f"v{version}_unequal_bs_global_bs_0"] = one_line_error(
            lambda: moe(version, xs, idss, ws, name, world, rank, table))
        combined, out = moe(version, xs, idss, ws, name, world, rank, table, global_bs=(1 + world) * world)
        results[f"v{version}_unequal_bs"] = {"equal": torch.equal(combined, single_process(xs, idss, ws, table)),
                                             "rows": out[0].shape[0]}
        # a routing the group cannot take, on one rank only: every rank refuses (none is left in a collective)
        bad = ids.clone()
        if rank == world - 1:
            bad[0, 0] = EXPERTS
        results[f"v{version}_bad_ids"] = one_line_error(lambda: moe(version, x, bad, weights, name, world, rank, table))
        other = ids.clone()
        if rank == 0:
            other[0] = (other[0] + 1) % EXPERTS          # combine told of another routing than dispatch's
        results[f"v{version}_combine_other_ids"] = one_line_error(
            lambda: moe(version, x, ids, weights, name, world, rank, table, combine_ids=other))
        results[f"v{version}_wrong_rank_id"] = one_line_error(
            lambda: moe(version, x, ids, weights, name, world, (rank + 1) % world, table))
        # the fault the equality must catch: each expert's tokens sent to the next rank's expert of the same slot
        owner = mc2._owner
        mc2._owner = lambda experts, local: (torch.div(experts, local, rounding_mode="floor") + 1) % world
        try:
            combined, _ = moe(version, x, ids, weights, name, world, rank, table)
        finally:
            mc2._owner = owner
        results[f"v{version}_wrong_routing"] = {"equal": torch.equal(combined, want),
                                                "max_abs": (combined.float() - want.float()).abs().max().item()}
    (out_dir / f"rank_{rank}.json").write_text(json.dumps(results))
    from tests.support.rank_exit import end_rank

    end_rank(0)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    sys.exit(main())
