"""Verify a recipe's output: the precision check (agent.measure.precision) for every recipe kind,
the output-text check and every rank's success, as the baseline's `verification`."""

from __future__ import annotations

from pathlib import Path

from agent.measure import precision
from agent.measure.baseline import with_verification
from agent.measure.parity import dump_nll, parity_not_applicable, run_parity
from agent.records import Baseline, Run
from agent.recipe.fs_guard import user_tree
from agent.recipe.recipe import Recipe, RunPlan
from agent.recipe.targets import state_dir
from engine.safe_load import load_json

# the checks a target's recipe_checks may name (agent.recipe.targets): the vendored code alone on a shrunk config
VENDORED_CODE = "vendored_code"
RECIPE_CHECKS = (VENDORED_CODE,)



def verify(recipe: Recipe, run: Run, collected: Baseline, trust_remote_code: bool = False,
           plan: RunPlan | None = None, python: str | None = None, ours: bool = False) -> Baseline:
    """The collected baseline with its parity: the run's own record of every step held to
    transformers on the checkpoint its run plan ran (a `--standin` run's may be a tiny one; `python`:
    the interpreter with the recipe's transformers; `ours`: the recipe is one this migration wrote).
    A target whose recipe_checks name "vendored_code" also holds the vendored code to transformers on a shrunk
    config (agent.measure.parity, fp32). A recipe neither ours nor run under the stand-in has no reference
    here: parity not applicable."""
    checkpoint = plan.checkpoint if plan is not None and plan.checkpoint else recipe.checkpoint_dir()
    standin = bool(plan is not None and plan.standin)
    vendored_code = VENDORED_CODE in recipe.target.recipe_checks
    ours = ours or vendored_code or bool(recipe.report().get("vendored"))
    if checkpoint is None or not (standin or ours):
        return with_verification(collected, parity_not_applicable(recipe))
    parity = precision_of(recipe, run, checkpoint, trust_remote_code, python, bool(plan and plan.tiny),
                          plan.yaml if plan else None)
    if "untrained_weights" not in parity:
        parity.update(recipe_nll(run))
    if vendored_code and parity.get("ok") is not None:
        code = run_parity(recipe, trust_remote_code=trust_remote_code, yaml=plan.yaml if plan else None)
        parity["code"] = code
        if code.get("ok") is False:
            parity["ok"] = False
            parity["reason"] = f"the vendored code on a shrunk config: {code.get('reason') or code_numbers(code)}"
    return with_verification(collected, parity)


def precision_of(recipe: Recipe, run: Run, checkpoint: Path, trust_remote_code: bool, python: str | None,
                 tiny: bool, yaml: Path | None = None) -> dict:
    from agent.migrate.vendor import runs_remote_code

    config = load_json(checkpoint / "config.json")
    if runs_remote_code(config, False) and not trust_remote_code:
        # The original implementation is the repo's own code: never run it without the opt-in.
        return {"ok": None, "checked": False,
                "reason": "original implementation is remote code; pass --trust-remote-code to compare"}
    settings = recipe.settings(yaml)
    model_config = settings.get("model_config") if isinstance(settings.get("model_config"), dict) else {}
    overrides = model_config.get("config_overrides") if VENDORED_CODE in recipe.target.recipe_checks else None
    parallel = settings.get("parallel_config") if isinstance(settings.get("parallel_config"), dict) else {}
    tensor_parallel = parallel.get("attn_tp_size")      # upstream's schema; else the check counts the ranks
    expert_parallel = expert_parallel_of(parallel)
    runs = state_dir(recipe.path) / "runs"
    return precision.check(precision.record_dir(Path(run["res_path"])), checkpoint, python=python,
                           overrides=overrides or None, trust_remote_code=trust_remote_code, random_weights=tiny,
                           log_dir=Path(run["log_dir"]) if run.get("log_dir") else None,
                           pids_file=runs / "precision.pids" if runs.is_dir() and not runs.is_symlink() else None,
                           pids_root=recipe.path,
                           tensor_parallel=tensor_parallel if isinstance(tensor_parallel, int) and tensor_parallel > 0
                           else None, expert_parallel=expert_parallel)


def expert_parallel_of(parallel: dict) -> int | None:
    """The run's MoE expert-parallel size as upstream derives it (ParallelConfig: moe_ep_size = world_size //
    moe_tp_size), else its YAML's moe_ep_size where stated; None where the YAML says neither."""
    def size(key):
        value = parallel.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    world, moe_tp = size("world_size"), size("moe_tp_size")
    if world and moe_tp and world % moe_tp == 0:
        return world // moe_tp
    return size("moe_ep_size")


def recipe_nll(run: Run) -> dict:
    """Whether the weights are untrained, judged on the recipe's own prompt logits (this tool's engine
    leaves them in parity_dump.pt) where the reference could not say (transformers fails on it)."""
    return dump_nll(Path(run.get("res_path") or ".") / "parity_dump.pt")


def code_numbers(code: dict) -> str:
    return (f"max |logits diff| {code.get('max_abs_logits_diff')} (tolerance {code.get('tolerance')}), "
            f"greedy tokens equal: {code.get('greedy_tokens_equal')}")


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
        found.append(f"parity check failed: {parity.get('reason') or code_numbers(parity)}")
    return found


CODE_CHECK = "the code check (the vendored code against transformers on a shrunk config)"


def not_checked(baseline: Baseline) -> list[str]:
    """The checks that gave no verdict (ok: null), one phrase each with why: a run that says ok names them.
    An output text not judged because a passing precision check held every step is no gap."""
    verification = baseline["verification"]
    parity = verification.get("parity") or {}
    found = []
    if parity and parity.get("ok") is None:
        found.append(f"{parity.get('method') or 'the precision check'}: {parity.get('reason') or 'no reason given'}")
    code = parity.get("code") or {}
    if code and code.get("ok") is None:
        found.append(f"{CODE_CHECK}: {code.get('reason') or 'no reason given'}")
    output_check = verification.get("output_check") or {}
    if output_check.get("ok") is None and output_check and parity.get("ok") is not True:
        found.append(f"the output text: {output_check.get('skipped') or 'not judged'}")
    return found


def abnormal_output_run(run: Run, baseline: Baseline, recipe_dir: Path) -> Run | None:
    """Abnormal text from trained weights goes back to diagnosis like a failed run: the run again,
    labelled `verify`, its evidence with an OutputCheckError line (written in the run's folder of the
    recipe `recipe_dir`). None when the text is fine."""
    output_check = baseline["verification"].get("output_check") or {}
    if output_check.get("ok") is not False:
        return None
    note = Path(run["res_path"]) / "output_check.txt"
    user_tree(recipe_dir).write_text(note, Path(run["output_file"]).read_text(errors="replace") +
                                     f"\nOutputCheckError: {'; '.join(output_check.get('reasons') or [])}\n")
    return {**run, "label": "verify", "ok": False, "summary": "abnormal output", "output_file": str(note)}
