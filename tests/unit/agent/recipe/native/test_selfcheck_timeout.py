"""The self-check's time limit grows with its jobs (agent.recipe.native.decide.selfcheck_timeout): a family of
eleven settings (bailing_hybrid's) is eleven jobs' work, not a hang at ten minutes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agent import processes
from agent.recipe.native import decide


@pytest.mark.parametrize("count, limit", [(1, decide.SELFCHECK_TIMEOUT_S), (5, decide.SELFCHECK_TIMEOUT_S),
                                          (11, 11 * decide.SELFCHECK_JOB_S)])
def test_a_timed_out_self_check_is_given_and_names_its_jobs_limit(monkeypatch, tmp_path, count, limit):
    given = []

    def timed_out(argv, cwd, env, stdout, stderr, timeout):
        given.append(timeout)
        return SimpleNamespace(returncode=-9, timed_out=True)

    monkeypatch.setattr(processes, "run_tree", timed_out)
    rows = decide.selfcheck([{"config": {}, "file": "x.py", "class_name": "X"}] * count, tmp_path)
    assert given == [limit]
    assert len(rows) == count and all(not row["ok"] for row in rows)
    assert f"timed out after {limit} s" in rows[0]["reason"], rows[0]["reason"]


def test_a_timeout_the_caller_gives_is_the_one_used(monkeypatch, tmp_path):
    given = []
    monkeypatch.setattr(processes, "run_tree",
                        lambda *a, timeout, **k: given.append(timeout) or SimpleNamespace(returncode=-9, timed_out=True))
    decide.selfcheck([{"config": {}, "file": "x.py", "class_name": "X"}] * 11, tmp_path, timeout=30)
    assert given == [30]
