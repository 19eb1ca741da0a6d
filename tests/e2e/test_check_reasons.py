"""True reasons in real runs (issue 41.3): `migrator run` of the old-style causal LMs the precision probe did
not see (their runs ended in exit 70 at verify), of a model that writes nothing, and of a run whose code
check another process broke. Each is `slow` (a migration each); the default cases that cover their paths:
tests/unit/agent/measure/test_precision.py (the probe's classes, a model without a KV cache, a record the
probe did not write, both sides of an empty output), tests/unit/agent/measure/test_parity.py (a code check
whose temporary copy lost its files) and tests/unit/agent/measure/test_verify.py (not-checked lines)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from migrator_cli import run_cli


@pytest.mark.slow  # a migration each; default: test_precision.py's probe-class and no-KV-cache cases
@pytest.mark.parametrize("model_type", ["gpt2", "ctrl", "openai-gpt"])
def test_old_style_causal_lms_are_held_to_transformers_per_step(model_type, tiny_checkpoints, tmp_path):
    """GPT2LMHeadModel, CTRLLMHeadModel, OpenAIGPTLMHeadModel: the probe records their steps (it knew only
    `*ForCausalLM`), so the precision check judges every decode step (was: exit 70, "internal error")."""
    proc = run_cli("run", str(tiny_checkpoints(model_type)), "--name", "old", "--output-dir", str(tmp_path),
                   "--device", "cpu", "--max-new-tokens", "8", "--json")
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    precision = json.loads(proc.stdout)["precision"]
    assert precision["ok"] is True and precision["checked"] is True, precision
    assert precision["decode_steps_checked"] >= 7


def _silent(checkpoint: Path, into: Path) -> Path:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, into)
    weights = load_file(into / "model.safetensors")
    weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
    save_file(weights, into / "model.safetensors", metadata={"format": "pt"})
    return into


@pytest.mark.slow  # a migration; default: test_precision.py::test_an_empty_output_passes_where_transformers_writes_nothing_too
def test_a_model_that_writes_nothing_migrates_ok_and_the_report_says_so(tiny_checkpoints, tmp_path):
    """Untrained weights whose greedy tokens are special tokens only (a zeroed final norm: every logit 0,
    <|pad|> picked): every step within tolerance, the text empty, and transformers' own greedy text on the
    same prompt empty too: exit 0 (was exit 1), and the summary says it in one line."""
    checkpoint = _silent(tiny_checkpoints("llama"), tmp_path / "silent")
    proc = run_cli("run", str(checkpoint), "--name", "silent", "--output-dir", str(tmp_path / "out"),
                   "--device", "cpu", "--max-new-tokens", "8", "--json")
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    precision = json.loads(proc.stdout)["precision"]
    assert precision["ok"] is True and precision["empty_output"].startswith("the model itself writes nothing here")
    summary = (tmp_path / "out" / "silent" / "migration_summary.md").read_text()
    assert sum("the model itself writes nothing here" in line for line in summary.splitlines()) == 1, summary


@pytest.mark.slow  # a re-baseline run; default: test_parity.py's lost-files case and test_verify.py
def test_a_code_check_another_process_broke_is_named_on_the_ok_line_and_in_the_summary(working_recipe, tmp_path):
    """F2/F3: another process empties the code check's temporary copy while it runs (as the cross-namespace
    cleaner did). The run is ok (the precision check held every step), its final line says the code check
    did not run and why, and so does migration_summary.md (was: nowhere, and "transformers cannot build or
    run this config")."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    stop = threading.Event()

    def cleaner():
        while not stop.is_set():
            for folder in tmp.rglob("migrator-*-parity_code-*"):
                for name in ("tokenizer.json", "tokenizer_config.json"):
                    try:
                        (folder / name).unlink()
                    except OSError:
                        pass
            time.sleep(0.02)

    thread = threading.Thread(target=cleaner, daemon=True)
    thread.start()
    try:
        proc = run_cli("run", str(working_recipe), env={"TMPDIR": str(tmp)})
    finally:
        stop.set()
        thread.join()
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    final = proc.stdout.strip().splitlines()[0]
    assert final.startswith(f"ok: {working_recipe} — not checked: the code check"), final
    assert "did not run: its temporary copy of the checkpoint lost" in final and "run it again" in final
    summary = (working_recipe / "migration_summary.md").read_text()
    assert "- the code check (the vendored code against transformers on a shrunk config): not checked: did not run" \
        in summary, summary
