"""npu_grouped_matmul: y_i = x_i @ weight_i + bias_i over groups (m-axis grouping), unquantized."""

from __future__ import annotations

import torch

from npu_standin.kernels import overload, refuse, reference

_ACTIVATIONS = {
    0: lambda y: y,
    1: torch.relu,
    2: lambda y: torch.nn.functional.gelu(y, approximate="tanh"),
    4: lambda y: torch.nn.functional.gelu(y, approximate="tanh"),   # FAST_GELU: the tanh approximation
    5: torch.nn.functional.silu,
}


def _group_sizes(group_list, group_list_type, m: int) -> list[int]:
    if group_list is None:
        return [m]
    values = group_list.tolist() if isinstance(group_list, torch.Tensor) else list(group_list)
    if group_list_type in (None, 0):        # cumulative ends
        ends = [int(v) for v in values]
        sizes = [ends[0]] + [b - a for a, b in zip(ends, ends[1:])]
    elif group_list_type == 1:              # sizes
        sizes = [int(v) for v in values]
    else:                                   # [[group, size], ...]
        sizes = [int(pair[1]) for pair in values]
    if sum(sizes) > m or any(s < 0 for s in sizes):
        raise ValueError(f"npu_grouped_matmul: group_list {values} does not split {m} rows")
    return sizes


def _weights(weight: list, groups: int) -> list[torch.Tensor]:
    if len(weight) == 1 and weight[0].dim() == 3:
        return list(weight[0].unbind(0))
    return list(weight)


def _biases(bias, groups: int):
    if bias is None:
        return [None] * groups
    if len(bias) == 1 and bias[0].dim() == 2:
        return list(bias[0].unbind(0))
    return list(bias)


def _grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                    per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                    activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                    tuning_config=None, output_dtype=None, x_dtype=None, weight_dtype=None, scale_dtype=None,
                    per_token_scale_dtype=None):
    unreferenced = [n for n, v in (("offset", offset), ("antiquant_scale", antiquant_scale),
                                   ("antiquant_offset", antiquant_offset), ("x_dtype", x_dtype),
                                   ("weight_dtype", weight_dtype), ("scale_dtype", scale_dtype),
                                   ("per_token_scale_dtype", per_token_scale_dtype)) if v is not None]
    if unreferenced:
        refuse("npu_grouped_matmul", f"{', '.join(unreferenced)} (a quantized path without a reference)")
    if group_type not in (None, -1, 0):
        refuse("npu_grouped_matmul", f"group_type={group_type} (k-axis grouping)")
    if scale is not None or per_token_scale is not None or any(t.dtype in (torch.int8, torch.int32)
                                                                for t in [*x, *weight]):
        # int8 x int8 (W8A8): kernels/quant.py
        from npu_standin.kernels import quant

        return quant.grouped_matmul(
            x, weight, bias=bias, scale=scale, per_token_scale=per_token_scale, output_dtype=output_dtype,
            act_type=act_type, split_item=split_item,
            pieces_of=lambda tensors: _pieces(tensors, group_list, group_list_type, group_type, len(_weights(weight, 0))))
    if output_dtype is not None:
        from npu_standin.kernels.quant import scalar_type

        if scalar_type(output_dtype) != x[0].dtype:
            refuse("npu_grouped_matmul", f"output_dtype {output_dtype} for {x[0].dtype} inputs")
    mixed = [w.dtype for w in weight if w.dtype != x[0].dtype]
    if mixed:
        # Unlike torch.matmul (mixed_matmul_dtypes), the NPU does not promote here: hicann/ops-transformer
        # gmm/grouped_matmul/op_host/op_api/aclnn_grouped_matmul.cpp, CheckFunctionParams, takes the
        # unquantized path only `if ((xDtype == DT_BF16 || ... DT_FLOAT16 || ... DT_FLOAT) && xDtype ==
        # weightDtype)`; a float x with another float weight matches no pattern and is refused with this line.
        names = {torch.bfloat16: "DT_BF16", torch.float16: "DT_FLOAT16", torch.float32: "DT_FLOAT"}
        raise RuntimeError("aclnnGroupedMatmul (npu stand-in): GMM: there is no matching xDtype and weightDtype "
                           f"pattern. case with x dtype {names.get(x[0].dtype, x[0].dtype)} and weight dtype "
                           f"{names.get(mixed[0], mixed[0])} is not supported.")
    activation = _ACTIVATIONS.get(act_type or 0)
    if activation is None:
        refuse("npu_grouped_matmul", f"act_type={act_type}")
    out_dtype = x[0].dtype
    results: list[torch.Tensor] = []
    ws_all = _weights(weight, 0)
    if group_list is None and group_type in (None, -1) and not (len(x) == 1 and len(ws_all) > 1):
        # "multi-multi-multi": independent matmuls
        ws = _weights(weight, len(x))
        bs = _biases(bias, len(ws))
        for xi, wi, bi in zip(x, ws, bs):
            yi = xi.float() @ wi.float()
            if bi is not None:
                yi = yi + bi.float()
            results.append(activation(yi).to(out_dtype))
    else:
        ws = _weights(weight, 0)
        bs = _biases(bias, len(ws))
        if len(x) == 1:
            sizes = _group_sizes(group_list, group_list_type, x[0].shape[0])
            pieces = list(x[0][: sum(sizes)].split(sizes))
        else:
            pieces = list(x)
        if len(pieces) != len(ws):
            raise ValueError(f"npu_grouped_matmul: {len(pieces)} groups of x for {len(ws)} weights")
        for wi in ws[:1]:
            if x[0].shape[-1] != wi.shape[-2]:
                # x (M, K) against weight (K, N): a weight left as loaded, (N, K) (no
                # process_weights_after_loading), as upstream's common_issues.md quotes the NPU's error
                raise RuntimeError(f"aclnnGroupedMatmul (npu stand-in): Dim 1 mismatch ({x[0].shape[-1]} vs "
                                   f"{wi.shape[-2]}): x {tuple(x[0].shape)}, weight {tuple(wi.shape)}")
        for xi, wi, bi in zip(pieces, ws, bs):
            yi = xi.float() @ wi.float()
            if bi is not None:
                yi = yi + bi.float()
            results.append(activation(yi).to(out_dtype))
    if split_item in (2, 3):
        out = torch.cat(results, dim=0)
        rows = sum(t.shape[0] for t in x)
        if out.shape[0] < rows:
            # op-plugin's output is (sum of x's rows, N) whatever group_list covers (GroupedMatmulKernelNpuOpApi.cpp,
            # `calculate_dim_m`): an EP dispatch's expand_x has rows past its tokens, which no group reads (zeros here)
            out = torch.cat([out, out.new_zeros((rows - out.shape[0], out.shape[1]))])
        return [out]
    return results


def _pieces(x: list, group_list, group_list_type, group_type, groups: int) -> tuple[int, list]:
    """(rows of the single x, its row groups), or (rows, x) for a list of x, as the unquantized path splits."""
    if len(x) == 1 and (group_list is not None or groups > 1) and group_type not in (-1,):
        sizes = _group_sizes(group_list, group_list_type, x[0].shape[0])
        return x[0].shape[0], list(x[0][: sum(sizes)].split(sizes))
    return sum(t.shape[0] for t in x), list(x)


def _grouped_matmul_fake(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                         antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                         activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                         group_list_type=0, act_type=0, tuning_config=None, output_dtype=None, x_dtype=None,
                         weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None):
    from npu_standin.kernels.quant import scalar_type

    ws = _weights(weight, 0)
    n = ws[0].shape[-1]
    dtype = scalar_type(output_dtype)
    dtype = dtype if isinstance(dtype, torch.dtype) else x[0].dtype
    if split_item in (2, 3):
        rows = sum(t.shape[0] for t in x)
        return [x[0].new_empty((rows, n), dtype=dtype)]
    if len(x) == len(ws):
        return [xi.new_empty((*xi.shape[:-1], wi.shape[-1]), dtype=dtype) for xi, wi in zip(x, ws)]
    raise NotImplementedError("npu stand-in: npu_grouped_matmul with a single x split into several outputs "
                              "has data-dependent shapes; not capturable")


@reference("npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
           "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
           "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
           "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
           "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
           "int? output_dtype=None, int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, "
           "int? per_token_scale_dtype=None) -> Tensor[]",
           formulation="x split into groups by group_list (cumsum / counts / pairs), y_g = x_g @ w_g + b_g in fp32, "
                       "optional activation; split_item 2/3 concatenate; unquantized only",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py::test_grouped_matmul_matches_per_expert_loop",
           fake=_grouped_matmul_fake)
def npu_grouped_matmul(x, weight, **kwargs):
    return _grouped_matmul(x, weight, **kwargs)


def _grouped_matmul_list(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                         antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                         activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                         group_list_type=0, act_type=0, output_dtype=None):
    return _grouped_matmul(x, weight, bias=bias, scale=scale, offset=offset, antiquant_scale=antiquant_scale,
                           antiquant_offset=antiquant_offset, per_token_scale=per_token_scale,
                           group_list=group_list, split_item=split_item, group_type=group_type,
                           group_list_type=0, act_type=act_type)


overload("npu_grouped_matmul",
         "npu_grouped_matmul.List(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
         "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
         "Tensor[]? per_token_scale=None, int[]? group_list=None, Tensor[]? activation_input=None, "
         "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
         "int? group_type=None, int? group_list_type=0, int? act_type=0, ScalarType? output_dtype=None) -> Tensor[]",
         _grouped_matmul_list)


# ---- torch.matmul / torch.mm on npu tensors: the NPU's rule for mixed input dtypes --------------
_CUBE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def mixed_matmul_dtypes(a: torch.Tensor, b: torch.Tensor):
    """(compute dtype, result dtype) of an NPU matmul/mm of `a` and `b` whose dtypes differ, or None where
    the NPU has no mixed-dtype rule for them (equal dtypes, or a dtype outside float32/float16/bfloat16).

    As on the NPU (Atlas A2/A3, the chips upstream's bf16 recipes run on), from the source:

    * torch_npu's `matmul` is op-plugin's own kernel, not ATen's composite (which would call `mm` and
      fail on the host's "expected m1 and m2 to have the same dtype"): Ascend/op-plugin
      op_plugin/config/op_plugin_functions.yaml registers `matmul(Tensor self, Tensor other)` (op_api
      [v2.1, newest]) and op_plugin/config/derivatives.yaml gives it its own backward
      (`self, other: matmul_backward(grad, self, other, grad_input_mask)`), so the Autograd key does not
      fall back to the composite.
    * op_plugin/ops/opapi/MatmulKernelNpuOpApi.cpp, `matmul_forward`: no dtype check; the output takes
      the FIRST input's dtype, `auto out = ...apply_tensor_without_format(output_size, self.options());`
      then `EXEC_NPU_CMD(aclnnMatmul, self, mat2, out, cube_math_type);` (`mm` in MmKernelNpuOpApi.cpp:
      `apply_tensor_without_format(output_size, self.options())` and `aclnnMm`, the same).
    * hicann/ops-nn (CANN's aclnnMatmul / aclnnMm), matmul/common/op_host/op_api/matmul_util.cpp:
      `CheckDtypeValid`: "// self和mat2的dtype不相等时，会做promote处理。" (unequal dtypes are promoted),
      OP_LOGW "Self's dtype [%s] and mat2's dtype [%s] are not equal. Promotion of Data Type will be
      applied"; `Dav2201MatMulRule::GetUpperDtypeByLookUpTable` (DAV_2201 = A2/A3): rows
      `/*1: FP32+FP16*/` -> FP32, `/*3: FP32+BF16*/` -> FP32, `/*4: FP16+BF16*/` -> FP32 for every
      cubeMathType torch_npu passes by default (KEEP_DTYPE; HF32 / ALLOW_FP32_DOWN_PRECISION when
      allow_hf32 is set: still FP32 inputs); both inputs are cast to it (`ExecMmOpWithBias`:
      `ContiguousAndCast(..., mmOpInfo.support_info.self_dtype, ...)`) and the product is cast to the
      output's dtype (`MatmulGraphImpl::CommonPostProcessWithReshape`:
      `convOut = l0op::Cast(convOut, output->GetDataType(), executor);`). The same promotion is there
      since the repository's first commit (e11fe07f3, `SetMmSupportDType`: "BF16或者存在FP32输入则全部
      dtype统一到FP32").
    * ops-nn's page matmul/mat_mul_v3/docs/aclnnMatmul.md says otherwise in its constraints ("Atlas A2
      / A3: 不支持两个输入分别为BFLOAT16和FLOAT32的数据类型推导"); the code above is what runs.

    So bf16 x fp32 is computed in fp32 and comes back in bf16 (the first input's dtype); fp32 x bf16
    comes back in fp32. (Atlas 训练/推理系列, DefaultMatMulRule, have no bf16 at all.)"""
    if a.dtype == b.dtype or a.dtype not in _CUBE_DTYPES or b.dtype not in _CUBE_DTYPES:
        return None
    return torch.float32, a.dtype


def mixed_addmm_dtypes(self: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor):
    """(compute dtype, result dtype) of an NPU `addmm(self, mat1, mat2)` (self: the added term, a
    linear layer's bias) whose three dtypes are not all equal, or None where the NPU has no mixed rule.

    * op-plugin@517f2e7d op_plugin/ops/opapi/AddmmKernelNpuOpApi.cpp, `addmm`: the output is
      `apply_tensor_without_format(output_size, self.options())` (the ADDED term's dtype, not mat1's),
      then `EXEC_NPU_CMD(aclnnAddmm, self, mat1, mat2, beta, alpha, result, cube_math_type)`; no dtype check.
    * hicann/ops-nn@e5c3fa93 matmul/mat_mul_v3/op_host/op_api/aclnn_addmm.cpp, `CheckInputParams`:
      `archRule->CheckInput(mat1, mat2, self, out, ...)`, Dav2201MatMulRule (matmul_util.cpp): each of
      mat1 / mat2 / bias / out only has to be FP32, FP16 or BF16; `PromoteDtype` takes the mat1 x mat2
      type from the same table as matmul (FP32+BF16 -> FP32), `UpdateBiasDtype` keeps an FP32 bias in
      FP32; the sum is taken at `op::PromoteType(mulOut, matmulOut)` and cast to the output
      (`l0op::Cast(addOut, addmmTensor.out->GetDataType(), ...)`).

    The reference computes the whole of beta*self + alpha*(mat1 @ mat2) in fp32 (exact for the bf16 /
    fp16 inputs) and returns self's dtype."""
    dtypes = {self.dtype, mat1.dtype, mat2.dtype}
    if len(dtypes) == 1 or not dtypes <= set(_CUBE_DTYPES):
        return None
    return torch.float32, self.dtype


def _note(name: str, detail: str) -> None:
    from npu_standin import record

    if not record.compiling():
        record.note(f"{name}-mixed-dtypes", detail)


def _npu_dtype_rule(name: str, real):
    """torch.matmul / mm / bmm on the NPU: mixed_matmul_dtypes (bmm: op-plugin@517f2e7d
    op_plugin/ops/opapi/BmmKernelNpuOpApi.cpp `bmm` allocates `self.options()` and calls
    aclnnBatchMatMul, whose CheckParamsV2 runs the same Dav2201MatMulRule (`BuildRule()->CheckInput`),
    hicann/ops-nn@e5c3fa93 common/op_host/op_api/batch_matmul_util.cpp casts both inputs to
    `support_info.self_dtype` / `mat2_dtype` and aclnn_batch_matmul.cpp `PostProcess` casts the product
    to the output's dtype)."""
    import functools

    @functools.wraps(real)
    def op(input, other, *args, **kwargs):
        rule = (mixed_matmul_dtypes(input, other)
                if isinstance(input, torch.Tensor) and isinstance(other, torch.Tensor) else None)
        if rule is None:
            return real(input, other, *args, **kwargs)
        compute, result_dtype = rule
        _note(name, f"torch.{name} of {input.dtype} and {other.dtype}: computed in {compute}, result "
                    f"{result_dtype} (the first input's dtype), as op-plugin's {name} and aclnn promote on "
                    "Atlas A2/A3")
        out = kwargs.pop("out", None)
        result = real(input.to(compute), other.to(compute), *args, **kwargs).to(result_dtype)
        if out is not None:
            return out.copy_(result)
        return result

    return op


def _npu_addmm_rule(real):
    import functools

    @functools.wraps(real)
    def op(input, mat1, mat2, *args, beta=1, alpha=1, out=None, **kwargs):
        rule = (mixed_addmm_dtypes(input, mat1, mat2)
                if all(isinstance(t, torch.Tensor) for t in (input, mat1, mat2)) and not args and not kwargs
                else None)
        if rule is None:
            if out is not None:
                kwargs["out"] = out
            return real(input, mat1, mat2, *args, beta=beta, alpha=alpha, **kwargs)
        compute, result_dtype = rule
        if out is not None:
            result_dtype = out.dtype
        _note("addmm", f"torch.addmm of {input.dtype} + {mat1.dtype} x {mat2.dtype}: computed in {compute}, "
                       f"result {result_dtype} (the added term's dtype), as op-plugin's addmm and aclnnAddmm "
                       "promote on Atlas A2/A3")
        result = real(input.to(compute), mat1.to(compute), mat2.to(compute), beta=beta, alpha=alpha).to(result_dtype)
        if out is not None:
            return out.copy_(result)
        return result

    return op


def npu_linear_rule(real_linear):
    """F.linear on the NPU where its dtypes differ, over the host's `real_linear` (the real F.linear,
    closed over: a captured region traces it, no lookup at call time). torch_npu registers no `linear`
    (op-plugin@517f2e7d op_plugin/config/op_plugin_functions.yaml has `npu_linear`, not `linear`), so
    `aten::linear` is torch's CompositeImplicitAutograd one (aten/src/ATen/native/Linear.cpp `linear`),
    whose calls land on op-plugin's kernels:

    * 2-D input with a bias: `at::addmm(bias, input, weight.t())`; a contiguous 3-D input with a bias, or
      any contiguous input with a 1-D bias: `_flatten_nd_linear`, the same addmm on the flattened rows.
      These follow mixed_addmm_dtypes: computed in fp32, result in the BIAS's dtype.
    * otherwise `at::matmul(input, weight.t())` (op-plugin's own matmul: mixed_matmul_dtypes, the
      input's dtype), then `output.add_(bias)` in place (the result keeps the input's dtype).

    The same decomposition on the host is checked in
    tests/unit/npu_standin/kernels/test_reference_kernels.py (TorchDispatchMode)."""
    import functools

    @functools.wraps(real_linear)
    def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if bias is not None and input.layout == torch.strided and weight.layout == torch.strided and (
                input.dim() == 2 or (input.is_contiguous() and (input.dim() == 3 or bias.dim() == 1))):
            compute, result_dtype = mixed_addmm_dtypes(bias, input, weight) or (None, None)
            if compute is not None:
                _note("linear", f"F.linear of {input.dtype} x {weight.dtype} + {bias.dtype} bias: aten's addmm "
                                f"path, computed in {compute}, result {result_dtype} (the bias's dtype)")
                rows = input.reshape(-1, input.shape[-1]).to(compute)
                y = torch.addmm(bias.to(compute), rows, weight.to(compute).t())
                return y.reshape(*input.shape[:-1], weight.shape[0]).to(result_dtype)
            return real_linear(input, weight, bias)
        rule = mixed_matmul_dtypes(input, weight)
        if rule is None:
            if bias is None or bias.dtype == input.dtype:
                return real_linear(input, weight, bias)
            output = real_linear(input, weight)
        else:
            compute, result_dtype = rule
            _note("linear", f"F.linear of {input.dtype} x {weight.dtype}: aten's matmul path, computed in "
                            f"{compute}, result {result_dtype} (the input's dtype)")
            output = torch.matmul(input.to(compute), weight.to(compute).t()).to(result_dtype)
        if bias is not None:
            output = output.add_(bias)
        return output

    return linear


def install_torch_ops() -> None:
    """torch.matmul / Tensor.matmul / `@` / torch.mm / Tensor.mm / torch.bmm / Tensor.bmm follow
    mixed_matmul_dtypes, torch.addmm / Tensor.addmm mixed_addmm_dtypes, torch.nn.functional.linear (what
    nn.Linear calls) npu_linear_rule (once per process: patches.replace); equal dtypes are torch's own
    call. Each replacement closes over the real callable."""
    from npu_standin.patches import replace

    for owner, attr, name in ((torch, "matmul", "matmul"), (torch.Tensor, "matmul", "matmul"),
                              (torch.Tensor, "__matmul__", "matmul"), (torch, "mm", "mm"),
                              (torch.Tensor, "mm", "mm"), (torch, "bmm", "bmm"), (torch.Tensor, "bmm", "bmm")):
        replace(owner, attr, lambda real, name=name: _npu_dtype_rule(name, real))
    for owner in (torch, torch.Tensor):
        replace(owner, "addmm", _npu_addmm_rule)
    replace(torch.nn.functional, "linear", npu_linear_rule)
