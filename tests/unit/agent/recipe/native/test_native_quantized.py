"""The native file on a compressed-tensors W8A8 int8 checkpoint (issue 43 items 2 and 7): the checkpoint written by
`--quantize w8a8`'s writer (agent.migrate.quantize) from a tiny Qwen3, the generated file given `quant_config` as
upstream's executor sets it (module.quantization.get_quant_config on the checkpoint's quantization_config), its
int8 weights and scales loaded as stored, process_weights_after_loading's scale dtypes, and the run held per step
(a packed prefill and a decode step, in bfloat16 as module.linear's quantized linears compute) to transformers
loading the same checkpoint with its compressed-tensors quantizer, by the precision verdict's rule
(agent.recipe.native.selfcheck with a "checkpoint" job). A wrong scale in the file's fused W8A8 MLP must fail it.
The slow end-to-end runs through upstream's launcher: tests/e2e/test_quantized_checkpoints.py (the published
compressed-tensors form) and tests/e2e/test_quantize_w8a8.py (`migrator run --quantize w8a8`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from locations import REPO_ROOT

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"
# the fused W8A8 MLP's dequantization scale of gate/up, doubled: a wrong scale
WRONG_SCALE = ("weight_scale=self.gate_up_proj.weight_scale,", "weight_scale=self.gate_up_proj.weight_scale * 2,")


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    from agent.measure.reference import tiny_checkpoint
    from agent.migrate.quantize import quantize_w8a8
    from agent.recipe.native.compose import derive
    from agent.recipe.native.decide import render_native
    from npu_standin.environment import standin_env

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    root = tmp_path_factory.mktemp("native_w8a8")
    quantized = root / "qwen3-w8a8"
    quantize_w8a8(tiny_checkpoint("qwen3", root / "qwen3-bf16"), quantized)
    config = json.loads((quantized / "config.json").read_text())
    ctx = {"model_name": "q_qwen3", "framework_class": "TinyForCausalLM", "display_name": "qwen3",
           "model_class": "ForCausalLM"}
    text = render_native(ctx, derive(config))
    files = {"as written": root / "modeling_q_qwen3.py", "wrong scale": root / "modeling_q_qwen3_fault.py"}
    files["as written"].write_text(text)
    assert text.count(WRONG_SCALE[0]) == 1
    files["wrong scale"].write_text(text.replace(*WRONG_SCALE))
    jobs = [{"config": config, "file": str(path), "class_name": "TinyForCausalLM", "dtype": "bfloat16",
             "checkpoint": str(quantized)} for path in files.values()]
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = standin_env("cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(SNAPSHOT), str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "agent.recipe.native.selfcheck", str(root / "jobs.json")],
                          capture_output=True, text=True, env=env, cwd=root, timeout=600)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("SELFCHECK ")), None)
    assert line is not None, proc.stderr[-3000:]
    usage = next(l for l in proc.stderr.splitlines() if l.startswith("[npu-standin] usage "))
    return {"results": dict(zip(files, json.loads(line[len("SELFCHECK "):]))), "text": text,
            "ops": json.loads(usage[len("[npu-standin] usage "):])["ops"], "config": config}


LINEARS = ("QKVParallelLinear", "MergedColumnParallelLinear", "RowParallelLinear", "ColumnParallelLinear",
           "ReplicatedLinear", "FusedMoEGMM")


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "qwen3_moe", "deepseek_v3", "phi3", "mixtral", "gemma2", "gpt_oss"])
def test_the_file_threads_quant_config_through_every_linear_and_the_grouped_matmul(model_type):
    """Every module.linear layer and the MoE grouped matmul the generated file builds takes
    quant_config=getattr(config, "quant_config", None), as upstream's models pass it (module.quantization picks the
    float method for a layer the checkpoint's ignore list names, and for every layer of a float checkpoint)."""
    import ast

    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.decide import render_native

    ctx = {"model_name": f"q_{model_type}", "framework_class": "TinyForCausalLM", "display_name": model_type,
           "model_class": "ForCausalLM"}
    tree = ast.parse(render_native(ctx, derive(AutoConfig.for_model(model_type).to_dict())))
    built = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id in LINEARS]
    assert len(built) >= 4, [ast.unparse(n.func) for n in built]     # router, qkv, o, head at least
    without = [ast.unparse(node)[:80] for node in built if "quant_config" not in {k.arg for k in node.keywords}]
    assert without == []
    # each takes the config's quant_config (a local of that value, or the expression itself); the output head and
    # the MTP layer's eh_proj None, as upstream's qwen and deepseek_r1 build them
    sources = {ast.unparse(k.value): ast.unparse(node) for node in built for k in node.keywords
               if k.arg == "quant_config"}
    assert set(sources) <= {"quant_config", "getattr(config, 'quant_config', None)", "None"}, sources
    floats = [ast.unparse(node) for node in built if any(k.arg == "quant_config" and ast.unparse(k.value) == "None"
                                                           for k in node.keywords)]
    assert all("prefix='lm_head'" in f or "prefix='eh_proj'" in f for f in floats), floats   # as upstream's: float
    assigned = [ast.unparse(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "quant_config" for t in n.targets)]
    assert set(assigned) <= {"getattr(config, 'quant_config', None)"}, assigned
    if model_type in ("qwen3_moe", "deepseek_v3", "mixtral"):
        assert any(node.func.id == "FusedMoEGMM" for node in built)


def test_the_w8a8_checkpoint_runs_int8_and_holds_to_transformers_on_the_same_weights(checked):
    result = checked["results"]["as written"]
    assert result["ok"], result
    assert result["ratio"] <= 1.0, result         # within the verdict's rule itself, not only its slack
    ops = checked["ops"]
    # both jobs ran upstream's W8A8 chain: per layer and step, 4 quant matmuls (qkv, o, gate_up to int32, down),
    # 3 dynamic quants (down takes the fused op's int8 and scale), 1 dequant-swiglu-quant
    assert ops["npu_quant_matmul"] > 0 and ops["npu_quant_matmul"] == 4 * ops["npu_dequant_swiglu_quant"], ops
    assert ops["npu_dynamic_quant"] == 3 * ops["npu_dequant_swiglu_quant"], ops
    assert "npu_swiglu" not in ops                  # the float MLP never ran


def test_a_wrong_scale_in_the_fused_w8a8_mlp_fails_at_the_prefill(checked):
    result = checked["results"]["wrong scale"]
    assert not result["ok"], result
    assert result["reason"].startswith("prefill, sequence 0") and "differ from transformers'" in result["reason"], result
