"""The native file on a compressed-tensors W8A8 int8 checkpoint (issue 43 items 2 and 7): the checkpoint written by
`--quantize w8a8`'s writer (agent.migrate.quantize) from a tiny Qwen3, the generated file given `quant_config` as
upstream's executor sets it (module.quantization.get_quant_config on the checkpoint's quantization_config), its
int8 weights and scales loaded as stored, process_weights_after_loading's scale dtypes, and the run held per step
(a packed prefill and a decode step, in bfloat16 as module.linear's quantized linears compute) to transformers
loading the same checkpoint with its compressed-tensors quantizer, by the precision verdict's rule
(agent.recipe.native.selfcheck with a "checkpoint" job). A wrong scale in the file's fused W8A8 MLP must fail it. Slow here: MLA (DeepSeek-V3's form, every layer dense)
against the installed transformers, and MoE with float experts (Qwen3-MoE, DeepSeek-V3 MLA + MoE) against
transformers 5.0 (.venv-tf5.0), each with a doubled dequant scale that must fail.
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
    # the grouped matmul's: None where the checkpoint's ignore names the experts (moe.experts_quant_config)
    assert set(sources) <= {"quant_config", "getattr(config, 'quant_config', None)", "None",
                            "experts_quant_config(quant_config, f'{prefix}.experts')"}, sources
    assert all(node.func.id == "FusedMoEGMM" for node in built for k in node.keywords
               if k.arg == "quant_config" and ast.unparse(k.value).startswith("experts_quant_config")), sources
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


# ---- slow: MLA and MoE on `--quantize w8a8` checkpoints, held per step to transformers on the written checkpoint ----
# (the default test_the_w8a8_checkpoint_runs_int8_and_holds_to_transformers_on_the_same_weights covers the path:
# the writer, module.quantization's W8A8 linears, the self-check's quantized reference)
TF50_PYTHON = REPO_ROOT / ".venv-tf5.0" / "bin" / "python"
# a doubled dequant scale of q_b_proj (MLA's query up-projection), planted after the absorb weights are split
DOUBLED_Q_B_SCALE = ("layer.self_attn.split_kv_b_weight()          # the absorb weights",
                     "layer.self_attn.split_kv_b_weight(); layer.self_attn.q_b_proj.weight_scale.data.mul_(2)  #")
# custom_params.enable_mla_prolog with NZ weights, as a YAML asks for it (the self-check's config has no custom_params)
PROLOG_ASKED = ('self.enable_mla_prolog = bool(custom_params.get("enable_mla_prolog", False)\n'
                '                                      and getattr(model_config, "enable_weight_nz", False))',
                "self.enable_mla_prolog = True")
# a doubled dequant scale of layer 0's attention output projection
DOUBLED_O_SCALE = ("        modules = dict(self.named_modules())\n",
                   "        self.model.layers[0].self_attn.o_proj.weight_scale.data.mul_(2)\n"
                   "        modules = dict(self.named_modules())\n")


def _selfcheck_quantized(root, model_type, overrides, faults, python=sys.executable):
    """`model_type`'s tiny checkpoint written by `--quantize w8a8`'s writer, the native file rendered for it (and
    one file per planted fault), the self-check run by `python` on the written checkpoint. Returns
    ({name: result}, stand-in ops, the writer's Written)."""
    from agent.measure.reference import tiny_checkpoint
    from agent.migrate.quantize import quantize_w8a8
    from agent.recipe.native.compose import derive
    from agent.recipe.native.decide import render_native
    from npu_standin.environment import standin_env

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    written = quantize_w8a8(tiny_checkpoint(model_type, root / "bf16", **overrides), root / "w8a8")
    config = json.loads((root / "w8a8" / "config.json").read_text())
    ctx = {"model_name": f"q_{model_type}", "framework_class": "TinyForCausalLM", "display_name": model_type,
           "model_class": "ForCausalLM"}
    text = render_native(ctx, derive(config))
    files = {"as written": text}
    for name, (old, new) in faults.items():
        assert text.count(old) == 1, name
        files[name] = text.replace(old, new)
    jobs = []
    for index, (name, body) in enumerate(files.items()):
        (root / f"modeling_{index}.py").write_text(body)
        jobs.append({"config": config, "file": str(root / f"modeling_{index}.py"), "class_name": "TinyForCausalLM",
                     "dtype": "bfloat16", "checkpoint": str(root / "w8a8")})
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = standin_env("cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(SNAPSHOT), str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([str(python), "-m", "agent.recipe.native.selfcheck", str(root / "jobs.json")],
                          capture_output=True, text=True, env=env, cwd=root, timeout=900)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("SELFCHECK ")), None)
    assert line is not None, proc.stderr[-3000:]
    usage = next(l for l in proc.stderr.splitlines() if l.startswith("[npu-standin] usage "))
    return (dict(zip(files, json.loads(line[len("SELFCHECK "):]))),
            json.loads(usage[len("[npu-standin] usage "):])["ops"], written)


def _mla_settings():
    from agent.run.standin import TINY_SETTINGS

    return dict(TINY_SETTINGS["deepseek_v3"])


@pytest.mark.slow
def test_mla_w8a8_holds_to_transformers_and_a_doubled_q_b_scale_fails(tmp_path):
    """DeepSeek-V3's form with every layer dense (MLA's linears int8, kv_b_proj in `ignore`: the absorb weights
    multiply in float), upstream deepseek_r1's A8W8 without the prolog: held per step to transformers loading the
    written checkpoint; q_b_proj's dequant scale doubled fails; enable_mla_prolog (NZ weights) is refused."""
    results, ops, written = _selfcheck_quantized(tmp_path, "deepseek_v3", {**_mla_settings(), "first_k_dense_replace": 2},
                                                 {"doubled q_b_proj scale": DOUBLED_Q_B_SCALE,
                                                  "prolog asked": PROLOG_ASKED})
    assert written.kept_float == ["lm_head", "model.layers.0.self_attn.kv_b_proj",
                                  "model.layers.1.self_attn.kv_b_proj"], written.kept_float
    assert results["as written"]["ok"] and results["as written"]["ratio"] <= 1.0, results
    assert not results["doubled q_b_proj scale"]["ok"], results
    assert results["doubled q_b_proj scale"]["reason"].startswith("prefill, sequence 0"), results
    # npu_mla_prolog_v3's quantized form is not written: the model refuses it in one line when it is built
    prolog = results["prolog asked"]
    assert not prolog["ok"] and prolog["reason"].startswith("ValueError: custom_params.enable_mla_prolog with W8A8 "
                                                            "weights") and "\n" not in prolog["reason"], prolog
    # per layer and step: q_a, q_b, kv_a, o, gate_up, down int8 (kv_b_proj's absorb weights float); 2 jobs, 2 steps
    # (the faulty job stops at its prefill), 2 layers
    assert ops["npu_quant_matmul"] == 6 * 2 * (2 + 1), ops
    assert ops["npu_transpose_batchmatmul"] > 0 and "npu_mla_prolog_v3" not in ops, ops


MOE_FORMS = {"qwen3_moe": ({}, ["lm_head", "model.layers.0.mlp.experts", "model.layers.0.mlp.gate",
                                "model.layers.1.mlp.experts", "model.layers.1.mlp.gate"]),
             # MLA + MoE with shared experts (quantized) and a dense first layer
             "deepseek_v3": (None, ["lm_head", "model.layers.0.self_attn.kv_b_proj", "model.layers.1.mlp.experts",
                                    "model.layers.1.mlp.gate", "model.layers.1.self_attn.kv_b_proj"])}


@pytest.mark.slow
@pytest.mark.skipif(not TF50_PYTHON.exists(), reason="no .venv-tf5.0 (make install-tf50)")
@pytest.mark.parametrize("model_type", list(MOE_FORMS))
def test_moe_w8a8_with_float_experts_holds_to_transformers_5_0(tmp_path, model_type):
    """MoE with the attention / dense / shared-expert linears int8 and the routed experts and routers float
    (`ignore`), the grouped matmul built float (moe.experts_quant_config): held per step to transformers 5.0
    (upstream's pin), whose compressed-tensors loader merges the float experts as stored; a doubled o_proj scale
    fails. The installed transformers (5.24) drops them: the writer refuses there (test_quantize.py)."""
    overrides, kept = MOE_FORMS[model_type]
    results, ops, written = _selfcheck_quantized(tmp_path, model_type, _mla_settings() if overrides is None else overrides,
                                                 {"doubled o_proj scale": DOUBLED_O_SCALE}, python=TF50_PYTHON)
    assert written.kept_float == kept, written.kept_float
    assert results["as written"]["ok"] and results["as written"]["ratio"] <= 1.0, results
    assert not results["doubled o_proj scale"]["ok"], results
    assert ops["npu_quant_matmul"] > 0 and ops["npu_grouped_matmul"] > 0, ops
