"""npu_mm_all_reduce_base: the tensor-parallel matmul fused with its all-reduce (MC2's MatmulAllReduce), over the
host's process group.

Source: Ascend/op-plugin@517f2e7d docs/zh/custom_APIs/torch_npu/torch_npu-npu_mm_all_reduce_base.md:
output = allreduce(x1 @ ((x2 + antiquantOffset) * antiquantScale) + bias + x3); x1 (m, k) or (b, s, k), x2 (k, n)
(2-D), the output x1's shape with its last dim n and, unquantized, x1's dtype; reduce_op "sum" only; comm_turn 0
only; `hcom` is the group's HCCL communicator name (`get_hccl_comm_name`). Here `hcom` is the name the stand-in's
process groups answer to upstream's `group._get_backend(npu).get_hccl_comm_name(rank)`
(executor/utils/hccl_utils.py), resolved back to the group (npu_standin/dist.py, `process_group_named`).

The unquantized rows of the page's tables (fp16 / bf16 x1, x2, bias, x3) are computed: each rank's x1 @ x2 + bias
+ x3 in float32 rounded once to x1's dtype, then summed over the group (dist.all_reduce) — what the unfused
matmul-then-all_reduce upstream runs otherwise computes. The pseudo- and fully-quantized modes (antiquant /
dequant / pertoken / comm-quant scales, integer or fp8 inputs, the *_dtype overrides, group_sizes) are refused
with one line; comm_mode (the communication engine) changes no value and is accepted.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from npu_standin.kernels import refuse, reference

TEST = "tests/unit/npu_standin/kernels/test_matmul_all_reduce.py"


def _fake(x1, x2, hcom, *, reduce_op="sum", bias=None, antiquant_scale=None, antiquant_offset=None, x3=None,
          dequant_scale=None, pertoken_scale=None, comm_quant_scale_1=None, comm_quant_scale_2=None,
          antiquant_group_size=0, comm_turn=0, group_sizes=None, y_dtype=None, x1_dtype=None, x2_dtype=None,
          dequant_scale_dtype=None, pertoken_scale_dtype=None, comm_quant_mode=0, comm_mode=None):
    return x1.new_empty((*x1.shape[:-1], x2.shape[-1]))


def _group(op: str, hcom: str):
    from npu_standin.dist import process_group_named

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"npu stand-in: {op}: no torch.distributed process group is initialised "
                           "(hcom names an HCCL communicator of one)")
    group = process_group_named(hcom)
    if group is None:
        raise RuntimeError(f"npu stand-in: {op}: hcom {hcom!r} names no process group of this process "
                           "(pass group._get_backend(device).get_hccl_comm_name(rank) of the TP group)")
    return group


@reference("npu_mm_all_reduce_base(Tensor x1, Tensor x2, str hcom, *, str reduce_op='sum', Tensor? bias=None, "
           "Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, Tensor? x3=None, Tensor? dequant_scale=None, "
           "Tensor? pertoken_scale=None, Tensor? comm_quant_scale_1=None, Tensor? comm_quant_scale_2=None, "
           "int antiquant_group_size=0, int comm_turn=0, int[]? group_sizes=None, int? y_dtype=None, "
           "int? x1_dtype=None, int? x2_dtype=None, int? dequant_scale_dtype=None, int? pertoken_scale_dtype=None, "
           "int comm_quant_mode=0, str? comm_mode=None) -> Tensor",
           formulation="allreduce_sum over hcom's process group of (x1 @ x2 + bias + x3 in fp32, rounded once to "
                       "x1's dtype); quantized modes refused",
           test=f"{TEST}::test_mm_all_reduce_base_is_the_matmul_then_the_groups_all_reduce",
           fake=_fake)
def npu_mm_all_reduce_base(x1, x2, hcom, *, reduce_op="sum", bias=None, antiquant_scale=None, antiquant_offset=None,
                           x3=None, dequant_scale=None, pertoken_scale=None, comm_quant_scale_1=None,
                           comm_quant_scale_2=None, antiquant_group_size=0, comm_turn=0, group_sizes=None,
                           y_dtype=None, x1_dtype=None, x2_dtype=None, dequant_scale_dtype=None,
                           pertoken_scale_dtype=None, comm_quant_mode=0, comm_mode=None):
    op = "npu_mm_all_reduce_base"
    quantized = {"antiquant_scale": antiquant_scale, "antiquant_offset": antiquant_offset,
                 "dequant_scale": dequant_scale, "pertoken_scale": pertoken_scale,
                 "comm_quant_scale_1": comm_quant_scale_1, "comm_quant_scale_2": comm_quant_scale_2,
                 "group_sizes": group_sizes, "y_dtype": y_dtype, "x1_dtype": x1_dtype, "x2_dtype": x2_dtype,
                 "dequant_scale_dtype": dequant_scale_dtype, "pertoken_scale_dtype": pertoken_scale_dtype}
    for name, value in quantized.items():
        if value is not None:
            refuse(op, f"{name} (a quantized mode)")
    if antiquant_group_size or comm_quant_mode:
        refuse(op, f"antiquant_group_size={antiquant_group_size}, comm_quant_mode={comm_quant_mode} (a quantized mode)")
    if not (x1.is_floating_point() and x2.is_floating_point()) or x1.element_size() < 2 or x2.element_size() < 2:
        refuse(op, f"x1 {x1.dtype} / x2 {x2.dtype} (integer or 8-bit inputs: a quantized mode)")
    if reduce_op != "sum":
        refuse(op, f"reduce_op={reduce_op!r} (the page: only 'sum')")
    if comm_turn != 0:
        refuse(op, f"comm_turn={comm_turn} (the page: only 0)")
    if x1.dim() not in (2, 3) or x2.dim() != 2 or x1.shape[-1] != x2.shape[0]:
        raise ValueError(f"npu stand-in: {op}: x1 (m, k) or (b, s, k) and x2 (k, n) expected, got {tuple(x1.shape)} "
                         f"and {tuple(x2.shape)}")
    group = _group(op, hcom)
    y = x1.float() @ x2.float()
    if bias is not None:
        y = y + bias.float()
    if x3 is not None:
        y = y + x3.float()
    out = y.to(x1.dtype)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out
