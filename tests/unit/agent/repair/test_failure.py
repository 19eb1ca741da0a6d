"""The evidence a rule sees (agent.repair.failure.Failure), rules as rows, the full failure in repair()."""

from __future__ import annotations

import re

import pytest

from agent.repair.failure import Failure
from agent.repair.diagnose import diagnose, rule_named
from agent.repair.fix import repair
from agent.repair.rules.catalogue import CATALOGUE
from agent.repair.rules.rule import Rule

TRACEBACK = ('Traceback (most recent call last):\n  File "/r/infer.py", line 3, in <module>\n    main()\n'
             '  File "/r/runner_x.py", line 9, in main\n    boom()\nValueError: bad value 7\n')


def test_failure_carries_output_log_and_frames(tmp_path):
    failure = Failure.from_output(tmp_path, TRACEBACK, log="rank 1: HcclCommInitRootInfo failed\n")
    assert failure.error == "ValueError: bad value 7"
    assert failure.frames == [("/r/infer.py", 3), ("/r/runner_x.py", 9)]
    assert failure.search(r"bad value (\d+)").group(1) == "7"                  # the error line first
    assert failure.search(r"Hccl\w+") is None                                  # the log only when asked
    assert failure.search(r"Hccl\w+", ("log",)).group(0) == "HcclCommInitRootInfo"
    assert failure.search(r"runner_x\.py:9", ("frames",)) is not None
    assert [m.group(0) for m in failure.search_all(r"line \d+")] == ["line 3", "line 9"]


def test_a_timed_out_failure_says_so(tmp_path):
    assert Failure(tmp_path, "still decoding", "", None, timed_out=True).error.startswith(
        "TimeoutError: infer.sh did not finish")


def test_every_rule_is_a_row():
    from agent.repair.rules.rule import Kind

    names = [rule.name for rule in CATALOGUE]
    assert len(names) == len(set(names))
    assert names[0] == "out_of_memory" and names[-1] == "llm_repairer"
    for rule in CATALOGUE:
        assert isinstance(rule, Rule) and rule.diagnosis and "\n" not in rule.diagnosis
        assert rule.evidence is None or isinstance(rule.evidence, (str, re.Pattern))
        assert set(rule.where) <= {"error", "output", "log", "frames"}
        assert isinstance(rule.kind, Kind)


def test_the_order_names_every_rule_once():
    from agent.repair.rules.catalogue import ORDER, ordered

    assert [rule.name for rule in CATALOGUE] == list(ORDER)
    with pytest.raises(ValueError, match="out_of_memory"):
        ordered(CATALOGUE[1:])                       # a rule left out of the order
    with pytest.raises(ValueError, match="made_up"):
        ordered(CATALOGUE, (*ORDER, "made_up"))       # a name without a rule


def test_an_advice_row_reports_and_changes_nothing(tmp_path):
    from agent.repair.rules.reports import ADVICE, advice_rules

    (rule,) = advice_rules([row for row in ADVICE if row[0] == "static_tls_libgomp"])
    failure = Failure.from_output(tmp_path, "OSError: /usr/lib/libgomp.so.1: cannot allocate memory in static TLS block\n")
    facts = rule.match(failure)
    assert facts["lib"] == "/usr/lib/libgomp.so.1" and rule.kind == "report"
    assert rule.fix(failure, facts, None) == ("/usr/lib/libgomp.so.1 cannot be loaded late: export "
                                              "LD_PRELOAD=/usr/lib/libgomp.so.1 before infer.sh")
    assert list(tmp_path.iterdir()) == []


def test_out_of_memory_and_timeout_are_rules(tmp_path):
    out = tmp_path / "output.txt"
    out.write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    oom = diagnose(tmp_path, {"output_file": str(out)})
    assert oom["rule"] == "out_of_memory" and oom["oom"] and oom["diagnosis"].startswith("out of memory: ")
    out.write_text("loading...\nstep 3\n")
    hang = diagnose(tmp_path, {"output_file": str(out), "timed_out": True, "summary": "timed out after 5s"})
    assert hang["rule"] == "run_timed_out" and not hang["oom"]
    assert "step 3" in hang["facts"]["last_line"]


def test_repair_hands_the_fix_the_full_failure_of_the_run(tmp_path, monkeypatch):
    import agent.repair.diagnose as repair_mod

    seen = {}

    def fix(failure, facts, ctx):
        seen.update(output=failure.output, log=failure.log, frames=failure.frames)
        return "looked"

    monkeypatch.setattr(repair_mod, "CATALOGUE", [Rule("looker", None, "looks", fix, facts=lambda f, m: {})])
    recipe = tmp_path / "recipe"
    (recipe / "logs").mkdir(parents=True)
    (recipe / "infer.py").write_text("print(1)\n")
    (recipe / "logs" / "log_0.log").write_text("rank 0 log\n")
    out = tmp_path / "output.txt"
    out.write_text(TRACEBACK)
    run = {"output_file": str(out), "log_dir": str(recipe / "logs")}
    result = repair(recipe, {"rule": "looker", "facts": {}}, round_no=1, run=run)
    assert result["note"] == "looked"
    assert seen == {"output": TRACEBACK, "log": "rank 0 log\n", "frames": [("/r/infer.py", 3), ("/r/runner_x.py", 9)]}


def test_llm_rule_uses_the_failure_it_is_given(tmp_path, monkeypatch):
    """No more re-reading the newest output.txt: the messages come from the failure passed in."""
    from agent.repair import llm_repair

    captured = {}
    monkeypatch.setattr(llm_repair, "request_diff", lambda messages: captured.setdefault("m", messages) and "")
    monkeypatch.setattr(llm_repair, "build_messages", lambda failure: [failure.output])
    stale = tmp_path / ".migrator" / "runs" / "run_9" / "output.txt"
    stale.parent.mkdir(parents=True)
    stale.write_text("an older, unrelated run\n")
    rule_named("llm_repairer").fix(Failure.from_output(tmp_path, TRACEBACK), {}, None)
    assert captured["m"] == [TRACEBACK]
