"""A check that gave no verdict (ok: null) is never invisible: agent.measure.verify.not_checked names it with
why, the verify node puts that on the run's final `ok:` line (its message), and the run summary
(migration_summary.md) has a line per check. The end-to-end case (a code check whose temporary copy another
process emptied, in a real `migrator run`): tests/e2e/test_check_reasons.py."""

from __future__ import annotations

import copy

import pytest

from agent.measure import verify
from agent.measure.baseline import with_verification
from agent.workflow.report import human_summary

PRECISION_OK = {"ok": True, "checked": True, "method": "precision, per step, teacher-forced", "steps_checked": 32,
                "decode_steps_checked": 31, "requests": 1, "ranks": 1, "dtype": "float32"}
CODE_NOT_RUN = {"ok": None, "checked": False,
                "reason": "did not run: its temporary copy of the checkpoint lost tokenizer.json while loading the "
                          "recipe's model and tokenizer from the shrunk copy (another process removed them; run it "
                          "again): ValueError: Couldn't instantiate the backend tokenizer"}


def baseline(parity: dict | None, output_check: dict | None = None) -> dict:
    return {"verification": {"all_ranks_success": True, "parity": parity,
                             "output_check": output_check or {"ok": True, "reasons": []}},
            "performance": {"output_text": "x"}}


def test_a_code_check_that_did_not_run_is_named_with_its_reason():
    found = verify.not_checked(baseline(dict(PRECISION_OK, code=CODE_NOT_RUN)))
    assert found == [f"{verify.CODE_CHECK}: {CODE_NOT_RUN['reason']}"]
    assert verify.problems(baseline(dict(PRECISION_OK, code=CODE_NOT_RUN))) == []     # not a failure: a gap


@pytest.mark.parametrize("parity, output_check, expected", [
    (dict(PRECISION_OK, code={"ok": True, "checked": True}), None, []),
    ({"ok": None, "checked": False, "method": "precision, per step, teacher-forced",
      "reason": "the record lacks decode steps of rank 0 request 0 (a compiled decode step runs no hooks): not checked"},
     None, ["precision, per step, teacher-forced: the record lacks decode steps of rank 0 request 0 (a compiled "
            "decode step runs no hooks): not checked"]),
    # the text not judged (untrained weights) while every step passed: no gap
    (PRECISION_OK, {"ok": None, "skipped": "untrained weights: text checks skipped, parity used"}, []),
    # the text not judged and no precision verdict either: named
    ({"ok": None, "checked": False, "reason": "original implementation is remote code; pass --trust-remote-code"},
     {"ok": None, "skipped": "untrained weights: text checks skipped"},
     ["the precision check: original implementation is remote code; pass --trust-remote-code",
      "the output text: untrained weights: text checks skipped"]),
])
def test_which_checks_count_as_not_checked(parity, output_check, expected):
    assert verify.not_checked(baseline(parity, output_check)) == expected


def test_the_summary_has_a_line_per_check_and_says_why_one_did_not_run():
    report = {"status": "ok", "message": "not checked: " + "; ".join(verify.not_checked(
        baseline(dict(PRECISION_OK, code=CODE_NOT_RUN)))), "scenario": "A",
              "verification": baseline(dict(PRECISION_OK, code=CODE_NOT_RUN))["verification"]}
    text = human_summary(report, "demo")
    assert f"- status: **ok** not checked: {verify.CODE_CHECK}: did not run: its temporary copy" in text
    assert f"- {verify.CODE_CHECK}: not checked: did not run: its temporary copy of the checkpoint lost" in text
    assert "- output text check: ok" in text
    ran = human_summary({"verification": baseline(dict(PRECISION_OK, code={
        "ok": True, "checked": True, "max_abs_logits_diff": 0.0, "tolerance": 1e-4, "greedy_tokens_equal": True}))[
        "verification"]}, "demo")
    assert f"- {verify.CODE_CHECK}: ok (max |dlogits| 0.0, tolerance 0.0001; greedy tokens equal: True)" in ran


def test_empty_output_of_a_silent_model_is_said_once_and_the_text_check_stands_down():
    """The model writes nothing (transformers' own greedy text is empty too): the output check's "empty text"
    is no failure, and the summary says why in one line. Where the precision check has no such line, an
    empty text still fails."""
    silent = dict(PRECISION_OK, empty_output="the model itself writes nothing here (rank 0 request 0): …")
    empty_text = {"ok": False, "reasons": ["empty text"], "chars": 0}
    checked = with_verification(baseline(None, copy.deepcopy(empty_text)), silent)
    assert checked["verification"]["output_check"]["ok"] is None
    assert checked["verification"]["output_check"]["skipped"] == silent["empty_output"]
    assert verify.problems(checked) == [] and verify.not_checked(checked) == []
    text = human_summary({"status": "ok", "verification": checked["verification"]}, "demo")
    assert "- output: empty — the model itself writes nothing here" in text
    failed = with_verification(baseline(None, copy.deepcopy(empty_text)), PRECISION_OK)
    assert verify.problems(failed) == ["abnormal output text: empty text"]


@pytest.mark.parametrize("parallel,expected", [
    ({"world_size": 2, "attn_tp_size": 2, "moe_tp_size": 1}, 2),          # attn4tp8dp at 2 ranks: EP 2
    ({"world_size": 4, "attn_tp_size": 1, "moe_tp_size": 2}, 2),          # TP 2 x EP 2
    ({"world_size": 16, "moe_tp_size": 16}, 1),                           # 16tp: MoE TP, no EP
    ({"world_size": 2, "moe_tp_size": 1, "moe_ep_size": 7}, 2),           # upstream derives it, whatever is stated
    ({"moe_ep_size": 4}, 4),                                              # stated alone
    ({"world_size": 3, "moe_tp_size": 2}, None),                          # not a layout upstream accepts
    ({"world_size": True, "moe_tp_size": 1}, None),
    ({"attn_tp_size": 2}, None),                                          # says nothing of the MoE: 1-rank rule
])
def test_expert_parallel_size_is_upstreams_derivation(parallel, expected):
    """moe_ep_size = world_size // moe_tp_size (upstream's ParallelConfig), the precision check's EP reference."""
    assert verify.expert_parallel_of(parallel) == expected
