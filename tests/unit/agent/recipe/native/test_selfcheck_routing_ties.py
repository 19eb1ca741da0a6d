"""The self-check's run-dtype MoE routing ties (agent/recipe/native/selfcheck.py RoutingTies): where the file's
experts for a token rank top in transformers' float32 router logits each moved by no more than rounding the router's
weight, input and logit to bfloat16 can move it (rounding_reach, routing_tie), both references take the file's
choice at that token and the verdict says how many; any other choice is never forced. minimax_m3_vl_text's defaults
(expert 1 or 2 at one token of its second MoE layer, within that reach) fail their bfloat16 job without it
(1.19 against 0.559) and pass with it."""

from __future__ import annotations

import sys

import pytest

from locations import REPO_ROOT
from part_selfcheck import SNAPSHOT, ctx, write_with_faults

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import native_coverage  # noqa: E402 - the script's folder on sys.path first

SOFTMAX = {"scoring": "softmax", "n_group": 1, "topk_group": 1, "group_select": "top2_sum"}
SIGMOID = {**SOFTMAX, "scoring": "sigmoid"}


def test_rounding_reach_bounds_a_bfloat16_router():
    """A router computed from its weight and input rounded to bfloat16 (its logits rounded too) stays within the
    reach of its float32 logits, at every expert of every token."""
    import torch

    from agent.recipe.native.selfcheck import rounding_reach

    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(8, 64, generator=gen) * 0.16, torch.randn(32, 64, generator=gen) * 3
    exact = torch.nn.functional.linear(x, weight)
    rounded = torch.nn.functional.linear(x.bfloat16(), weight.bfloat16()).float()
    reach = torch.stack([rounding_reach(weight, row, logits) for row, logits in zip(x, exact)])
    assert bool(((rounded - exact).abs() <= reach).all())
    assert float(reach.max()) < 0.1 * float(exact.abs().max())     # a rounding's reach, not the logits' size
    # a router the run dtype keeps in float32 (its input rounded alone): a reach of its input's share
    kept = torch.nn.functional.linear(x.bfloat16().float(), weight)
    narrow = torch.stack([rounding_reach(weight, row, logits, False) for row, logits in zip(x, exact)])
    assert bool(((kept - exact).abs() <= narrow).all()) and bool((narrow < reach).all())


@pytest.mark.parametrize("logits, ours, gating, bias, reach, tie, why", [
    ([2.0, 1.0, 0.999, -1.0], [0, 2], SOFTMAX, None, 1e-3, True, "experts 1 and 2 1e-3 apart, within the reach"),
    ([2.0, 1.0, 0.999, -1.0], [0, 2], SOFTMAX, None, 1e-4, False, "the same, the reach 10 times smaller"),
    ([2.0, 1.0, 0.5, -1.0], [0, 2], SOFTMAX, None, 1e-2, False, "0.5 apart: a choice bf16 decides"),
    ([2.0, 1.0, 0.5, -1.0], [2, 3], SOFTMAX, None, 1e-2, False, "the router's logits negated"),
    # minimax_m3_vl_text's: sigmoid scores plus a selection bias, expert 2's bias bringing it beside expert 1
    ([10.6, 5.11, 0.389, -1.28], [0, 1], SIGMOID, [0.0, 0.0, 0.4, 0.0], 1e-2, True, "a bias-made tie"),
    ([10.6, 5.11, 0.389, -1.28], [0, 1], SIGMOID, [0.0, 0.0, 0.4, 0.0], 1e-3, False, "the same, a tenth the reach"),
    # a huge reach makes any choice a top-k: a pick of one expert twice, or of one the router has not, is still none
    ([2.0, 1.0, 0.999, -1.0], [0, 0], SOFTMAX, None, 1e3, False, "the top expert twice"),
    ([2.0, 1.0, 0.999, -1.0], [0, 4], SOFTMAX, None, 1e3, False, "an expert past the router's"),
    ([2.0, 1.0, 0.999, -1.0], [-1, 0], SOFTMAX, None, 1e3, False, "a negative expert id"),
], ids=["tie", "reach-smaller", "apart", "negated", "bias-tie", "bias-apart", "twice", "past", "negative"])
def test_a_routing_tie_is_a_top_k_within_the_reach(logits, ours, gating, bias, reach, tie, why):
    import torch

    from agent.recipe.native.selfcheck import routing_tie

    found = routing_tie(torch.tensor(logits), torch.full((len(logits),), reach), torch.tensor(ours), gating,
                        None if bias is None else torch.tensor(bias))
    assert found is tie, why


def _file_of_one_moe_block():
    """A stand-in for the generated file's model: one MoE block at model.layers.0.mlp with a `gating` (whose expert
    ids RoutingTies records; the test hands them in itself)."""
    import torch

    block, layer, file = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    block.top_k, block.gating = 2, lambda hidden: (None, None)
    layer.mlp = block
    file.model = torch.nn.Module()
    file.model.layers = torch.nn.ModuleList([layer])
    return file


def test_the_references_take_the_files_choice_at_a_tie_and_nowhere_else():
    """A tiny qwen3_moe whose experts 1 and 2 have routers 1e-6 apart: at every token where one of them is the
    second choice, the file's other pick is a tie; at the last token the file picks the expert transformers ranks
    last, which is no tie. The float32 and the bfloat16 reference both take the file's choice at the ties, with the
    gating's own weights for it, and their own elsewhere."""
    import torch
    from transformers import AutoConfig

    from agent.recipe.native.selfcheck import Incremental, RoutingTies, reference_model

    config = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  num_experts=4, num_experts_per_tok=2, vocab_size=64, norm_topk_prob=True)
    config._attn_implementation, config._experts_implementation = "eager", "eager"
    torch.manual_seed(0)
    reference = reference_model(config)
    router = reference.model.layers[0].mlp.gate
    with torch.no_grad():
        router.weight.mul_(8)
        router.weight[2] = router.weight[1] + 1e-6
    rounded = reference_model(config)
    rounded.load_state_dict(reference.state_dict())
    references = [Incremental(reference, 1), Incremental(rounded.to(torch.bfloat16), 1)]
    ties = RoutingTies(_file_of_one_moe_block(), references, config)
    seen = {}
    for name, incremental in zip(("float32", "bfloat16"), references):
        def capture(module, args, kwargs, name=name):
            seen[name] = (args[1].sort(-1).values.clone(), args[2].float().clone(), args[0].float().clone())
        incremental.models[0].model.layers[0].mlp.experts.register_forward_pre_hook(capture, with_kwargs=True)

    tokens = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():   # transformers' own choice, not steered (no file choice recorded yet)
        reference(input_ids=torch.tensor([tokens]))
    own = seen["float32"][0]
    swapped = {1: 2, 2: 1}
    file_ids = own.clone()
    tie_rows = [p for p in range(len(tokens)) if len(set(own[p].tolist()) & {1, 2}) == 1]
    for p in tie_rows:
        file_ids[p] = torch.tensor([swapped.get(e, e) for e in own[p].tolist()]).sort().values
    last = len(tokens) - 1
    assert tie_rows and last not in tie_rows, own
    # at the last token the expert transformers ranks last instead of its second: a wrong choice, no tie
    ranked = torch.nn.functional.linear(seen["float32"][2][last], router.weight).argsort(descending=True)
    file_ids[last] = ranked[[0, -1]].sort().values
    ties.calls = {0: file_ids}
    ties.file_routed([(0, p) for p in range(len(tokens))])
    for incremental in references:
        incremental.logits(0, tokens)

    expected = own.clone()
    expected[tie_rows] = file_ids[tie_rows]
    assert torch.equal(seen["float32"][0], expected) and torch.equal(seen["bfloat16"][0], expected)
    assert sorted(p for _, _, p in ties.forced) == tie_rows
    # the gating's own weights at the file's experts: the renormalised softmax of the float32 logits there
    logits = torch.nn.functional.linear(seen["float32"][2], router.weight)
    weights = logits.softmax(-1).gather(1, seen["float32"][0])
    weights = weights / weights.sum(-1, keepdim=True)
    assert torch.allclose(seen["float32"][1].sort(-1).values, weights.sort(-1).values, atol=1e-6)
    assert ties.line() == (f"{len(tie_rows)} expert choice{'s' if len(tie_rows) > 1 else ''} of "
                           f"{len(tie_rows)} token{'s' if len(tie_rows) > 1 else ''} a tie below bfloat16's rounding; "
                           f"the reference took ours")


# minimax_m3_vl_text's native file: faults that pass no tie (the router's choice wrong at most tokens, its weights
# dropped) and a norm dropped on this near-tie type; each must still fail its bfloat16 job
TIE_FAULTS = {
    "router logits negated": ("logits = self.gate(hidden_states)", "logits = -self.gate(hidden_states)"),
    "router logits permuted": ("logits = self.gate(hidden_states)",
                               "logits = self.gate(hidden_states).roll(1, dims=-1)"),
    "routing weights dropped": ("weights = scores.gather(1, expert_ids)",
                                "weights = torch.ones_like(scores.gather(1, expert_ids))"),
    "query norm dropped": ("query, key = self.q_norm(query), self.k_norm(key)", "key = self.k_norm(key)"),
    "shared experts dropped": ("shared = self.shared_experts(hidden_states)",
                               "shared = 0 * self.shared_experts(hidden_states)"),
}


@pytest.mark.slow
def test_a_near_tie_type_passes_its_bfloat16_job_by_the_tie_and_its_faults_fail(tmp_path):
    """minimax_m3_vl_text's defaults: its bfloat16 job passes with the tie taken (the verdict says so), and each
    fault fails it. Default-suite coverage of the path: the in-process tests above (routing_tie, rounding_reach, and
    RoutingTies steering transformers' references)."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.decide import render_native, selfcheck

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    config = AutoConfig.for_model("minimax_m3_vl_text").to_dict()     # no checkpoint shape recorded: the defaults
    good, bad = write_with_faults(render_native(ctx("minimax_m3_vl_text", "XForCausalLM"), derive(config)),
                                  TIE_FAULTS, TIE_FAULTS, tmp_path)
    jobs = [{"config": config, "file": str(path), "class_name": "XForCausalLM", "dtype": "bfloat16"}
            for path in (good, *bad)]
    results = selfcheck(jobs, SNAPSHOT)
    assert results[0]["ok"] and results[0]["routing_ties"] >= 1, results[0]
    assert "a tie below bfloat16's rounding; the reference took ours" in results[0]["note"], results[0]
    passed = [fault for fault, result in zip(TIE_FAULTS, results[1:]) if result["ok"]]
    assert not passed, [(fault, r) for fault, r in zip(TIE_FAULTS, results[1:])]


def test_the_decision_and_the_survey_row_say_the_ties_taken():
    """A passing job's note (its ties taken) reaches the native decision's summary and the survey's row; a failing
    job's does not (its reason says it)."""
    from agent.recipe.native.decide import NativeDecision, notes
    from agent.recipe.native.parts import Composition

    note = "1 expert choice of 1 token a tie below bfloat16's rounding; the reference took ours"
    labelled = [("the checkpoint's config", {}), ("the checkpoint's config in bfloat16", {}), ("a setting", {})]
    results = [{"ok": True}, {"ok": True, "note": note, "routing_ties": 1}, {"ok": False, "note": "x"}]
    said = notes(labelled, results)
    assert said == [f"the checkpoint's config in bfloat16: {note}"]
    summary = NativeDecision(True, Composition("t", {}), max_rel=1e-6, source="x", notes=tuple(said)).summary()
    assert summary["selfcheck_notes"] == said
    assert "selfcheck_notes" not in NativeDecision(True, Composition("t", {}), max_rel=1e-6, source="x").summary()
    row = {"type": "t", "config": "defaults", "result": "native", "max_rel": 1e-6, "moe": True, "notes": said}
    assert f"| t | defaults | native | moe | 1.0e-06 ({said[0]}) |" in native_coverage.markdown([row])
