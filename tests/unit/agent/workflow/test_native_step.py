"""The native-or-adapter decision as its own workflow step (agent/workflow/nodes.py node_decide_native, between
vendor and render): made once per migration, recorded in the state, and what render writes — the native file
its self-check ran, or the adapter with the kind and reason that fell back. In process, on a copy of the
upstream snapshot, each migration stopped after render (the trial runs of these recipes:
tests/e2e/test_framework_target.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from upstream_checkout import copy_checkout


@pytest.fixture
def counted(monkeypatch):
    """Every call of the decision and of the native file's writer, with the text each self-check ran."""
    from agent.recipe.native import decide

    monkeypatch.setattr(decide, "_decisions", {})       # no decision of an earlier test in this process
    calls = {"decide": 0, "render_native": 0, "checked_files": []}
    real_decide, real_render, real_selfcheck = decide.decide, decide.render_native, decide.selfcheck

    def counting_decide(*args, **kw):
        calls["decide"] += 1
        return real_decide(*args, **kw)

    def counting_render(*args, **kw):
        calls["render_native"] += 1
        return real_render(*args, **kw)

    def recording_selfcheck(jobs, *args, **kw):
        calls["checked_files"] += sorted({Path(job["file"]).read_text() for job in jobs})
        return calls["selfcheck"](jobs, *args, **kw)

    calls["selfcheck"] = real_selfcheck
    monkeypatch.setattr(decide, "decide", counting_decide)
    monkeypatch.setattr(decide, "render_native", counting_render)
    monkeypatch.setattr(decide, "selfcheck", recording_selfcheck)
    return calls


def _forced_failure(reason: str):
    def selfcheck(jobs, *args, **kw):
        return [{"ok": False, "max_rel": None, "reason": reason}] * len(jobs)
    return selfcheck


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    return copy_checkout(tmp_path_factory.mktemp("native_step"))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny llama with a chat template (upstream's executor applies one to every prompt)."""
    from agent.measure import reference as upstream

    return upstream.tiny_checkpoint("llama", tmp_path_factory.mktemp("native_step_ckpt") / "tiny_llama")


def _migrate(checkout: Path, name: str, checkpoint: Path, resume: bool = False, stop_after: str = "render") -> Path:
    from agent.workflow.run import run_migration

    run_migration({"target": str(checkpoint), "output_dir": str(checkout / "models"), "name": name,
                   "device": "cpu", "max_new_tokens": 4, "max_rounds": 0, "world_size": 1,
                   "recipe_target": "framework", "transformers_source": "installed"}, resume=resume, stop_after=stop_after)
    return checkout / "models" / name


def _recorded(recipe: Path) -> dict:
    """What render recorded beside the recipe (the report's `native_model` is the same state key)."""
    return json.loads((recipe / "res" / ".migrator" / "rendered.json").read_text())


def test_the_decision_is_made_once_and_render_writes_the_file_its_self_check_ran(checkout, tiny_llama,
                                                                                 counted, capfd):
    """A tiny llama: one decision, one native file written, one self-check (float32, bf16 and the family's
    variants in one subprocess); the recipe's model file is byte for byte the file that self-check ran."""
    recipe = _migrate(checkout, "once_llama", tiny_llama)
    assert (counted["decide"], counted["render_native"]) == (1, 1), counted
    assert len(counted["checked_files"]) == 1
    assert (recipe / "models" / "modeling_once_llama.py").read_text() == counted["checked_files"][0]
    assert not (recipe / "models" / "modeling_once_llama_framework.py").exists()
    decision = _recorded(recipe)["native_model"]
    assert decision["native"] is True and decision["selfcheck_max_rel"] < 1e-4, decision
    assert "[migrator] framework model: native (upstream's layers and fused kernels)" in capfd.readouterr().err


def test_a_self_check_failure_is_recorded_and_render_writes_the_adapter_with_its_reason(checkout, tiny_llama, counted,
                                                                                       monkeypatch, capfd):
    """The fault: the self-check answers a mismatch. The run stopped after decide_native (one decision, recorded),
    then resumed with every decision refused: render writes what the state recorded — the adapter — and the
    README, the recorded decision and the progress line name the kind and the reason."""
    from agent.recipe.native import decide

    counted["selfcheck"] = _forced_failure("logits differ by 3.1e-01 at step 2 (forced)")
    recipe = _migrate(checkout, "failed_llama", tiny_llama, stop_after="decide_native")
    assert counted["decide"] == 1 and not (recipe / "README.md").exists()

    def refused(*args, **kw):
        raise AssertionError("render decided again")

    monkeypatch.setattr(decide, "decide", refused)
    _migrate(checkout, "failed_llama", tiny_llama, resume=True)
    assert (recipe / "models" / "modeling_failed_llama_framework.py").is_file()
    reason = "the checkpoint's config: logits differ by 3.1e-01 at step 2 (forced)"
    assert _recorded(recipe)["native_model"] == {"native": False, "fell_back": "self-check", "reason": reason}
    assert f"未生成原生模型：self-check（{reason}）" in (recipe / "README.md").read_text()
    assert f"[migrator] framework model: adapter (self-check fell back: {reason})" in capfd.readouterr().err


@pytest.mark.slow
def test_a_family_setting_transformers_cannot_run_is_named_not_verified(checkout, tiny_llama, counted):
    """The self-check answers one family setting not checkable (transformers' own model raised on it) and passes
    the rest: the file is native, and the recorded decision and the README name that setting as not verified (it
    is not among those the file serves). Default coverage: test_selfcheck_not_checkable.py's summary test (the
    recorded decision), and the first test here renders the README of a native file with none skipped."""
    error = "TypeError: unsupported operand (modeling_llama.py:1)"

    def selfcheck(jobs, *args, **kw):
        return [{"ok": False, "checkable": False, "max_rel": None, "reason": error} if job.get("changes")
                and job["changes"].get("tie_word_embeddings") is not None else {"ok": True, "max_rel": 2e-6}
                for job in jobs]

    counted["selfcheck"] = selfcheck
    recipe = _migrate(checkout, "unverified_llama", tiny_llama)
    decision = _recorded(recipe)["native_model"]
    line = f"not checkable: transformers cannot run tie_word_embeddings ({error})"
    assert decision["native"] is True and decision["not_verified"] == [line], decision
    assert "tie_word_embeddings" not in decision["serves"]
    assert (recipe / "models" / "modeling_unverified_llama.py").is_file()
    readme = (recipe / "README.md").read_text()
    assert "以下配置变体未经验证" in readme and line in readme
