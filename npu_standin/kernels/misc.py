"""Cache updates, formats, prefetch, transpose-batchmatmul."""

from __future__ import annotations

import torch

from npu_standin.kernels import refuse, reference

ACL_FORMAT_ND = 2
FORMAT_ATTR = "_npu_standin_format"


def _scatter_nd(data, indices, updates):
    depth = indices.shape[-1]
    if depth > data.dim():
        raise ValueError(f"npu_scatter_nd_update: indices' last dim {depth} > input rank {data.dim()}")
    flat = indices.reshape(-1, depth).long()
    rows = updates.reshape(flat.shape[0], *data.shape[depth:])
    data[tuple(flat.t())] = rows.to(data.dtype)
    return data


def _same_fake(data, indices, updates):
    return data


@reference("npu_scatter_nd_update_(Tensor(a!) self, Tensor indices, Tensor updates) -> Tensor(a!)",
           mutates=("data",),
           capture_schema="_standin_npu_scatter_nd_update_(Tensor(a!) self, Tensor indices, Tensor updates) -> ()",
           formulation="self[tuple(indices[..., :a].T)] = updates (a = indices.shape[-1]), in place",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py::test_scatter_nd_update_matches_naive_loop",
           fake=_same_fake)
def npu_scatter_nd_update_(data, indices, updates):
    return _scatter_nd(data, indices, updates)


@reference("npu_scatter_nd_update(Tensor self, Tensor indices, Tensor updates) -> Tensor",
           formulation="npu_scatter_nd_update_ on a copy",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py::test_scatter_nd_update_matches_naive_loop",
           fake=lambda data, indices, updates: torch.empty_like(data))
def npu_scatter_nd_update(data, indices, updates):
    return _scatter_nd(data.clone(), indices, updates)


def _scatter_update(data, indices, updates, axis):
    axis = axis % data.dim()
    if indices.dim() != 1 or axis == 0 or indices.shape[0] != data.shape[0] or updates.shape[0] != data.shape[0]:
        refuse("scatter_update", f"indices of shape {tuple(indices.shape)} on axis {axis} (only per-batch "
                                 "offsets, 1-d indices of length data.size(0), are documented)")
    length = updates.shape[axis]
    for b, start in enumerate(indices.tolist()):
        data[b].narrow(axis - 1, int(start), length).copy_(updates[b])
    return data


@reference("scatter_update_(Tensor(a!) self, Tensor indices, Tensor updates, int axis) -> Tensor(a!)",
           mutates=("data",),
           capture_schema="_standin_scatter_update_(Tensor(a!) self, Tensor indices, Tensor updates, int axis) -> ()",
           formulation="for each batch b: self[b] along axis, from indices[b], = updates[b] (1-d indices), in place",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py"
                "::test_scatter_update_writes_each_batch_at_its_offset",
           fake=lambda data, indices, updates, axis: data)
def scatter_update_(data, indices, updates, axis):
    return _scatter_update(data, indices, updates, axis)


@reference("scatter_update(Tensor self, Tensor indices, Tensor updates, int axis) -> Tensor",
           formulation="scatter_update_ on a copy",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py"
                "::test_scatter_update_writes_each_batch_at_its_offset",
           fake=lambda data, indices, updates, axis: torch.empty_like(data))
def scatter_update(data, indices, updates, axis):
    return _scatter_update(data.clone(), indices, updates, axis)


@reference("npu_format_cast(Tensor self, int acl_format, *, int? customize_dtype=None, int? input_dtype=None) -> Tensor",
           formulation="a copy with the same values (a storage format is invisible to the values); "
                       "torch_npu.get_npu_format reports the format asked for",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py"
                "::test_format_cast_keeps_values_and_reports_format",
           fake=lambda x, acl_format, customize_dtype=None, input_dtype=None: torch.empty_like(x))
def npu_format_cast(x, acl_format, customize_dtype=None, input_dtype=None):
    if customize_dtype is not None or input_dtype is not None:
        refuse("npu_format_cast", "customize_dtype/input_dtype (a quantized storage)")
    out = x.clone()
    setattr(out, FORMAT_ATTR, int(acl_format))
    return out


def get_npu_format(x) -> int:
    """torch_npu.get_npu_format: the format npu_format_cast produced the tensor in, else ND (2)."""
    return getattr(x, FORMAT_ATTR, ACL_FORMAT_ND)


@reference("npu_prefetch(Tensor self, Tensor? dependency, int max_size, int offset=0) -> ()",
           formulation="nothing: a prefetch into the NPU's L2 cache has no effect on values",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py::test_prefetch_changes_nothing",
           fake=lambda x, dependency, max_size, offset=0: None)
def npu_prefetch(x, dependency, max_size, offset=0):
    return None


def _tbmm_shape(input_, weight, perm_x1, perm_x2, perm_y):
    perm_x1 = list(perm_x1 or [0, 1, 2])
    perm_x2 = list(perm_x2 or [0, 1, 2])
    return input_.size(perm_x1.index(1)), input_.size(perm_x1.index(0)), weight.size(perm_x2.index(2))


def _tbmm_fake(input_, weight, *, bias=None, scale=None, perm_x1=None, perm_x2=None, perm_y=None,
               batch_split_factor=1):
    m, batch, n = _tbmm_shape(input_, weight, perm_x1, perm_x2, perm_y)
    return input_.new_empty((m, batch, n))


@reference("npu_transpose_batchmatmul(Tensor input, Tensor weight, *, Tensor? bias=None, Tensor? scale=None, "
           "int[]? perm_x1=None, int[]? perm_x2=None, int[]? perm_y=None, int? batch_split_factor=1) -> Tensor",
           formulation="Y = (input.permute(perm_x1) @ weight.permute(perm_x2)).permute(perm_y), fp32 accumulate",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py"
                "::test_transpose_batchmatmul_matches_permute_bmm",
           fake=_tbmm_fake)
def npu_transpose_batchmatmul(input_, weight, *, bias=None, scale=None, perm_x1=None, perm_x2=None, perm_y=None,
                              batch_split_factor=1):
    if scale is not None:
        refuse("npu_transpose_batchmatmul", "scale (an int8 output)")
    if bias is not None or (batch_split_factor or 1) > 1:
        refuse("npu_transpose_batchmatmul", "bias or batch_split_factor > 1")
    perm_x1 = list(perm_x1 or [0, 1, 2])
    perm_x2 = list(perm_x2 or [0, 1, 2])
    perm_y = list(perm_y or [1, 0, 2])
    x = input_.permute(*perm_x1).float()
    w = weight.permute(*perm_x2).float()
    return torch.bmm(x, w).permute(*perm_y).contiguous().to(input_.dtype)
