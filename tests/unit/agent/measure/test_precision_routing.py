"""The precision verdict on a sparse-MoE model (agent.measure.precision: routing ties), in-process on
records written as the probe writes them. transformers' own float32 mixtral plays the recipe, its
routing steered (precision.Reference.run(..., forced)): a routing tie resolved the other way — what
another kernel's rounding does — moves later steps by a whole expert and must pass, the tie named;
the same exchange where the two experts are far apart, and a gating without its renormalisation,
are wrong routings and must fail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent.measure import precision

PROMPT = "An attention function can be described as mapping a query and a set of key-value pairs to an output"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints("mixtral", num_hidden_layers=4)      # a flip in an early layer reaches later ones


@pytest.fixture(scope="module")
def references(checkpoint):
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(checkpoint)(PROMPT).input_ids
    exact = precision.Reference(checkpoint, "float32", {}, False)
    rounded = precision.Reference(checkpoint, "bfloat16", {}, False)
    return {"prompt": prompt, "exact": exact, "rounded": rounded}


def generate(model: precision.Reference, prompt: list[int], forced=None, hooks=()) -> tuple[list[int], list]:
    """Greedy tokens and each step's last-position logits of `model`, every step a whole forward."""
    ids, logits = list(prompt), []
    handles = [register() for register in hooks]
    try:
        for _ in range(NEW_TOKENS):
            out = model.run(ids, forced)[0][-1]
            logits.append(out)
            ids.append(int(out.argmax()))
    finally:
        for handle in handles:
            handle.remove()
    return ids[len(prompt):], logits


def write_record(folder: Path, prompt: list[int], tokens: list[int], logits: list) -> Path:
    folder.mkdir(parents=True)
    calls = [{"phase": "prefill", "input_ids": torch.tensor(prompt), "shape": [len(prompt)], "rows": 1,
              "seq_ends": [len(prompt)], "attention_mask": None, "logits": logits[0][None], "layers": None,
              "dtype": "bfloat16"}]
    for k in range(1, len(tokens)):
        calls.append({"phase": "decode", "input_ids": torch.tensor([tokens[k - 1]]), "shape": [1], "rows": 1,
                      "seq_ends": None, "attention_mask": None, "logits": logits[k][None], "layers": None,
                      "dtype": "bfloat16"})
    for n, call in enumerate(calls):
        torch.save(call, folder / f"call_{n:05d}.pt")
    return folder.parent


def steered_run(references, tmp_path, pick) -> tuple[dict, tuple[int, int]]:
    """A record of the float32 model with one routing exchanged at the (layer, position) `pick(ties,
    routing)` chooses, and that pair."""
    prompt, exact, rounded = references["prompt"], references["exact"], references["rounded"]
    tokens, _ = generate(exact, prompt)
    sequence = prompt + tokens[:-1]
    _, _, fp_routing = exact.run(sequence)
    _, _, lo_routing = rounded.run(sequence)
    ties = precision.routing_ties(fp_routing, fp_routing, lo_routing, "bfloat16")
    layer, position = pick(ties, fp_routing, len(prompt))
    tokens, logits = generate(exact, prompt, forced={layer: {position}})
    return write_record(tmp_path / "rec" / "rank_0", prompt, tokens, logits), (layer, position)


def test_a_routing_tie_resolved_the_other_way_passes_and_is_named(references, checkpoint, tmp_path):
    exact, rounded, prompt = references["exact"], references["rounded"], references["prompt"]
    tokens, _ = generate(exact, prompt)
    sequence = prompt + tokens[:-1]
    fp, lo = exact.run(sequence)[0], rounded.run(sequence)[0]

    def beyond_rounding(logits) -> bool:
        """Some step's logits beyond the per-step tolerance: without the routing ties the check would fail."""
        steps = range(len(prompt) - 1, len(sequence))
        return any((logits[p] - fp[p]).abs().max().item() > precision.tolerance(
            (lo[p] - fp[p]).abs().max().item(), fp[p].abs().max().item(), "bfloat16") for p in steps)

    def tie_that_matters(ties, routing, prompt_len):
        for (layer, position), _ in sorted(ties.items(), key=lambda item: item[0][1]):
            if beyond_rounding(exact.run(sequence, {layer: {position}})[0]):
                return layer, position
        pytest.fail(f"no routing tie of this checkpoint moves the logits beyond rounding: {sorted(ties)}")

    record, (layer, position) = steered_run(references, tmp_path, tie_that_matters)
    result = precision.verify_record(record, checkpoint)
    assert result["ok"] is True, result
    assert {(t["layer"], t["position"]) for t in result["routing_ties"]} == {(layer, position)}, result
    assert result["routing_ties_taken"] == 1


def test_an_exchange_of_experts_far_apart_fails(references, checkpoint, tmp_path):
    def widest_gap(ties, routing, prompt_len):
        layer = min(routing)
        gaps = routing[layer]["gap"][prompt_len - 1:prompt_len + 2]       # the prefill's last position or just after
        return layer, prompt_len - 1 + int(gaps.argmax())

    record, (layer, position) = steered_run(references, tmp_path, widest_gap)
    result = precision.verify_record(record, checkpoint)
    assert result["ok"] is False, result
    assert not result["routing_ties"] or (layer, position) not in {(t["layer"], t["position"]) for t in result["routing_ties"]}


def test_a_gating_without_its_renormalisation_fails(references, checkpoint, tmp_path):
    """mixtral renormalises its top-2 softmax weights; a recipe that does not weighs every token's
    experts by less than 1 in all: every step moves, no routing tie explains it."""
    exact, prompt = references["exact"], references["prompt"]

    def unnormalised(index, block):
        def hook(module, args, kwargs):
            hidden, top_index, weights = args[:3]
            logits = torch.nn.functional.linear(hidden, block.gate.weight)
            probs = torch.softmax(logits.float(), dim=-1).gather(1, top_index.long())
            return (hidden, top_index, probs.to(weights.dtype), *args[3:]), kwargs
        return lambda: block.experts.register_forward_pre_hook(hook, with_kwargs=True)

    hooks = [unnormalised(i, block) for i, block in exact.routing.blocks]
    tokens, logits = generate(exact, prompt, hooks=hooks)
    record = write_record(tmp_path / "rec" / "rank_0", prompt, tokens, logits)
    result = precision.verify_record(record, checkpoint)
    assert result["ok"] is False and result["first_failing_step"] == "the prefill", result
