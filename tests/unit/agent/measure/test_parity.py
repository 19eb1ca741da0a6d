"""agent/measure/parity.py, parity that scales: the code check runs on a shrunk config of the same architecture
(the shrinking itself: tests/unit/agent/recipe/test_shrink.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from locations import REPO_ROOT


def test_parity_report_has_code_and_weight_checks(working_recipe_source):
    """The migrated recipe's baseline carries both checks: the code on a shrunk config (fp32, exact)
    and the real weights in the run dtype, every step of the trial run against transformers."""
    baseline = json.loads((working_recipe_source / "baseline" / "baseline_metadata.json").read_text())
    parity = baseline["verification"]["parity"]
    code = parity["code"]
    assert parity["ok"] and code["ok"] and parity["method"] == "precision, per step, teacher-forced"
    assert "shrunk" in code and code["max_abs_logits_diff"] <= 1e-4
    assert code["greedy_tokens_equal"]
    assert parity["dtype"] == "float32" and parity["closest"]["ratio"] <= 1
    assert parity["decode_steps_checked"] == parity["greedy_tokens"] - 1
    assert parity["greedy_tokens_equal"] and not parity["ties"]         # fp32 on both sides: no tie
    # The trial run's own record the check read: every step of every rank, the recipe not run again.
    runs = sorted((working_recipe_source / ".migrator" / "runs").glob("run_*"))
    assert len(list((runs[-1] / "precision" / "rank_0").glob("call_*.pt"))) >= parity["greedy_tokens"]


@pytest.mark.slow
def test_bench_pipeline_memory_ratio(tmp_path):
    """scripts/bench_pipeline.py on the Qwen3-0.6B shape cut to 4 layers: the whole `migrator run`
    peaks at <= 1.1x what the recipe's own `bash infer.sh` holds plus the float32 copy of the weights the
    precision check's oracle needs (both under /usr/bin/time -v), and its bf16 output passes that check."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "scripts/bench_pipeline.py", "--preset", "qwen3-0.6b", "--layers", "4",
                           "--json", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [result] = json.loads(out.read_text())
    assert result["budget_ratio"] <= 1.1, result
    assert result["parity_code"]["ok"] and result["parity_steps"]["ok"], result


def _trial_dump(path, prompt_nll: float, uniform_nll: float):
    import torch

    torch.save({"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3, dtype=torch.long),
                "logits": torch.zeros(1, 8), "generate_ids": torch.tensor([[4, 5]]),
                "prompt_nll": prompt_nll, "uniform_nll": uniform_nll}, path)
    return path


@pytest.mark.parametrize("nll, untrained", [(2.2, True), (0.5, False)])
def test_config_transformers_cannot_run_is_one_line_and_keeps_the_untrained_check(tmp_path, monkeypatch, capsys,
                                                                                 nll, untrained):
    """transformers itself fails on the config (here: a model type it does not know, raised inside
    transformers): parity says so in one line naming transformers' error (was: "parity check could
    not run" from a traceback's last line, no verdict on the weights), and whether the weights are
    untrained is still judged from the recipe's own trial-run dump (ln 8 = 2.08 is the uniform NLL)."""
    from agent.measure import parity

    def fails_in_transformers(*args, **kwargs):
        from transformers import AutoConfig

        AutoConfig.for_model("no_such_model_type")

    monkeypatch.setattr(parity, "check", fails_in_transformers)
    dump = _trial_dump(tmp_path / "dump.pt", nll, 2.0794)
    assert parity.main(["--recipe", str(tmp_path), "--dump", str(dump)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["ok"] is None and result["checked"] is False
    assert result["reason"].startswith("did not run: transformers failed on this config: ValueError: "), result
    assert "no_such_model_type" in result["reason"] and "\n" not in result["reason"]
    assert result["untrained_weights"] is untrained and result["prompt_nll"] == pytest.approx(nll, abs=1e-3)


def test_a_failure_of_our_own_code_in_parity_is_not_blamed_on_transformers(tmp_path, monkeypatch):
    from agent.measure import parity

    def fails_here(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(parity, "check", fails_here)
    with pytest.raises(ZeroDivisionError):
        parity.main(["--recipe", str(tmp_path)])


def test_a_transformers_failure_names_the_stage_and_its_whole_message():
    """F3: the reason named neither what the check was doing nor transformers' whole message (it stopped at
    "from one of: ", the end of the message's first line)."""
    from transformers import AutoTokenizer

    from agent.measure import parity

    try:
        AutoTokenizer.from_pretrained(str(REPO_ROOT / "no_such_folder_here"), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - the error transformers raises, whatever its class
        exc.add_note(parity.STAGE_NOTE + "loading the recipe's model and tokenizer from the shrunk copy")
        result = parity.transformers_failed(exc)
    assert result is not None and result["ok"] is None and result["checked"] is False
    assert result["reason"].startswith("did not run: transformers failed on this config while loading the recipe's "
                                       "model and tokenizer from the shrunk copy: "), result["reason"]
    assert "\n" not in result["reason"] and len(result["reason"]) <= 300


LOSES_ITS_TOKENIZER = """
import sys
from pathlib import Path
from agent.measure import parity

real = parity._runner


def runner_after_a_cleaner(recipe_dir, settings):
    # what another process's cleaner did to the check's temporary folder (newcomer F2/F3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (Path(settings["model_path"]) / name).unlink(missing_ok=True)
    return real(recipe_dir, settings)


parity._runner = runner_after_a_cleaner
sys.exit(parity.main(["--recipe", sys.argv[1], "--tokens", "4"]))
"""


def test_a_code_check_whose_temporary_copy_lost_its_files_says_it_did_not_run_and_why(working_recipe, tmp_path):
    """F3: the tokenizer files of the shrunk copy vanish while the check runs (another migrator's cleaner
    removed them): the check did not run, and says which files its copy lost, at which stage, and what to
    do; never "transformers cannot build or run this config"."""
    env = {"PYTHONPATH": str(working_recipe), "PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", LOSES_ITS_TOKENIZER, str(working_recipe)], cwd=working_recipe,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] is None and result["checked"] is False, result
    reason = result["reason"]
    assert reason.startswith("did not run: its temporary copy of the checkpoint lost") and "transformers cannot" not in reason
    assert "lost tokenizer.json, tokenizer_config.json while loading the recipe's model and tokenizer" in reason
    assert "run it again" in reason
