"""The static scan of torch_npu / torch.npu / torchair names, and what the stand-in covers of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from locations import REPO_ROOT
from npu_standin import standin_env
from npu_standin.scan import kernel_name, scan_source, scan_tree

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"


def test_scan_follows_aliases_and_stops_chains_at_calls():
    source = """
import torch
import torch_npu as tnpu
import torchair as tng
from torch_npu import npu_swiglu
from torchair.configs.compiler_config import CompilerConfig
x = tnpu.npu_rms_norm(a, b)[0]
y = npu_swiglu(x)
torch.npu.current_stream().wait_stream(s)
torch.ops.npu.npu_fused_infer_attention_score_v2(q, k, v)
tng.scope.npu_stream_switch("t")
z = x.npu()
cfg = CompilerConfig()
"""
    names = [name for name, _ in scan_source(source)]
    assert "torch_npu.npu_rms_norm" in names and "torch_npu.npu_swiglu" in names
    assert "torch.npu.current_stream" in names and "torch.npu.current_stream.wait_stream" not in names
    assert "torch.ops.npu.npu_fused_infer_attention_score_v2" in names
    assert "torchair.scope.npu_stream_switch" in names and "Tensor.npu" in names
    assert names.count("torchair.configs.compiler_config.CompilerConfig") == 2     # import + use
    assert kernel_name("torch.ops.npu.npu_rms_norm") == "npu_rms_norm" and kernel_name("torch.npu.synchronize") is None


@pytest.fixture(scope="module")
def snapshot_scan():
    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT} (../shared is absent)")
    return scan_tree(SNAPSHOT)


def coverage_on_standin(names):
    code = ("import json, sys, torch\nfrom npu_standin.scan import coverage\n"
            "print(json.dumps(coverage(json.loads(sys.stdin.read()))))\n")
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(sorted(names)), capture_output=True,
                          text=True, env=standin_env("cpu", base=dict(os.environ)), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_recipes_the_standin_runs_use_only_covered_names(snapshot_scan):
    """models/qwen, models/gpt_oss and the executor they run on: every name they use resolves on the
    stand-in. models/qwen3_moe, gemma_4 and qwen3_5: every name outside their mx-quantized and expert-parallel
    (MC2) paths does — qwen3_moe's npu_add_rms_norm_cast, gemma_4's npu_geglu, qwen3_5's npu_mm_all_reduce_base
    and its Gated DeltaNet's chunk / recurrent gated delta rule included. What is left uncovered in the snapshot
    is quantization (the expert-parallel MC2 kernels are covered: npu_standin/kernels/mc2.py)."""
    def used_in(*prefixes):
        return {u.name for u in snapshot_scan.uses if u.file.startswith(prefixes)}

    status = coverage_on_standin(snapshot_scan.counts())
    missing = {name for name, state in status.items() if state == "missing"}
    quantized = {n for n in missing if any(w in n for w in ("quant", "int4pack", "dtype_cast"))}
    # module/linear.py holds the W8A8 path too: its kernels have references (kernels/quant.py)
    in_scope = used_in("models/qwen/", "models/gpt_oss/models/", "executor/", "module/linear.py") & missing
    assert not in_scope, in_scope
    assert all(status[f"torch_npu.{op}"] == "kernel" for op in ("npu_dynamic_quant", "npu_quant_matmul",
                                                                 "npu_dequant_swiglu_quant"))
    for model in ("qwen3_moe", "gemma_4", "qwen3_5"):
        if not (SNAPSHOT / "models" / model).is_dir():
            continue
        uncovered = used_in(f"models/{model}/") & (missing - quantized)
        assert not uncovered, (model, uncovered)
    assert all(status[f"torch_npu.{op}"] == "kernel" for op in ("npu_add_rms_norm_cast", "npu_geglu",
                                                                 "npu_mm_all_reduce_base", "npu_chunk_gated_delta_rule",
                                                                 "npu_recurrent_gated_delta_rule"))
    # DeepSeek's MLA kernels are covered (npu_standin/kernels/mla.py), and the expert-parallel MC2 ops (mc2.py)
    assert missing - quantized == set(), missing - quantized
    kernels = snapshot_scan.kernels()
    top20 = [op for op, _ in kernels.most_common() if not any(w in op for w in ("quant", "int4pack"))][:20]
    covered = [op for op in top20 if status.get(f"torch_npu.{op}", status.get(f"torch.ops.npu.{op}")) == "kernel"]
    assert len(covered) >= 16, (top20, covered)
