"""The NPU-native sparse-MoE block (agent/recipe/native/parts/moe.py, its code parts/code/moe.py) against
transformers' own MoE block of each architecture on a shrunk config, fp32, under the stand-in's
reference kernels: the same output, the kernel chain in the record, and faults that must fail.
The harness: tests/support/native_moe_harness.py (also the 2-rank script)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import native_moe_harness as harness
from agent.recipe.native.parts.part import Expr

TOLERANCE = 1e-5      # relative to the output's largest magnitude: fp32, only summation order differs
FAULT = 1e-3          # a fault moves the output by far more


@pytest.fixture(scope="module", autouse=True)
def upstream_modules():
    if not harness.UPSTREAM.is_dir():
        pytest.skip(f"no upstream snapshot at {harness.UPSTREAM} (module/fuse_moe_gmm.py, module/linear.py)")
    harness.ensure_imports()


# their default-suite cover: phimoe's case (a gating in plain torch of its own, the same block and loader) and the
# sparsemixer fault; each whole model in float32 and bfloat16 with its faults: test_part_moe_kinds.py (slow)
SLOW_CASES = {"hunyuan_v1_moe", "kolibri1"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c
                                  for c in sorted(harness.CASES)])
def test_generated_block_matches_transformers_moe_block(case):
    result = harness.run(case)
    _, _, _, features = harness.reference(case)
    assert result["rel"] < TOLERANCE, result
    assert result["unloaded"] == [], result
    assert set(result["ops"]) == set(features["fused"]), result       # the chain each architecture runs
    assert {"npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_moe_finalize_routing"} <= set(result["ops"])


@pytest.mark.parametrize("case", ["mixtral", "deepseek_v3_64"])
def test_transformers_fused_expert_tensors_load_as_well(case):
    """A checkpoint saved without transformers' conversion holds experts.gate_up_proj / down_proj as 3-D
    tensors (transformers' own state_dict names): the block splits them per expert."""
    result = harness.run(case, fused_names=True)
    assert result["rel"] < TOLERANCE and result["unloaded"] == [], result


# facts each architecture's transformers code states, as the probe reads them
FEATURES = {
    "mixtral": dict(ckpt_expert_names=("w1", "w3", "w2"), scoring="softmax", renormalize=True, experts="gmm",
                    sparse_rule="all", shared=None),
    # the renormalisation is the config's norm_topk_prob, read when the model is built
    "qwen3_moe_unnormalised": dict(ckpt_expert_names=("gate_proj", "up_proj", "down_proj"),
                                   renormalize=Expr("config.norm_topk_prob"), router_fp32=False,
                                   sparse_rule="decoder_sparse_step"),
    "deepseek_v3": dict(scoring="sigmoid", selection_bias=True, groups=True, group_select="top2_sum",
                        routed_scaling=True, router_fp32=True, shared="plain", sparse_rule="first_k_dense_replace",
                        sparse_layers=(1,)),
    "gpt_oss": dict(router_name="router", router_bias=True, experts="biased_interleaved", activation="clamped_swiglu",
                    gate_up_layout="E,H,2I", ckpt_expert_names=()),
    # top-k of the logits, then softmax over them: the softmax's top-k renormalised; experts stored fused
    "granitemoe": dict(block_name="block_sparse_moe", router_name="router", scoring="softmax", renormalize=True,
                       experts="gmm", gate_up_layout="E,2I,H", ckpt_expert_names=(), width_key="intermediate_size"),
    # the bias [1, E] under the router's moe_statics; layers from moe_layer_start_index every moe_layer_interval
    "ernie4_5_moe": dict(scoring="softmax", selection_bias=True, selection_bias_name="gate.moe_statics.e_score_correction_bias",
                         sparse_rule="moe_layer_interval", sparse_layers=(1,), topk_key="moe_k", router_fp32=True,
                         shared="plain", shared_width="config.moe_intermediate_size * config.moe_num_shared_experts"),
    # the block's own selection bias, router_scaling_factor
    "hy_v3": dict(scoring="sigmoid", selection_bias=True, selection_bias_name="e_score_correction_bias", groups=False,
                  routed_scaling=True, scaling_key="router_scaling_factor", sparse_rule="mlp_layer_types",
                  shared_width="config.moe_intermediate_size * config.num_shared_experts"),
    # the top-k of the logits, then their sigmoid: picked by the logits (the sigmoids of large ones tie at 1)
    "llama4_text": dict(scoring="sigmoid", renormalize=False, selection_bias=False, select_on_logits=True,
                        input_scaled=True),
    "aria_text": dict(topk_key="moe_topk", gate_up_layout="E,H,2I", ckpt_expert_names=(), router_name="router",
                      shared_width="config.intermediate_size * config.moe_num_shared_experts"),
}


@pytest.mark.parametrize("case", sorted(FEATURES))
def test_features_read_from_the_transformers_block(case):
    from agent.recipe.native.parts.moe import derive_moe

    features = derive_moe(harness.shrunk_config(case))
    for key, want in FEATURES[case].items():
        assert features[key] == want, (key, features[key])


def test_mixtral_checkpoint_block_name_is_a_rename_of_the_skeleton():
    """mixtral's checkpoint stores the block as block_sparse_moe: transformers' rename, the file's table."""
    import re

    from agent.recipe.native.parts.model import checkpoint_renames

    def renamed(name, model_type):
        for pattern, replacement in checkpoint_renames(model_type):
            name = re.sub(pattern, replacement, name, count=1)
        return name

    # (transformers 5.0 states the gate's and the experts' renames apart, 5.x later one block rename)
    for name in ("model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.block_sparse_moe.experts.3.w1.weight"):
        assert renamed(name, "mixtral") == name.replace(".block_sparse_moe.", ".mlp.")
    assert checkpoint_renames("qwen3_moe") == ()


def test_expert_width_is_the_config_key_that_sizes_the_experts():
    """A config carrying both widths (mixtral with a stray moe_intermediate_size): the key is the one
    transformers' experts are built from, and a checkpoint of another width is refused, not narrowed."""
    from agent.recipe.native.parts.moe import derive_moe

    config = harness.shrunk_config("mixtral")
    config.moe_intermediate_size = 16
    features = derive_moe(config)
    assert features["width_key"] == "intermediate_size"
    module = harness.load_generated(harness_render({**features, "width_key": "moe_intermediate_size"}), "mixtral_w")
    block = module.MixtralSparseMoeBlock(config, harness.infer_config(), None)
    _, _, checkpoint, _ = harness.reference("mixtral")
    with pytest.raises(ValueError, match=r"experts\.0\.w[123]\.weight \(\d+, \d+\): an expert of width 16"):
        block.load_weights(list(checkpoint.items()))


def test_sparse_layers_follow_the_configs_rule():
    from transformers import AutoConfig

    from agent.recipe.native.parts.moe import derive_moe

    config = AutoConfig.for_model("qwen3_moe", **{**harness.SHRUNK, "num_hidden_layers": 4}, num_experts=4, num_experts_per_tok=2,
                                  decoder_sparse_step=2, mlp_only_layers=[1])
    features = derive_moe(config)
    assert features["sparse_layers"] == (3,) and features["sparse_rule"] == "decoder_sparse_step"
    module = harness.load_generated(harness_render(features), "qwen3_moe_layers")
    assert [module.is_moe_layer(config, i) for i in range(4)] == [False, False, False, True]


def test_the_layout_key_is_found_on_a_config_of_two_layers():
    """A tiny qwen2_moe (two layers, every one sparse): the layers follow decoder_sparse_step / mlp_only_layers,
    which the file reads (not "every layer sparse", which would refuse a checkpoint with a dense layer)."""
    from transformers import AutoConfig

    from agent.recipe.native.parts.moe import derive_moe

    config = AutoConfig.for_model("qwen2_moe", **{**harness.SHRUNK, "num_hidden_layers": 2}, num_experts=4,
                                  num_experts_per_tok=2)
    assert len(config.layer_types) == 2
    assert derive_moe(config)["sparse_rule"] == "decoder_sparse_step"


def harness_render(features):
    from agent.recipe.native.parts.moe import render_moe

    return render_moe(features)


def _swap_experts(items):
    """The checkpoint's experts 0 and 1 exchanged (a wrong expert order)."""
    def rename(name):
        for a, b in (("experts.0.", "experts.1."), ("experts.1.", "experts.0.")):
            if name.startswith(a):
                return b + name[len(a):]
        return name
    return [(rename(n), w) for n, w in items]


FAULTS = {
    "top-k renormalisation dropped": ("qwen3_moe", dict(features=dict(renormalize=False))),
    "selection bias dropped (fused gating)": ("deepseek_v3", dict(
        source_edit=lambda s: s.replace("bias=self.gate.e_score_correction_bias.float(),", "bias=None,"))),
    "selection bias used for the weights": ("deepseek_v3_64", dict(
        source_edit=lambda s: s.replace("weights = scores.gather(1, expert_ids)", "weights = choice.gather(1, expert_ids)"))),
    "routed scaling dropped": ("deepseek_v3_64", dict(features=dict(routed_scaling=False))),
    "experts in the wrong order": ("mixtral", dict(checkpoint_edit=_swap_experts)),
    "gate and up exchanged": ("mixtral", dict(features=dict(ckpt_expert_names=("w3", "w1", "w2")))),
    "selection bias under moe_statics not used for choosing (a wrong expert picked)": ("ernie4_5_moe", dict(
        source_edit=lambda s: s.replace("choice = scores + self.gate.e_score_correction_bias.float()", "choice = scores"))),
    "router_scaling_factor dropped": ("hy_v3", dict(features=dict(routed_scaling=False))),
    "granitemoe's top-k softmax not renormalised": ("granitemoe", dict(features=dict(renormalize=False))),
    "phimoe's sparsemixer threshold halved (other experts in the softmax)": ("phimoe", dict(
        source_edit=lambda s: s.replace("> 2 * jitter_eps", "> jitter_eps"))),
    "llama4's router weight on the expert's output, not its input": ("llama4_text", dict(
        features=dict(input_scaled=False))),
    "llama4's top-k of the sigmoid scores (tied at 1), not of the logits": ("llama4_text_saturated", dict(
        features=dict(select_on_logits=False))),
    "gpt_oss gate/up read as halves": ("gpt_oss", dict(
        source_edit=lambda s: s.replace("gate_up[..., ::2], gate_up[..., 1::2]", "gate_up.chunk(2, dim=-1)"))),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_in_the_generated_block_fails_the_check(fault):
    case, change = FAULTS[fault]
    kwargs = dict(change)
    if "features" in kwargs:
        _, _, _, derived = harness.reference(case)
        kwargs["features"] = {**derived, **kwargs["features"]}
    if "source_edit" in kwargs:        # the edit must hit the generated text
        _, _, _, derived = harness.reference(case)
        assert kwargs["source_edit"](harness_render(derived)) != harness_render(derived), fault
    result = harness.run(case, **kwargs)
    assert result["rel"] > FAULT, (fault, result)


def run_layouts(case, ranks, layouts, tmp_path, fault=None):
    """The harness's --layouts run on `ranks` gloo ranks: (returncode, stderr, result or None)."""
    out = tmp_path / f"layouts_{ranks}_{fault or 'ok'}.json".replace(" ", "_")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(harness.REPO_ROOT / "tests" / "support" / "native_moe_harness.py"), case, str(out),
               "--layouts", ",".join(f"{a}:{m}" for a, m in layouts)]
    proc = subprocess.run(command + (["--fault", fault] if fault else []), capture_output=True, text=True,
                          timeout=600, cwd=harness.REPO_ROOT)
    return proc.returncode, proc.stderr, json.loads(out.read_text()) if out.is_file() else None


EP_OPS = {"npu_moe_init_routing_v2", "npu_moe_re_routing", "npu_grouped_matmul", "npu_moe_finalize_routing",
          "npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2"}


@pytest.mark.parametrize("case", ["deepseek_v3_64", pytest.param("gpt_oss", marks=pytest.mark.slow),
                                  pytest.param("mixtral", marks=pytest.mark.slow),
                                  pytest.param("granitemoe", marks=pytest.mark.slow),
                                  pytest.param("llama4_text", marks=pytest.mark.slow)])
def test_expert_parallel_and_attention_data_parallel_at_two_ranks(case, tmp_path):
    """deepseek_v3_64 (grouped routing, shared experts; gpt_oss: its experts in plain torch between the grouped
    matmuls, with biases; mixtral) at 2 gloo ranks, each rank its own tokens of unequal
    count at the prefill: EP 2 under attention TP 2 (attn_tp 2, moe_tp 1), attention DP + EP 2 (attn_tp 1,
    moe_tp 1) and attention DP + MoE TP 2 (moe_tp_group gathers both ranks' tokens); every rank's output equals
    transformers' block on its own tokens at the prefill (all-to-all double routing) and the decode (MC2
    dispatch / combine). Each rank loading the next rank's experts (an expert's tokens computed by another
    rank's expert) is caught. 4 ranks, TP 2 x EP 2: test_expert_parallel_layouts_at_four_ranks (slow)."""
    layouts = [(2, 1), (1, 1), (1, 2)]
    code, stderr, result = run_layouts(case, 2, layouts, tmp_path)
    assert code == 0, stderr[-3000:]
    for attn, moe in layouts:
        row = result[f"attn_tp {attn} moe_tp {moe}"]
        assert row["prefill"] < TOLERANCE and row["decode"] < TOLERANCE, (attn, moe, row)
    assert set(result["ops"]) == EP_OPS, result["ops"]
    code, stderr, result = run_layouts(case, 2, [(2, 1)], tmp_path, "experts of the next EP rank")
    assert code == 0, stderr[-3000:]
    row = result["attn_tp 2 moe_tp 1"]
    assert row["prefill"] > FAULT and row["decode"] > FAULT, row


@pytest.mark.slow
def test_expert_parallel_layouts_at_four_ranks(tmp_path):
    """4 gloo ranks: TP 2 x EP 2 (attn_tp 4, moe_tp 2: experts' widths over moe_tp_group, experts over the strided
    moe_ep_group), EP 4, attention DP 2 x TP 2 with MoE TP 2 x EP 2, attention DP 4 with EP 4 and with MoE TP 2;
    and attention DP + MoE TP without the gather (different requests' partials summed) is caught."""
    layouts = [(4, 2), (4, 1), (2, 2), (1, 1), (1, 2)]
    code, stderr, result = run_layouts("deepseek_v3_64", 4, layouts, tmp_path)
    assert code == 0, stderr[-3000:]
    for attn, moe in layouts:
        row = result[f"attn_tp {attn} moe_tp {moe}"]
        assert row["prefill"] < TOLERANCE and row["decode"] < TOLERANCE, (attn, moe, row)
    code, stderr, result = run_layouts("deepseek_v3_64", 4, [(2, 4)], tmp_path, "moe_tp all-reduce across requests")
    # summing two requests' partials: a wrong answer, or gloo refusing tensors of two sizes at the prefill
    assert code != 0 or result["attn_tp 2 moe_tp 4"]["decode"] > FAULT, (code, result)


def test_a_routing_no_op_expresses_is_not_native():
    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.moe import _probe_gating

    class Block(torch.nn.Module):      # picks the k LOWEST scores: no candidate routes so
        def __init__(self, inner):
            super().__init__()
            self.gate, self.experts = inner.gate, inner.experts

        def forward(self, x):
            x = x.view(-1, x.shape[-1])
            probs = torch.softmax(torch.nn.functional.linear(x, self.gate.weight), -1)
            weights, index = torch.topk(-probs, 2, dim=-1)
            return self.experts(x, index, -weights)

    config, block, _, _ = harness.reference("mixtral")
    with pytest.raises(NotNative, match="routes by no gating"):
        _probe_gating(Block(block), block.gate, config, config.hidden_size)


def test_a_router_scoring_more_experts_than_the_block_routes_to_is_not_native():
    """inkling's router scores its shared experts beside the routed ones (derive crashed on the selection bias's
    width before): the probe names the extra scores."""
    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.moe import _probe_gating

    config, block, _, _ = harness.reference("mixtral")
    routed = block.gate.weight.shape[0]

    class Block(torch.nn.Module):      # two more scores than experts: the routed ones' top-k weighted over all
        def __init__(self, inner):
            super().__init__()
            self.gate = torch.nn.Linear(config.hidden_size, routed + 2, bias=False)
            self.experts = inner.experts

        def forward(self, x):
            x = x.view(-1, x.shape[-1])
            probs = torch.softmax(self.gate(x), -1)
            weights, index = torch.topk(probs[:, :routed], 2, dim=-1)
            return self.experts(x, index, weights)

    with pytest.raises(NotNative, match=f"scores {routed + 2} experts and the block routes to {routed}"):
        extra = Block(block)
        _probe_gating(extra, extra.gate, config, config.hidden_size)


@pytest.mark.parametrize("case", ["deepseek_v3_64", pytest.param("gpt_oss", marks=pytest.mark.slow),
                                  pytest.param("mixtral", marks=pytest.mark.slow)])
def test_two_ranks_split_experts_by_moe_tp(case, tmp_path):
    """moe_tp_size 2 over gloo: each rank holds half of every expert's intermediate axis (and of the
    shared experts), the all-reduce joins them; rank 0's output equals transformers' block."""
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(harness.REPO_ROOT / "tests" / "support" / "native_moe_harness.py"), case, str(out)],
                          capture_output=True, text=True, timeout=600, cwd=harness.REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["rel"] < TOLERANCE and result["unloaded"] == [], result


def test_chunked_moe_routes_a_long_prefill_chunk_by_chunk_with_the_same_result():
    """custom_params.moe_chunk_max_len (upstream's deepseek_r1): 13 tokens 4 at a time route and run the experts
    once per chunk (4 chunks) and give the block's result; a length that is not a positive count is refused in one
    line."""
    whole = harness.run("qwen3_moe")
    chunked = harness.run("qwen3_moe", custom_params={"moe_chunk_max_len": 4})
    assert whole["calls"]["npu_moe_init_routing_v2"] == 1 and chunked["calls"]["npu_moe_init_routing_v2"] == 4
    assert chunked["shape"] == whole["shape"] and chunked["rel"] < 1e-5, chunked
    for bad in (0, -8, "16"):
        with pytest.raises(ValueError, match=r"moe_chunk_max_len .*set a positive number of tokens"):
            harness.run("qwen3_moe", custom_params={"moe_chunk_max_len": bad})
