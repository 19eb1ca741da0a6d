"""Verify a recipe's output: parity against the original implementation where it is importable,
the output-text check and every rank's success, as the baseline's `verification`."""

from __future__ import annotations

from pathlib import Path

from agent.measure.baseline import with_verification
from agent.measure.framework_parity import framework_parity
from agent.measure.parity import foreign_parity, run_parity
from agent.records import Baseline, Run
from agent.recipe.recipe import Recipe


def verify(recipe: Recipe, run: Run, collected: Baseline, trust_remote_code: bool = False,
           standin: dict | None = None, python: str | None = None, ours: bool = False) -> Baseline:
    """The collected baseline with its parity: the vendored model against transformers for a
    recipe on this engine (the trial run's parity dump is its side when there is one); for an
    upstream recipe run under the npu stand-in (`standin`: its plan), its own model against
    transformers on the run's checkpoint (agent.measure.upstream_check). `python`: the interpreter
    with the recipe's transformers, where the reference side of a framework recipe runs. `ours`: the
    recipe is one this migration wrote (a legacy recipe of ours is checked like a framework one)."""
    if standin:
        from agent.measure.upstream_check import parity as upstream_parity

        parity = upstream_parity(recipe, run, standin)
    elif recipe.kind == "standalone":
        dump = Path(run.get("res_path") or recipe.path) / "parity_dump.pt"
        parity = run_parity(recipe, trust_remote_code=trust_remote_code, dump=dump if dump.is_file() else None)
    elif recipe.kind == "framework" and any(recipe.path.glob("models/modeling_*_framework.py")) and run.get("log_dir"):
        # a framework recipe of ours: the executor's generated text against transformers
        parity = framework_parity(Path(run.get("yaml") or recipe.yaml), Path(run["log_dir"]), recipe.repo_root,
                                  python=python)
    elif recipe.kind == "legacy" and recipe.repo_root and run.get("log_dir") and (ours or recipe.report().get("vendored")):
        # a ModelRunner recipe of ours (the legacy target): its runner's text against transformers
        parity = framework_parity(Path(run.get("yaml") or recipe.yaml), Path(run["log_dir"]), recipe.repo_root,
                                  python=python, legacy=True)
    else:
        parity = foreign_parity(recipe)
    return with_verification(collected, parity)


def problems(baseline: Baseline) -> list[str]:
    """What the verification found wrong, one phrase each."""
    verification = baseline["verification"]
    found = []
    if not verification.get("all_ranks_success", False):
        found.append("not every rank finished its formal run")
    output_check = verification.get("output_check") or {}
    if output_check.get("ok") is False:
        found.append(f"abnormal output text: {'; '.join(output_check.get('reasons') or [])}")
    parity = verification.get("parity") or {}
    if parity.get("ok") is False:
        found.append(f"parity check failed: {parity.get('reason') or parity_numbers(parity)}")
    return found


def parity_numbers(parity: dict) -> str:
    return (f"max |logits diff| {parity.get('max_abs_logits_diff')} (tolerance {parity.get('tolerance')}), "
            f"greedy tokens equal: {parity.get('greedy_tokens_equal')}")


def abnormal_output_run(run: Run, baseline: Baseline) -> Run | None:
    """Abnormal text from trained weights goes back to diagnosis like a failed run: the run again,
    labelled `verify`, its evidence with an OutputCheckError line. None when the text is fine."""
    output_check = baseline["verification"].get("output_check") or {}
    if output_check.get("ok") is not False:
        return None
    note = Path(run["res_path"]) / "output_check.txt"
    note.write_text(Path(run["output_file"]).read_text(errors="replace") +
                    f"\nOutputCheckError: {'; '.join(output_check.get('reasons') or [])}\n")
    return {**run, "label": "verify", "ok": False, "summary": "abnormal output", "output_file": str(note)}
