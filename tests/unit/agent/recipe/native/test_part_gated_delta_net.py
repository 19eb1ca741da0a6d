"""The Gated DeltaNet layer's code (agent/recipe/native/parts/code/linear_attention_gdn.py: qwen3_next's and qwen3_5's
linear_attention layers) against transformers' own layer on a tiny config, as the executor drives it
(tests/support/gdn_layer_check.py): a packed prefill of prompts of unequal length, one shorter than the conv's
history, then decode steps, each request's conv and recurrent state in its block of the Mamba cache beside a NaN
block no request owns. float32 runs the rule in plain torch (the NPU ops return bfloat16); bfloat16 runs
npu_chunk_gated_delta_rule and npu_recurrent_gated_delta_rule (the stand-in's references), held by the precision
verdict's rule. A decode that forgets either state, or a decay of the wrong sign, fails."""

from __future__ import annotations


import pytest

from locations import REPO_ROOT

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"
CONV_CODE = REPO_ROOT / "agent" / "recipe" / "native" / "parts" / "code" / "linear_attention_gdn.py"


def run(jobs):
    import gdn_layer_check

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    return gdn_layer_check.run(jobs, SNAPSHOT)


def test_the_layer_matches_transformers_across_prefill_and_decode_and_lost_state_fails():
    """qwen3_next in float32 and bfloat16; decode from a zero recurrent state fails, and so does a prefill's conv history
    that keeps the request before a short prompt (write_conv_history, which every conv-state file shares). olmo_hybrid's
    layer (q/k/v and the conv kernels stored apart, loaded by shard) in float32; its q and k rows swapped at load fail
    at the prefill (the slow table holds the rest: test_part_hybrid_layouts.py)."""
    jobs = [{"model_type": "qwen3_next"}, {"model_type": "qwen3_next", "dtype": "bfloat16"},
            {"model_type": "qwen3_next", "dtype": "bfloat16", "fault": "recurrent_state"},
            {"model_type": "qwen3_next", "fault": "history"},
            {"model_type": "olmo_hybrid"}, {"model_type": "olmo_hybrid", "fault": "shards"}]
    good_fp32, good_bf16, fault, history, olmo, olmo_fault = run(jobs)
    assert good_fp32["ok"] and good_fp32["max_rel"] < 1e-4, good_fp32
    assert good_bf16["ok"], good_bf16
    assert not fault["ok"] and fault["step"] == "decode step 1", fault
    assert not history["ok"] and history["step"] == "decode step 1" and history["row"] == 2, history
    assert olmo["ok"] and olmo["max_rel"] < 1e-4, olmo
    assert not olmo_fault["ok"] and olmo_fault["step"] == "prefill", olmo_fault


def conv_functions():
    """The code file's two depthwise causal convs (torch and F only), without the file's NPU imports."""
    import ast

    import torch
    import torch.nn.functional as F

    path = CONV_CODE
    tree = ast.parse(path.read_text())
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)
                 and node.name in ("causal_conv1d_packed", "torch_causal_conv1d_update")]
    namespace = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=functions, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102 - our code
    return namespace["causal_conv1d_packed"], namespace["torch_causal_conv1d_update"]


def test_the_conv_rounds_as_transformers_conv1d_in_bfloat16():
    """The packed prefill conv and the decode step's conv sum their taps in float32 and round once, as transformers'
    conv1d does: bit for bit its causal_conv1d_fn / causal_conv1d_update in bfloat16 (a sum in bfloat16 rounds each
    product and partial sum: a third of the outputs off by up to 2^-6, which put qwen3_5_moe's bfloat16 self-check
    over its tolerance)."""
    import torch
    import torch.nn.functional as F
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import causal_conv1d_fn, causal_conv1d_update

    packed, update = conv_functions()
    gen = torch.Generator().manual_seed(0)
    channels, kernel, lengths = 96, 4, [13, 6, 2]
    x = torch.randn(sum(lengths), channels, generator=gen).bfloat16()
    weight = (torch.randn(channels, kernel, generator=gen) * 0.5).bfloat16()
    positions = torch.cat([torch.arange(n) for n in lengths])
    want = torch.cat([causal_conv1d_fn(seq.T.unsqueeze(0), weight, None, activation="silu")[0].T
                      for seq in x.split(lengths)])
    assert torch.equal(packed(x, weight, positions), want)
    padded = F.pad(x, (0, 0, kernel - 1, 0))
    in_bf16 = sum(padded[kernel - 1 - s:kernel - 1 - s + len(x)] * weight[:, kernel - 1 - s]
                  * (positions >= s).unsqueeze(-1).bfloat16() for s in range(kernel))
    assert not torch.equal(F.silu(in_bf16), want)       # the bfloat16 sum this replaced: the check can tell
    state, new = torch.randn(3, channels, kernel - 1, generator=gen).bfloat16(), torch.randn(3, channels, generator=gen).bfloat16()
    got, history = update(new, state, weight)
    assert torch.equal(got, causal_conv1d_update(new.unsqueeze(-1), state.clone(), weight, None, "silu")[:, :, 0])
    assert torch.equal(history, torch.cat([state, new.unsqueeze(-1)], -1)[:, :, 1:])


@pytest.mark.slow
def test_both_layouts_in_both_dtypes_and_every_fault():
    """qwen3_5's separate projections beside qwen3_next's grouped ones; the conv history lost at decode, the
    recurrent state lost in float32, the decay's sign flipped: each fails where it shows."""
    goods = [{"model_type": t, "dtype": d} for t in ("qwen3_next", "qwen3_5_text") for d in ("float32", "bfloat16")]
    faults = [{"model_type": "qwen3_next", "fault": "conv_state"},
              {"model_type": "qwen3_5_text", "fault": "recurrent_state"},
              {"model_type": "qwen3_5_text", "dtype": "bfloat16", "fault": "decay"}]
    results = run(goods + faults)
    assert all(r["ok"] for r in results[:len(goods)]), list(zip(goods, results))
    steps = [r["step"] for r in results[len(goods):]]
    assert not any(r["ok"] for r in results[len(goods):]) and steps == ["decode step 1", "decode step 1", "prefill"], \
        list(zip(faults, results[len(goods):]))


# ---- the family's file: qwen3_next (Gated DeltaNet layers beside gated attention, sparse MoE with a gated shared
# expert) derived, rendered and held to transformers by the self-check --------------------------------------------
CTX = {"model_name": "qwen3_next", "framework_class": "Qwen3NextForCausalLM", "display_name": "qwen3_next",
       "model_class": "X"}
GATE_FAULT = ("out = out.reshape(q_len, -1) * torch.sigmoid(gate)", "out = out.reshape(q_len, -1)")
STATE_FAULT = ("if is_prefill else self.recurrent_state.index_select(0, blocks))", "if True else None)")


@pytest.fixture(scope="module")
def qwen3_next():
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    config = AutoConfig.for_model("qwen3_next").to_dict()
    return config, derive(config)


def test_the_hybrid_is_read_from_the_architecture(qwen3_next):
    """The linear_attention layers are config.layer_types', the Gated DeltaNet's layout qwen3_next's grouped
    projections; the attention's q_proj carries an output gate; the file builds each layer's own kind and
    registers the linear layers' states as Mamba cache entries."""
    from agent.recipe.native.decide import render_native

    _, composition = qwen3_next
    assert composition.parts["linear_attention"] == "gated_delta_net"
    assert composition.parts["attention"] == "fused_paged" and composition.parts["norm"] == "offset_rms_norm"
    assert {k: composition.options[k] for k in ("LINEAR_ATTENTION", "GDN_PROJECTIONS", "OUTPUT_GATE")} == \
        {"LINEAR_ATTENTION": True, "GDN_PROJECTIONS": "qkvz_ba", "OUTPUT_GATE": True}
    assert any(item.startswith("npu_chunk_gated_delta_rule") for item in composition.fused)
    assert any(item.startswith("npu_recurrent_gated_delta_rule") for item in composition.fused)
    text = render_native(CTX, composition)
    assert "class Qwen3NextGatedDeltaNet(nn.Module):" in text and "MambaCacheEntry(" in text
    assert 'self.is_linear = config.layer_types[layer_idx] == "linear_attention"' in text
    assert text.count(GATE_FAULT[0]) == 1 and text.count(STATE_FAULT[0]) == 1
    assert "in_proj_qkv(" not in text            # the other layout folded away


def test_a_model_without_linear_layers_keeps_its_file():
    """A qwen3_next config of full-attention layers only: no linear-attention part, and a plain attention's type
    (qwen3) gets no output gate."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    config = AutoConfig.for_model("qwen3_next").to_dict()
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    composition = derive(config)
    assert "linear_attention" not in composition.parts and composition.options["OUTPUT_GATE"] is True
    assert derive(AutoConfig.for_model("qwen3").to_dict()).options["OUTPUT_GATE"] is False


def test_the_hybrid_file_matches_transformers_and_faults_fail(qwen3_next, tmp_path):
    """The file in float32 (the rule in plain torch) and bfloat16 (the NPU ops' references) on the packed
    prefill then decode steps, each request's states in its Mamba block (every other block NaN); a file that
    drops the attention's output gate, or decodes from a zero recurrent state, fails."""
    from agent.recipe.native.decide import render_native, selfcheck, selfcheck_jobs

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    config, composition = qwen3_next
    text = render_native(CTX, composition)
    good, gate, state = tmp_path / "qwen3_next.py", tmp_path / "gate.py", tmp_path / "state.py"
    good.write_text(text)
    gate.write_text(text.replace(*GATE_FAULT))
    state.write_text(text.replace(*STATE_FAULT))
    labelled = selfcheck_jobs(config, composition.checked_variants, str(good), CTX["framework_class"])[:2]
    jobs = [job for _, job in labelled] + [
        {"config": config, "file": str(gate), "class_name": CTX["framework_class"], "dtype": "bfloat16"},
        {"config": config, "file": str(state), "class_name": CTX["framework_class"]}]
    results = selfcheck(jobs, SNAPSHOT)
    assert all(r["ok"] for r in results[:2]), [(label, r["reason"]) for (label, _), r in zip(labelled, results)]
    assert results[0]["max_rel"] < 1e-4
    assert not results[2]["ok"] and "prefill" in results[2]["reason"], results[2]
    assert not results[3]["ok"] and "decode step 1" in results[3]["reason"], results[3]


@pytest.mark.slow
def test_the_hybrid_file_serves_the_family_settings(qwen3_next, tmp_path):
    """Every config setting the file reads (MoE layout, no shared expert, rope scalings on the partial rotary,
    the attention bias, tied embeddings) held to transformers in float32."""
    from agent.recipe.native.decide import render_native, selfcheck, selfcheck_jobs

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    config, composition = qwen3_next
    good = tmp_path / "qwen3_next.py"
    good.write_text(render_native(CTX, composition))
    labelled = selfcheck_jobs(config, composition.checked_variants, str(good), CTX["framework_class"])[2:]
    results = selfcheck([job for _, job in labelled], SNAPSHOT)
    assert all(r["ok"] for r in results), [(label, r["reason"]) for (label, _), r in zip(labelled, results) if not r["ok"]]


def test_a_model_of_linear_attention_only_writes_no_attention():
    """Every layer linear attention (no softmax-attention layer to read): derived with no attention
    (parts/no_attention.py), the file building none; transformers' own model cannot run such a config with its cache,
    so the self-check, not derive, decides it (test_part_mamba2_hybrids.py holds granitemoehybrid's)."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    config = AutoConfig.for_model("qwen3_next").to_dict()
    config["layer_types"] = ["linear_attention"] * config["num_hidden_layers"]
    composition = derive(config)
    assert composition.matches["attention"].name == "no_attention"
    assert composition.options.get("NO_ATTENTION") and composition.options.get("LINEAR_ATTENTION")


def test_tensor_parallel_linear_attention_is_refused_before_any_rank_starts():
    """The linear layers run whole on each rank: attn_tp_size 2 is refused in one line naming the key to set (the
    generated file's own guard says the same); attention data parallel (attn_tp_size 1 at 2 ranks) is accepted, and
    a model without linear attention keeps its layouts."""
    from transformers import AutoConfig

    from agent.recipe.native.preflight import parallel_problem

    config = AutoConfig.for_model("qwen3_next").to_dict()
    tp = {"world_size": 2, "attn_tp_size": 2, "moe_tp_size": 2, "lmhead_tp_size": 2}
    problem = parallel_problem(config, tp, 2)
    assert problem.startswith("linear-attention layers") and problem.endswith("set attn_tp_size to 1"), problem
    assert parallel_problem(config, {**tp, "attn_tp_size": 1, "lmhead_tp_size": 1}, 2) is None
    plain = {k: v for k, v in config.items() if not k.startswith("linear_")}
    assert parallel_problem(plain, tp, 2) is None
