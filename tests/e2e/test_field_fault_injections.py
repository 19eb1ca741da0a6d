"""Every entry of the field corpus (tests/field_faults/corpus.yaml) injected into a real recipe (ours, and the
upstream cann-recipes-infer layout for many): `migrator run RECIPE --json` for real with a relative path
repairs it (or gives the exact report-only diagnosis, the out-of-memory path, exit 4, the unknown-failure
diagnosis), and `migrator rollback` returns the injected bytes (tests/support/field_injections.py says how
each is injected: real, or replayed where this host cannot have the failure). Most are slow (`-m ''`): `make
test` keeps one per rule, a dozen at most."""

from __future__ import annotations

import re

import pytest

from migrator_cli import assert_round_backup
from npu_wheel import torch_npu_wheel
from field_injections import Injection, cases, run_injection


ERROR_LINE = re.compile(r"^\s*(\w*(?:Error|Exception)): .+$", re.M)


# ---- fault injection: every corpus entry, for real (tests/support/field_injections.py) ---------------
def _case(injection: Injection, layout: str):
    fast = injection.fast if layout == "ours" else injection.fast_upstream
    return pytest.param(injection, layout, id=injection.test_id(layout), marks=[] if fast else [pytest.mark.slow])


@pytest.mark.parametrize("injection, layout", [_case(i, layout) for i, layout in cases()])
def test_injected_field_fault(injection, layout, working_recipe_source, tmp_path):
    """The fault as the report shows it, in a working recipe; `migrator run REL --json` with a relative
    path, from the recipe's parent (ours) or the repository root (upstream); the outcome the corpus
    names; and `migrator rollback REL` (relative too) gives back the injected bytes and modes."""
    if injection.needs_torch_npu and torch_npu_wheel()[0] is None:
        pytest.skip(torch_npu_wheel()[1])
    result = run_injection(injection, layout, tmp_path, working_recipe_source)
    first, diagnosis = result["first"], result["diagnosis"]
    expected = injection.expected(layout)
    context = (result["summary"], diagnosis, result["stderr"])
    assert result["outcome"] == expected, context
    runner = next(result["recipe"].glob("runner_*.py")).name
    assert result["rules"] == injection.rules(layout), context          # the rule of each round
    if expected == "repaired":
        assert result["returncode"] == 0 and result["summary"]["status"] == "ok", context
        assert first["applied"] and first["diff"] and result["rounds"] == 1
        assert_round_backup(result["recipe"], first, {rel: c for rel, (c, _) in result["injected"].items()})
        assert result["rollback"] == "restored"
    elif expected == "reported":
        last = result["last"]
        assert result["returncode"] == 1 and result["summary"]["status"] == "failed", context
        assert not last["applied"] and not last["diff"]
        assert all(r["applied"] for r in result["round_records"][:-1])  # earlier rounds fixed something
        note = injection.expected_note(layout).replace("{runner}", runner)
        assert note in last["note"], last["note"]
        assert last["note"] in result["summary"]["message"]
        for rnd in result["round_records"][:1]:
            if rnd.get("applied"):
                assert_round_backup(result["recipe"], rnd, {rel: c for rel, (c, _) in result["injected"].items()})
        assert result["rollback"] == "restored"
    elif expected == "oom":        # the out-of-memory path: the memory estimate, exit 6, nothing edited
        assert result["returncode"] == 6 and result["summary"]["status"] == "oom", context
        assert diagnosis["rule"] == "out_of_memory" and diagnosis["oom"] is True
        assert "applied" not in first and result["rounds"] == 1
        assert result["summary"]["message"].startswith("out of memory: needs about "), result["summary"]
        assert result["rollback"] == "untouched"
    elif expected == "exit4":      # the kernel check: exit 4 before any run, nothing written
        kernel = re.search(r"torch_npu\.(\w+)\(", result["injected"][runner][0].decode()).group(1)
        line = next(n for n, text in enumerate(result["injected"][runner][0].decode().splitlines(), 1)
                    if f"torch_npu.{kernel}(" in text)
        assert result["returncode"] == 4, context
        assert (f"needs an Ascend NPU: 1 torch_npu kernel ({kernel}) at 1 call site; first call: {kernel} at "
                f"{runner}:{line}; run on an NPU host" in result["stderr"]), result["stderr"]
        assert not (result["recipe"] / ".migrator").exists() and result["rollback"] == "untouched"
    else:                          # unknown: no rule, but the diagnosis says what is known
        entry = injection.entry
        exception, _, message = [m.group(0).strip() for m in ERROR_LINE.finditer(entry["log"])][-1].partition(": ")
        assert result["returncode"] == 1 and diagnosis["rule"] is None, context
        assert diagnosis["exception"] == exception and diagnosis["message"] == message, diagnosis
        assert diagnosis["closest_rule"] == entry["closest_rule"], diagnosis
        assert result["summary"]["message"].startswith(f"unknown failure: {exception}: {message} "
                                                       f"(closest known rule: {entry['closest_rule']})")
        assert result["rollback"] == "untouched"
    assert result["rollback_ok"]
