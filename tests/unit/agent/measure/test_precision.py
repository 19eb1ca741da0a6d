"""The precision verdict in-process (agent.measure.precision.verify_record), on records written as the
probe writes them: transformers' own bf16 model with its cache plays the recipe, then single steps are
broken. Both directions: an untouched record passes; a fault at one decode step fails naming that step;
an empty output, a token fed that is not the step's own, a log that says other text fail; a record
that lacks decode steps the log shows gives no verdict."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent.measure import precision

PROMPTS = ["An attention function can be described as mapping a query and a set of key-value pairs",
           "The capital of France is"]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints("llama")


def write_record(folder: Path, checkpoint: Path, prompts=PROMPTS, packed=True, steps=NEW_TOKENS, edit=None,
                 model_edit=None) -> dict:
    """A bf16 run of transformers' model on `prompts`, one call file per step (packed prefill as the
    executor's TND: one call, sequence ends); `edit(k, logits)` may change step k's logits before the
    token is picked, `model_edit(model)` the model before it runs. Returns {request: tokens}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    if model_edit is not None:
        model_edit(model)
    folder = folder / "rank_0"
    folder.mkdir(parents=True)
    calls = []
    rows = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model(ids, use_cache=True)
        rows.append({"ids": ids[0], "cache": out.past_key_values, "logits": out.logits[0, -1].float(), "tokens": []})
    ends = torch.tensor([len(r["ids"]) for r in rows]).cumsum(0).tolist()
    prefill = torch.stack([r["logits"] for r in rows])
    if edit:
        prefill = edit(0, prefill)
    calls.append({"phase": "prefill", "input_ids": torch.cat([r["ids"] for r in rows]), "shape": [ends[-1]],
                  "rows": len(rows), "seq_ends": ends if packed else None, "attention_mask": None,
                  "logits": prefill, "layers": None, "dtype": "bfloat16"})
    for r, logits in zip(rows, prefill):
        r["tokens"].append(int(logits.argmax()))
    for k in range(1, steps):
        step_logits = []
        for r in rows:
            with torch.no_grad():
                out = model(torch.tensor([[r["tokens"][-1]]]), past_key_values=r["cache"], use_cache=True)
            r["cache"] = out.past_key_values
            step_logits.append(out.logits[0, -1].float())
        logits = torch.stack(step_logits)
        if edit:
            logits = edit(k, logits)
        calls.append({"phase": "decode", "input_ids": torch.tensor([r["tokens"][-1] for r in rows]), "shape": [len(rows)],
                      "rows": len(rows), "seq_ends": None, "attention_mask": None, "logits": logits,
                      "layers": None, "dtype": "bfloat16"})
        for r, row in zip(rows, logits):
            r["tokens"].append(int(row.argmax()))
    for n, call in enumerate(calls):
        torch.save(call, folder / f"call_{n:05d}.pt")
    return {i: r["tokens"] for i, r in enumerate(rows)}


def write_log(folder: Path, checkpoint: Path, tokens: dict, change=None) -> Path:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    lines = [f"Request {i}: outputs: {change(tokenizer.decode(t, skip_special_tokens=True)) if change else tokenizer.decode(t, skip_special_tokens=True)}"
             for i, t in tokens.items()]
    (folder / "logs").mkdir(parents=True)
    (folder / "logs" / "log_0.log").write_text("\n".join(lines) + "\n")
    return folder / "logs"


def test_an_untouched_record_passes_every_step(tmp_path, checkpoint):
    tokens = write_record(tmp_path / "rec", checkpoint)
    result = precision.verify_record(tmp_path / "rec", checkpoint, log_dir=write_log(tmp_path, checkpoint, tokens))
    assert result["ok"] is True and result["checked"] is True, result
    assert result["requests"] == 2 and result["steps_checked"] == 2 * NEW_TOKENS
    assert result["decode_steps_checked"] == 2 * (NEW_TOKENS - 1) and result["closest"]["ratio"] <= 1
    assert {r["prompt_tokens"] for r in result["per_request"]} == {5, 17} or len({r["prompt_tokens"] for r in result["per_request"]}) == 2


@pytest.mark.parametrize("step,row,shift", [(3, 0, 3.0), (1, 1, 2.0), (NEW_TOKENS - 1, 0, -3.0)])
def test_one_decode_steps_logits_moved_fail_at_that_step(tmp_path, checkpoint, step, row, shift):
    def edit(k, logits):
        if k == step:
            logits = logits.clone()
            logits[row, 7] += shift            # one logit off by ~10x bf16 rounding here (its logits reach ~30)
        return logits

    write_record(tmp_path / "rec", checkpoint, edit=edit)
    result = precision.verify_record(tmp_path / "rec", checkpoint)
    assert result["ok"] is False, result
    assert result["first_failure"]["request"] == row and result["first_failure"]["step"] == step
    assert result["first_failing_step"] == f"decode step {step}"
    assert f"decode step {step} (rank 0, request {row})" in result["reason"]


def test_a_token_that_is_not_the_references_argmax_fails(tmp_path, checkpoint):
    def edit(k, logits):
        if k == 2:
            logits = logits.clone()
            far = logits[0].topk(20).indices[-1]
            logits[0, far] = logits[0].max() + 0.01       # picks the 20th token, logits otherwise untouched
        return logits

    write_record(tmp_path / "rec", checkpoint, edit=edit)
    result = precision.verify_record(tmp_path / "rec", checkpoint)
    assert result["ok"] is False and result["first_failure"]["step"] == 2, result


def silent_checkpoint(checkpoint: Path, into: Path) -> Path:
    """The checkpoint with its final norm zeroed: every logit 0 at every step, so the greedy pick is token 0,
    the tokenizer's <|pad|> (a special token): untrained weights whose text decodes to nothing."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, into)
    weights = load_file(into / "model.safetensors")
    weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
    save_file(weights, into / "model.safetensors", metadata={"format": "pt"})
    return into


def test_an_empty_output_passes_where_transformers_writes_nothing_too(tmp_path, checkpoint):
    """The decided case (issue 41): every step within tolerance, greedy tokens all special (text empty), and
    transformers' own greedy tokens on the same prompt decode to empty text too: the model writes nothing,
    the verdict is ok and says so in one line."""
    silent = silent_checkpoint(checkpoint, tmp_path / "silent")
    tokens = write_record(tmp_path / "rec", silent)
    assert set(tokens[0]) == {0}                               # <|pad|> at every step
    result = precision.verify_record(tmp_path / "rec", silent, log_dir=write_log(tmp_path, silent, tokens))
    assert result["ok"] is True and result["checked"] is True, result
    assert all(r["empty"] and r["reference_text"] == "" for r in result["per_request"])
    assert result["empty_output"].startswith("the model itself writes nothing here (rank 0 request 0, rank 0 request 1)")
    assert "\n" not in result["empty_output"]


class Crafted:
    """Logits playing transformers' at every position of a sequence (no layers, no routing)."""

    def __init__(self, logits):
        self.logits = logits

    def run(self, sequence, forced=None):
        return self.logits[:len(sequence)], [], None


def test_an_empty_output_fails_where_transformers_writes_text(checkpoint):
    """The other side: every step within tolerance, the recipe's text empty, transformers' own greedy text on
    the same prompt not. transformers' float32 logits put a word first and <|pad|> a tie behind it (within the
    step's tolerance); the recipe picks <|pad|> at every step: each step passes as a tie, and the empty text
    fails, naming transformers' text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    word, pad = tokenizer("output", add_special_tokens=False).input_ids[0], tokenizer.pad_token_id
    prompt, steps = [10, 11, 12], 4
    torch.manual_seed(0)
    reference = torch.randn(len(prompt) + steps, len(tokenizer))
    reference[:, word] = reference.max() + 1.0
    reference[:, pad] = reference[:, word] - 1e-3              # a tie: below the floor (1e-3 x max |logit|)
    request = precision.Request(0, 0, prompt)
    for k in range(steps):
        mine = reference[len(prompt) - 1 + k].clone()
        mine[pad] = mine[word] + 1e-4                          # the recipe's kernels round it the other way
        request.steps.append(precision.Step("prefill" if k == 0 else "decode", mine, None,
                                            fed=pad if k < steps - 1 else None))

    def decode(tokens):
        return tokenizer.decode(tokens, skip_special_tokens=True)

    judged = precision.judge_request(request, Crafted(reference), Crafted(reference), "bfloat16", decode)
    assert all(step["token_ok"] and step["logits_ok"] for step in judged["steps"]), judged["steps"]
    assert judged["first_failure"] is None and judged["empty"] and judged["ok"] is False, judged
    assert judged["reference_text"].strip() == decode([word] * steps).strip() != ""
    reason = precision.failure_reason(judged, "bfloat16")
    assert reason.startswith("the recipe's output is empty (rank 0, request 0), though transformers' own greedy text")


def test_a_model_without_a_kv_cache_is_judged_per_step(tmp_path, checkpoint):
    """OpenAI GPT keeps no cache: each decode step runs the whole sequence again, which the probe records as
    a prefill of one token more. Those calls are the request's decode steps, each with the token it fed
    (was: only the first step seen, "the record lacks decode steps": no verdict)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids[0].tolist()
    folder = tmp_path / "rec" / "rank_0"
    folder.mkdir(parents=True)
    tokens = []
    for k in range(NEW_TOKENS):
        sequence = ids + tokens
        with torch.no_grad():
            logits = model(torch.tensor([sequence]), use_cache=False).logits[0, -1:].float()
        torch.save({"phase": "prefill", "input_ids": torch.tensor(sequence), "shape": [1, len(sequence)], "rows": 1,
                    "seq_ends": None, "attention_mask": None, "logits": logits, "layers": None, "dtype": "bfloat16"},
                   folder / f"call_{k:05d}.pt")
        tokens.append(int(logits[0].argmax()))
    requests, problems = precision.requests_of(precision.load_calls(folder), 0, set())
    assert not problems and len(requests) == 1 and requests[0].tokens == tokens
    assert [step.phase for step in requests[0].steps] == ["prefill"] + ["decode"] * (NEW_TOKENS - 1)
    assert [step.fed for step in requests[0].steps[:-1]] == tokens[:-1]
    result = precision.verify_record(tmp_path / "rec", checkpoint,
                                     log_dir=write_log(tmp_path, checkpoint, {0: tokens}))
    assert result["ok"] is True and result["decode_steps_checked"] == NEW_TOKENS - 1, result


def test_a_log_that_says_other_text_fails_and_one_that_says_more_gives_no_verdict(tmp_path, checkpoint):
    tokens = write_record(tmp_path / "rec", checkpoint)
    other = precision.verify_record(tmp_path / "rec", checkpoint,
                                    log_dir=write_log(tmp_path / "a", checkpoint, tokens, lambda t: "x" + t))
    assert other["ok"] is False and "is not the text of the tokens" in other["reason"]
    more = precision.verify_record(tmp_path / "rec", checkpoint,
                                   log_dir=write_log(tmp_path / "b", checkpoint, tokens, lambda t: t + " and more"))
    assert more["ok"] is None and "lacks decode steps" in more["reason"]


def test_decode_rows_follow_the_unfinished_requests_of_a_packed_prefill(tmp_path, checkpoint):
    write_record(tmp_path / "rec", checkpoint)
    calls = precision.load_calls(tmp_path / "rec" / "rank_0")
    requests, problems = precision.requests_of(calls, 0, set())
    assert not problems and [len(r.steps) for r in requests] == [NEW_TOKENS, NEW_TOKENS]
    assert [r.prompt for r in requests] == [calls[0]["input_ids"][:calls[0]["seq_ends"][0]].tolist(),
                                            calls[0]["input_ids"][calls[0]["seq_ends"][0]:].tolist()]
    # every decode step fed the token the step before it picked
    assert all(step.fed == token for r in requests for step, token in zip(r.steps[:-1], r.tokens))


@pytest.mark.parametrize("layout", ["kept", "dropped", "kept, padded", "dropped, padded"])
def test_decode_rows_after_a_request_ends_at_eos(layout):
    """Request 0 picks EOS at decode step 1. upstream's executor keeps its row in the batch (fed on), another
    drops it, either may pad the batch with a row past the requests: every way request 1's steps are its own
    rows, and request 0 has none past its EOS."""
    import torch

    eos, vocab = 2, 8

    def logits(*tokens):
        return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()

    calls = [{"phase": "prefill", "input_ids": torch.tensor([5, 6, 7, 5, 6]), "shape": [5], "rows": 2,
              "seq_ends": [3, 5], "logits": logits(3, 4)},
             {"phase": "decode", "input_ids": torch.tensor([3, 4]), "rows": 2, "logits": logits(eos, 5)}]
    keeps_finished_rows, padded = layout.startswith("kept"), layout.endswith("padded")
    for fed in ((eos, 5), (eos, 6)):      # request 1 picks 6, then 7; request 0's row (if kept) picks 1
        kept = fed if keeps_finished_rows else fed[1:]
        picked = (1, fed[1] + 1) if keeps_finished_rows else (fed[1] + 1,)
        if padded:                        # a pad row fed 0, which picks 0
            kept, picked = (*kept, 0), (*picked, 0)
        calls.append({"phase": "decode", "input_ids": torch.tensor(kept), "rows": len(kept), "logits": logits(*picked)})
    requests, problems = precision.requests_of(calls, 0, {eos})
    assert not problems
    assert [r.tokens for r in requests] == [[3, eos], [4, 5, 6, 7]]
    assert [step.fed for step in requests[1].steps[:-1]] == [4, 5, 6]


def test_a_data_parallel_ranks_one_request_ended_at_eos_decodes_on_without_steps():
    """Attention DP: a rank's only request picks EOS at decode step 1 while the other DP group's goes on; upstream's
    offline scheduler runs every rank max_new_tokens decode steps all the same (scheduler._should_finish: the
    other ranks' MoE collectives keep their partner), its row fed on. Those rows are no steps of the request,
    and no problem; a row fed another token before the EOS still is the request's."""
    import torch

    eos, vocab = 2, 8

    def logits(*tokens):
        return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()

    calls = [{"phase": "prefill", "input_ids": torch.tensor([5, 6, 7]), "shape": [3], "rows": 1, "seq_ends": [3],
              "logits": logits(3)},
             {"phase": "decode", "input_ids": torch.tensor([3]), "rows": 1, "logits": logits(eos)}]
    calls += [{"phase": "decode", "input_ids": torch.tensor([fed]), "rows": 1, "logits": logits(1)} for fed in (eos, 1, 1)]
    requests, problems = precision.requests_of(calls, 0, {eos})
    assert not problems and [r.tokens for r in requests] == [[3, eos]] and requests[0].finished
    # the same record with no EOS in the run's set: every row is the request's step
    requests, problems = precision.requests_of(calls, 0, set())
    assert not problems and [r.tokens for r in requests] == [[3, eos, 1, 1, 1]]


def test_no_record_is_no_pass(tmp_path, checkpoint):
    (tmp_path / "rec").mkdir()
    result = precision.verify_record(tmp_path / "rec", checkpoint)
    assert result["ok"] is False and result["checked"] is False
    assert result["reason"].startswith("the probe saw no model call: the run's precision record")


@pytest.mark.parametrize("made", ["missing", "empty", "ranks without calls"])
def test_a_record_the_probe_did_not_write_is_a_verdict_not_a_crash(tmp_path, checkpoint, made):
    """Three old-style causal LMs (GPT2LMHeadModel, CTRLLMHeadModel, OpenAIGPTLMHeadModel) ran unseen by the
    probe: no precision folder, and the check crashed starting its child there (exit 70). A record the probe
    did not write is the check's verdict, and no child is started for it."""
    record = tmp_path / "run" / "precision"
    if made != "missing":
        record.mkdir(parents=True)
    if made == "ranks without calls":
        (record / "rank_0").mkdir()
    result = precision.check(record, checkpoint, timeout=5)
    assert result["ok"] is False and result["checked"] is False, result
    assert result["reason"].startswith("the probe saw no model call: the run's precision record")
    assert ("was not written" if made == "missing" else "is empty") in result["reason"]


@pytest.mark.parametrize("name, is_lm", [("GPT2LMHeadModel", True), ("CTRLLMHeadModel", True),
                                          ("OpenAIGPTLMHeadModel", True), ("LlamaForCausalLM", True),
                                          ("XLMWithLMHeadModel", True), ("GPT2Model", False), ("LlamaModel", False),
                                          ("models.gpt2.modeling_gpt2.GPT2Block", False)])
def test_the_probe_knows_old_and_new_causal_lm_classes(name, is_lm):
    import importlib

    from agent.measure.precision_probe import is_language_model

    module, _, cls = f"transformers.{name}".rpartition(".")
    assert is_language_model(getattr(importlib.import_module(module), cls)) is is_lm


def test_the_probe_knows_a_generating_class_of_any_name():
    """A class transformers generates with, named otherwise (a remote-code or vendored model)."""
    import transformers

    from agent.measure.precision_probe import is_language_model

    class Decoder(transformers.PreTrainedModel, transformers.GenerationMixin):
        pass

    class Plain(torch.nn.Module):
        pass

    assert is_language_model(Decoder) and not is_language_model(Plain)


# ---- N ranks: the rounding of their row-parallel reductions ------------------------------------------
def test_row_parallel_split_is_the_same_sum_in_float32_and_another_rounding_in_bf16(checkpoint):
    """transformers' model with its row-parallel projections (o_proj, down_proj: its tp_plan's rowwise) as two
    partial sums: the same arithmetic in float32, other roundings in bf16."""
    ids = list(range(5, 40))
    for dtype, same in (("float32", True), ("bfloat16", False)):
        reference = precision.Reference(checkpoint, dtype, {}, False)
        whole = reference.run(ids)[0]
        layers = len(reference.layers)
        assert len(reference.split_row_parallel(2)) == 2 * layers
        split = reference.run(ids)[0]
        if same:
            torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
        else:
            assert not torch.equal(split, whole)
        reference.release()


def test_a_reduction_reference_widens_a_steps_tolerance_to_its_own_move():
    """A step whose error is within 2 x the reduced model's move but beyond 2 x the plain run dtype's passes
    only when the run had N ranks (the reduced reference given); an error beyond both fails either way."""
    vocab = 6
    fp = torch.zeros(1, vocab)
    fp[0, 0] = 10.0
    lo, reduced = fp.clone(), fp.clone()
    lo[0, 1] += 0.05          # plain bf16 move 0.05: tolerance 0.1
    reduced[0, 1] += 0.08     # with the reductions 0.08: tolerance 0.16

    def judged(error, with_reduced):
        mine = fp[0].clone()
        mine[2] += error
        request = precision.Request(0, 0, [7], [precision.Step("prefill", mine, None)])
        steps, first = precision.judge_steps(request, fp, None, lo, None, "bfloat16",
                                             (reduced, None) if with_reduced else None)
        return first is None, steps[0]["tolerance"]

    assert judged(0.13, with_reduced=False) == (False, 0.1)
    assert judged(0.13, with_reduced=True) == (True, 0.16)
    assert judged(0.2, with_reduced=True) == (False, 0.16)


def test_a_compiled_decode_step_is_allowed_one_rounding_of_its_largest_logit_and_no_more():
    """A decode step that ran compiled (no layer hook saw it, where they saw the eager prefill) may differ by one
    bf16 unit in the last place at its largest float32 |logit| (10.0: 2 ** (3 - 7) = 0.0625) beyond its tolerance
    (0.1 here); the same error at an eager step (layers recorded), or a compiled step's error beyond that unit
    (a fault), fails."""
    vocab = 6
    fp = torch.zeros(2, vocab)
    fp[:, 0] = 10.0
    lo = fp.clone()
    lo[:, 1] += 0.05          # plain bf16 move 0.05: tolerance 0.1
    layers = [torch.zeros(1, 4)]

    def judged(error, compiled):
        mine = fp[1].clone()
        mine[2] += error
        prefill = precision.Step("prefill", fp[0].clone(), layers)
        request = precision.Request(0, 0, [7], [prefill, precision.Step("decode", mine, None if compiled else layers)])
        hidden = [torch.zeros(2, 4)]
        steps, first = precision.judge_steps(request, fp, hidden, lo, hidden, "bfloat16")
        return first is None, steps[1]["tolerance"], steps[1].get("compiled", False)

    assert precision.compiled_step_allowance(10.0, "bfloat16") == 0.0625
    assert precision.compiled_step_allowance(10.0, "float32") == 2.0 ** -20
    assert judged(0.15, compiled=True) == (True, 0.1625, True)
    assert judged(0.15, compiled=False) == (False, 0.1, False)
    assert judged(0.17, compiled=True) == (False, 0.1625, True)
    # a record without layers anywhere (the probe kept none at the prefill either) says nothing of compiling
    request = precision.Request(0, 0, [7], [precision.Step("prefill", fp[0].clone(), None),
                                            precision.Step("decode", fp[1].clone(), None)])
    assert not precision.compiled_step(request, request.steps[1])


def test_a_record_of_two_ranks_is_judged_with_the_row_parallel_reference(tmp_path, checkpoint):
    """Two ranks' records (tensor parallel: the same requests on each): the verdict names the second reference
    and the projections it split; the run's own tensor-parallel size of 1 (data parallel) splits none."""
    import shutil

    write_record(tmp_path / "rec", checkpoint)
    shutil.copytree(tmp_path / "rec" / "rank_0", tmp_path / "rec" / "rank_1")
    result = precision.verify_record(tmp_path / "rec", checkpoint)
    assert result["ok"] is True and result["ranks"] == 2, result
    split = result["row_parallel_split"]
    assert split["parts"] == 2 and split["count"] == 4, split          # 2 layers: o_proj, down_proj
    assert result["reference_dtypes"][-1] == "bfloat16, 4 row-parallel projections as 2 partial sums"
    alone = precision.verify_record(tmp_path / "rec", checkpoint, tensor_parallel=1)
    assert "row_parallel_split" not in alone and len(alone["reference_dtypes"]) == 2, alone


# ---- E expert-parallel ranks: each token's expert outputs summed per rank, the ranks' partials added --------
@pytest.fixture(scope="module")
def moe_checkpoint(tiny_checkpoints):
    """Top-4 of 8 experts: with 2 EP ranks a token's outputs on one rank are summed apart from the other's (a top-2
    model's two outputs are added once whichever way: the split changes nothing there)."""
    return tiny_checkpoints("qwen3_moe", num_experts=8, num_experts_per_tok=4)


def test_expert_parallel_split_is_the_same_sum_in_float32_and_another_rounding_in_bf16(moe_checkpoint):
    """transformers' MoE blocks with their experts as two per-rank partial sums (experts [0, L) and [L, 2L)): the
    same arithmetic in float32, other roundings in bf16; a model without sparse-MoE blocks splits nothing."""
    ids = list(range(5, 40))
    for dtype, same in (("float32", True), ("bfloat16", False)):
        reference = precision.Reference(moe_checkpoint, dtype, {}, False)
        whole = reference.run(ids)[0]
        assert len(reference.split_expert_parallel(2)) == len(reference.layers)
        split = reference.run(ids)[0]
        if same:
            torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
        else:
            assert not torch.equal(split, whole)
        reference.release()


def test_a_dense_model_has_no_expert_parallel_split(checkpoint):
    reference = precision.Reference(checkpoint, "bfloat16", {}, False)
    assert reference.split_expert_parallel(2) == []
    reference.release()


def _experts_routed_to_the_next_rank(model, parts: int = 2):
    """Every MoE block's experts as a wrong expert-parallel routing computes them: expert e's tokens run on the next
    rank's expert of the same local slot (e + L mod E)."""
    from agent.recipe.native.parts.moe import moe_block

    for layer in model.model.layers:
        experts = moe_block(layer)[1].experts
        count = experts.gate_up_proj.shape[0]
        whole = experts.forward

        def forward(hidden, index, weights, whole=whole, count=count):
            return whole(hidden, (index + count // parts) % count, weights)

        experts.forward = forward


def test_a_record_with_expert_parallel_is_judged_with_the_expert_parallel_reference(tmp_path, moe_checkpoint):
    """Two ranks of one EP group (the same requests on each): the verdict names the expert-parallel reference and
    the blocks it split; the run's expert-parallel size of 1 (or none said: a 1-rank run) splits none and is judged as before; with TP 2 too,
    one reference names both splits."""
    import shutil

    write_record(tmp_path / "rec", moe_checkpoint)
    shutil.copytree(tmp_path / "rec" / "rank_0", tmp_path / "rec" / "rank_1")
    result = precision.verify_record(tmp_path / "rec", moe_checkpoint, tensor_parallel=1, expert_parallel=2)
    assert result["ok"] is True and result["ranks"] == 2, result
    split = result["expert_parallel_split"]
    assert split["parts"] == 2 and split["count"] == 2, split                # 2 layers, both sparse
    assert result["reference_dtypes"][-1] == "bfloat16, 2 MoE blocks' experts as 2 expert-parallel partial sums"
    assert "row_parallel_split" not in result
    plain = precision.verify_record(tmp_path / "rec", moe_checkpoint, tensor_parallel=1)
    assert "expert_parallel_split" not in plain and len(plain["reference_dtypes"]) == 2, plain
    assert plain == precision.verify_record(tmp_path / "rec", moe_checkpoint, tensor_parallel=1, expert_parallel=1)
    both = precision.verify_record(tmp_path / "rec", moe_checkpoint, tensor_parallel=2, expert_parallel=2)
    assert both["reference_dtypes"][-1] == ("bfloat16, 2 row-parallel projections as 2 partial sums, 2 MoE blocks' "
                                            "experts as 2 expert-parallel partial sums"), both


def test_expert_parallel_widens_the_step_tolerance_to_its_own_move_and_no_further(moe_checkpoint):
    """Per step: the tolerance with the expert-parallel reference is 2 x the larger of its move and the plain bf16
    move (never below the plain one); a recipe whose experts are summed per rank in bf16 passes with it, and a wrong
    routing (each expert's tokens on the next rank's expert) fails with it, at the prefill."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(moe_checkpoint)
    prompt = tokenizer(PROMPTS[0]).input_ids
    exact = precision.Reference(moe_checkpoint, "float32", {}, False)
    fp = exact.run(prompt)
    exact.release()
    model = precision.Reference(moe_checkpoint, "bfloat16", {}, False)
    lo = model.run(prompt)
    model.split_expert_parallel(2)
    reduced = model.run(prompt)
    model.release()
    wrong = precision.Reference(moe_checkpoint, "bfloat16", {}, False)
    _experts_routed_to_the_next_rank(wrong.model)
    misrouted = wrong.run(prompt)
    wrong.release()

    def judged(logits, with_reduced):
        request = precision.Request(0, 0, prompt, [precision.Step("prefill", logits[len(prompt) - 1], None)])
        steps, first = precision.judge_steps(request, fp[0], fp[1], lo[0], lo[1], "bfloat16",
                                             reduced[:2] if with_reduced else None)
        return steps[0], first

    with_ep, _ = judged(reduced[0], True)
    without, _ = judged(reduced[0], False)
    assert with_ep["tolerance"] >= without["tolerance"] and with_ep["ok"], (with_ep, without)
    assert with_ep["reference_own_move"] == round(max((lo[0][-1] - fp[0][-1]).abs().max().item(),
                                                      (reduced[0][-1] - fp[0][-1]).abs().max().item()), 6)
    fault, first = judged(misrouted[0], True)
    assert not fault["ok"] and first is fault and fault["max_abs_logits_diff"] > 3 * fault["tolerance"], fault
