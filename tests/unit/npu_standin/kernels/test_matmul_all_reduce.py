"""npu_mm_all_reduce_base (npu_standin/kernels/matmul_all_reduce.py) at 2 gloo ranks: each rank's x1 @ x2 (+ bias
+ x3), summed over the process group its `hcom` names, equals the sum of every rank's product computed on one
process, and is what upstream's unfused path (the matmul, then dist.all_reduce on the group) computes. The ranks
run this file as a script (`python -m torch.distributed.run --nproc-per-node=2 THIS OUT_DIR`), each writing what it
found to OUT_DIR/rank_R.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

WORLD = 2


def run_ranks(out: Path) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
                           __file__, str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(WORLD)]


def test_mm_all_reduce_base_is_the_matmul_then_the_groups_all_reduce(tmp_path):
    for found in run_ranks(tmp_path):
        # fp32: the sum over ranks of each one's product, computed on one process (+ bias and x3 on every rank,
        # as the page's formula allreduce(x1 @ x2 + bias + x3) says), 3-D and 2-D x1
        assert found["fp32_3d"] < 1e-5 and found["fp32_2d"] < 1e-5 and found["fp32_bias_x3"] < 1e-5, found
        # bf16 as upstream's qwen3_5 calls it: exactly its unfused matmul-then-all_reduce, in x1's dtype and shape
        assert found["bf16_equals_unfused"] and found["bf16_dtype"] == "torch.bfloat16", found
        assert found["bf16_shape"] == [1, 5, 8]
        # the fault the comparison must catch: a rank's own product, not reduced, is far from the result
        assert found["local_only_differs"] > 0.1, found
        assert found["resolves"] and found["fake_shape"] == [1, 5, 8]
        assert found["unknown_hcom"].startswith("RuntimeError: npu stand-in: npu_mm_all_reduce_base: hcom 'nope' "
                                                "names no process group"), found
        assert "npu_mm_all_reduce_base with dequant_scale (a quantized mode) has no reference kernel" in \
            found["quantized"], found
        assert "reduce_op='max'" in found["max"], found


# ---- the ranks ------------------------------------------------------------------------------------
def _one_line_error(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return None


def _rank_main(out_dir: Path) -> None:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from npu_standin import dist as standin_dist, kernels

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    kernels.install()
    standin_dist._comm_names()
    tp = dist.new_group(list(range(WORLD)))
    hcom = tp._get_backend(torch.device("cpu")).get_hccl_comm_name(rank)   # as upstream's hccl_utils asks it
    op = torch.ops.npu.npu_mm_all_reduce_base
    gen = torch.Generator().manual_seed(11)                                 # the same draws on every rank
    x1s = [torch.randn(1, 5, 16, generator=gen) for _ in range(WORLD)]
    x2s = [torch.randn(16, 8, generator=gen) for _ in range(WORLD)]
    bias, x3s = torch.randn(8, generator=gen), [torch.randn(1, 5, 8, generator=gen) for _ in range(WORLD)]
    x1, x2 = x1s[rank], x2s[rank]
    whole = sum(a @ b for a, b in zip(x1s, x2s))
    found = {"resolves": standin_dist.process_group_named(hcom) is tp}
    found["fp32_3d"] = (op(x1, x2, hcom) - whole).abs().max().item()
    found["fp32_2d"] = (op(x1[0], x2, hcom) - whole[0]).abs().max().item()
    with_terms = whole + WORLD * bias + sum(x3s)
    found["fp32_bias_x3"] = (op(x1, x2, hcom, bias=bias, x3=x3s[rank]) - with_terms).abs().max().item()
    found["local_only_differs"] = (x1 @ x2 - op(x1, x2, hcom)).abs().max().item()
    low = op(x1.bfloat16(), x2.bfloat16(), hcom, reduce_op="sum")
    unfused = torch.matmul(x1.bfloat16(), x2.bfloat16())
    dist.all_reduce(unfused, group=tp)
    found.update(bf16_equals_unfused=torch.equal(low, unfused), bf16_dtype=str(low.dtype), bf16_shape=list(low.shape))
    with FakeTensorMode() as mode:
        found["fake_shape"] = list(op(mode.from_tensor(x1), mode.from_tensor(x2), hcom).shape)
    found["unknown_hcom"] = _one_line_error(lambda: op(x1, x2, "nope"))
    found["quantized"] = _one_line_error(lambda: op(x1, x2, hcom, dequant_scale=torch.ones(8)))
    found["max"] = _one_line_error(lambda: op(x1, x2, hcom, reduce_op="max"))
    (out_dir / f"rank_{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
    _rank_main(Path(sys.argv[1]))
