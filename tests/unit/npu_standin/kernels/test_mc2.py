"""The MC2 expert-parallel kernels (npu_standin/kernels/mc2.py): dispatch then combine over gloo ranks equals the
single-process MoE computation, the documented layout of their outputs holds, a wrong routing is caught, and what
the kernels refuse is refused on every rank at once. The ranks run tests/support/mc2_harness.py (one torchrun per
world size, every case in it); 2 ranks by default, 4 in the slow set (the same paths, with fewer local experts
than top-k: A = global_bs x local experts), whose shape rule the fake's in-process case covers by default."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from locations import REPO_ROOT

VERSIONS = (1, 2)


def run_ranks(world: int, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp(f"mc2_{world}")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                           str(REPO_ROOT / "tests" / "support" / "mc2_harness.py"), str(out)],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda w: f"{w}ranks")
def ranks(request, tmp_path_factory):
    return run_ranks(request.param, tmp_path_factory)


def test_group_ep_is_the_name_upstream_asks_the_group_for_and_resolves_back(ranks):
    """executor/utils/hccl_utils.get_group_name: group._get_backend(npu).get_hccl_comm_name(rank)."""
    for rank in ranks:
        assert rank["resolves"] is True and rank["name"].startswith("npu-standin-gloo-")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dispatch_then_combine_equals_the_single_process_moe(ranks, version, dtype):
    """Every rank's tokens, dispatched to the ranks holding their top-k experts, run there and combined, equal the
    sum over their top-k of routing weight x expert output computed on one process, in the output's dtype, exactly
    (the combine's fp32 sum in top-k order, one rounding)."""
    for rank in ranks:
        case = rank[f"v{version}_{dtype}"]
        assert case["equal"] and case["max_abs"] == 0.0 and case["dtype"] == f"torch.{dtype}", case


@pytest.mark.parametrize("version", VERSIONS)
def test_dispatch_outputs_follow_the_documented_layout(ranks, version):
    """ep_recv_counts: prefix sums of the tokens each local expert got from each rank, (expert, rank) order;
    expert_token_nums: per local expert; expand_x's rows are the senders' tokens (found through v1's expand_idx, the
    token's index among those sent to its expert, or v2's (rank, token, slot) triples); shapes and dtypes are
    op-plugin's (A = BS x ranks x min(local experts, K) rows), and the fake (graph capture) gives the same shapes."""
    world = len(ranks)
    local = 8 // world
    rows = 5 * world * min(local, 3)
    for rank in ranks:
        case = rank[f"v{version}_bfloat16"]
        assert case["ep_recv_counts_ok"] and case["expert_token_nums_ok"] and case["rows_ok"], case
        index = [5 * 3] if version == 1 else [max(5 * 3, rows * 128)]
        assert case["shapes"] == [[rows, 32], [rows], index, [local], [world * local], [0], [rows]], case
        assert case["dtypes"] == ["torch.bfloat16", "torch.float32", "torch.int32", "torch.int64", "torch.int32",
                                  "torch.int32", "torch.float32"]
        assert case["fake_shapes"] == case["shapes"]
        if version == 1:
            assert case["expand_idx_ok"], case
        else:
            assert case["assist_triples"] > 0


@pytest.mark.parametrize("version", VERSIONS)
def test_counts_type_and_tp_world_size_0_or_1_are_the_same_moe(ranks, version):
    """expert_token_nums_type 0 (prefix sums) and 1 (counts); tp_world_size 0 and 1 both mean no TP domain, with a
    (tp_world_size,) tp_recv_counts; 2 (a TP domain the current page calls unsupported) is refused in one line."""
    for rank in ranks:
        variants = rank[f"v{version}_variants"]
        assert all(v["equal"] for v in variants.values()), variants
        counts, sums = variants["tp0_type1"]["expert_token_nums"], variants["tp0_type0"]["expert_token_nums"]
        assert torch.tensor(counts).cumsum(0).tolist() == sums
        assert variants["tp1_type1"]["tp_recv_counts"] == [1] and variants["tp0_type1"]["tp_recv_counts"] == [0]
        refused = rank[f"v{version}_tp2"]
        assert refused.startswith("UnsupportedOp:") and "tp_world_size=2" in refused and "\n" not in refused


@pytest.mark.parametrize("version", VERSIONS)
def test_unequal_batches_need_global_bs(ranks, version):
    """Ranks with different BS: global_bs 0 (documented for equal BS) is refused on every rank; global_bs =
    max_bs x ranks gives the MoE, with global_bs x min(local experts, K) rows."""
    world = len(ranks)
    for rank in ranks:
        assert "global_bs=0 with unequal BS" in rank[f"v{version}_unequal_bs_global_bs_0"]
        case = rank[f"v{version}_unequal_bs"]
        assert case["equal"] and case["rows"] == (1 + world) * world * min(8 // world, 3), case


@pytest.mark.parametrize("version", VERSIONS)
def test_a_wrong_routing_gives_another_answer(ranks, version):
    """Each expert's tokens sent to the next rank's expert of the same local slot (the kernels' owner rule broken):
    the combined output is no longer the single-process MoE, by far more than rounding."""
    for rank in ranks:
        case = rank[f"v{version}_wrong_routing"]
        assert not case["equal"] and case["max_abs"] > 0.1, case


@pytest.mark.parametrize("version", VERSIONS)
def test_a_routing_one_rank_cannot_take_is_refused_on_every_rank(ranks, version):
    """An expert id out of range on the last rank, a combine told of another routing on rank 0, an ep_rank_id that
    is not the rank's place in group_ep: every rank raises (none is left waiting in a collective), the rank at fault
    with its own line."""
    last = len(ranks) - 1
    for r, rank in enumerate(ranks):
        bad = rank[f"v{version}_bad_ids"]
        assert bad.startswith("ValueError:") and ("expert_ids outside" in bad if r == last else f"[{last}]" in bad)
        other = rank[f"v{version}_combine_other_ids"]
        assert other.startswith("ValueError:") and ("not dispatch's" in other if r == 0 else "[0]" in other), other
        assert f"but this rank is rank {r} of group_ep" in rank[f"v{version}_wrong_rank_id"]


def test_fake_shapes_follow_op_plugins_rule_for_more_and_fewer_local_experts_than_top_k():
    """A = global_bs_real x min(local experts, K) (op-plugin's MoeDistributeDispatch(V2)KernelOpApi.cpp), with
    global_bs_real = BS x ep_world_size when global_bs is 0; in-process, no group needed to capture."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from npu_standin import kernels

    kernels.install()
    ops = torch.ops.npu
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.zeros(6, 16, dtype=torch.bfloat16))
        ids = mode.from_tensor(torch.zeros(6, 4, dtype=torch.int32))
        for world, experts, global_bs, rows in ((2, 16, 0, 6 * 2 * 4), (4, 8, 0, 6 * 4 * 2), (4, 8, 40, 40 * 2)):
            v1 = ops.npu_moe_distribute_dispatch(x, ids, "g", world, 0, experts, global_bs=global_bs)
            v2 = ops.npu_moe_distribute_dispatch_v2(x, ids, "g", world, 0, experts, global_bs=global_bs,
                                                    tp_world_size=1)
            assert [list(t.shape) for t in v1] == [[rows, 16], [rows], [24], [experts // world], [experts],
                                                   [0], [rows]]
            assert list(v2[0].shape) == [rows, 16] and list(v2[2].shape) == [rows * 128] and list(v2[5].shape) == [1]
            out = ops.npu_moe_distribute_combine_v2(v2[0], ids, v2[2], v2[4], mode.from_tensor(torch.zeros(6, 4)),
                                                    "g", world, 0, experts)
            assert list(out.shape) == [6, 16] and out.dtype == torch.bfloat16


def test_without_a_process_group_the_kernels_say_so_in_one_line():
    from npu_standin import kernels

    kernels.install()
    x, ids = torch.zeros(2, 8, dtype=torch.bfloat16), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="no torch.distributed process group is initialised") as info:
        torch.ops.npu.npu_moe_distribute_dispatch_v2(x, ids, "npu-standin-gloo-0", 2, 0, 4)
    assert "\n" not in str(info.value)


def test_quantized_and_shared_expert_modes_are_refused_before_any_collective():
    """Modes the reference does not compute are refused with one line naming the mode, on every rank alike (the
    arguments are the same on every rank), before the kernel looks for its group."""
    from npu_standin import kernels
    from npu_standin.errors import UnsupportedOp

    kernels.install()
    x, ids = torch.zeros(2, 8, dtype=torch.bfloat16), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    ops = torch.ops.npu
    cases = [(lambda: ops.npu_moe_distribute_dispatch_v2(x, ids, "g", 2, 0, 4, quant_mode=2), "quant_mode=2"),
             (lambda: ops.npu_moe_distribute_dispatch(x, ids, "g", 2, 0, 4, shared_expert_rank_num=1),
              "shared_expert_rank_num=1"),
             (lambda: ops.npu_moe_distribute_dispatch_v2(x, ids, "g", 2, 0, 4, zero_expert_num=1), "zero_expert_num=1"),
             (lambda: ops.npu_moe_distribute_dispatch_v2(x, ids, "g", 2, 0, 4, x_active_mask=torch.ones(2, dtype=bool)),
              "x_active_mask"),
             (lambda: ops.npu_moe_distribute_combine_v2(x, ids, torch.zeros(8, dtype=torch.int32),
                                                        torch.zeros(4, dtype=torch.int32), torch.zeros(2, 2), "g", 2, 0,
                                                        4, comm_quant_mode=2), "comm_quant_mode=2")]
    for call, named in cases:
        with pytest.raises(UnsupportedOp) as info:
            call()
        assert named in str(info.value) and "\n" not in str(info.value)
