"""A framework recipe vendored from the checkout pin (transformers 5.0.0, agent/migrate/transformers_source.py)
end to end: a tiny llama migrated with the tested newest transformers installed into a copy of the snapshot,
from `.venv-tf5.0`'s site-packages (5.0.0) as --transformers-source; the recipe then runs under upstream's
executor/scripts/infer.sh with `.venv-tf5.0`'s python under the stand-in, and its parity is checked against
transformers 5.0.0 in that interpreter (default suite, one case). A bad --transformers-source on the command
line is one line and exit 10."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from migrator_cli import run_cli
from transformers_5_0 import tf50_site


# ---- end to end: vendored from 5.0.0 with 5.24 installed, run and checked on 5.0.0 --------------
def test_a_recipe_vendored_from_the_checkouts_5_0_runs_on_5_0_under_upstreams_infer_sh(tmp_path):
    import transformers

    from agent.measure import precision
    from agent.workflow.run import run_migration
    from agent.measure import reference as upstream
    from framework_recipes import two_prompt_yaml
    from upstream_checkout import copy_checkout

    python, site = tf50_site()
    if transformers.__version__ == "5.0.0":
        pytest.skip("the installed transformers is the checkout's own 5.0.0: nothing to vendor across")
    checkout = copy_checkout(tmp_path)
    checkpoint = upstream.tiny_checkpoint("llama", tmp_path / "ckpt")
    summary = run_migration({"target": str(checkpoint), "output_dir": str(checkout / "models"), "name": "xv_llama",
                             "device": "cpu", "max_new_tokens": 8, "max_rounds": 0, "world_size": 1,
                             "recipe_target": None, "transformers_source": str(site),
                             "reference_python": str(python)}, stop_after="render")
    recipe = Path(summary["recipe_dir"])
    assert "transformers==5.0.0" in (recipe / "requirements.txt").read_text().splitlines()
    # llama's framework model is the native one, written from 5.0.0's architecture ("Adapted from" its file);
    # its configuration is 5.0.0's code, not the installed release's: the 5.0.0 file's own lines are in the copy
    modeling = (recipe / "models" / "modeling_xv_llama.py").read_text()
    assert "5.0.0" in "\n".join(modeling.splitlines()[:30]), modeling[:2000]
    configuration = (recipe / "models" / "configuration_xv_llama.py").read_text()
    original = (site / "transformers" / "models" / "llama" / "configuration_llama.py").read_text()
    installed = Path(transformers.__file__).parent.joinpath("models", "llama", "configuration_llama.py").read_text()
    only_50 = [line for line in set(original.splitlines()) - set(installed.splitlines()) if len(line.strip()) > 20]
    assert sum(line in configuration for line in only_50) >= len(only_50) // 2, only_50[:5]
    # the recipe under upstream's launcher, on 5.0.0 (the stand-in puts its interpreter's python3 first on PATH)
    yaml_name = two_prompt_yaml(recipe, tmp_path, 1, checkpoint)
    record = precision.record_dir(tmp_path)
    proc = subprocess.run([str(python), "-m", "agent.cli", "standin", "--",
                           *upstream.framework_command(checkout, recipe.name, yaml_name)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=1200,
                          env=precision.probe_env(dict(os.environ), tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = upstream.rank_logs(checkout, recipe.name, yaml_name)
    text = logs[0].read_text()
    assert "Traceback" not in text and "Initializing KV cache with PageAttention management" in text, text[-3000:]
    # parity against 5.0.0, in 5.0.0's interpreter
    parity = precision.check(record, checkpoint, python=str(python))
    assert parity["ok"] and parity["requests"] == 2 and parity["decode_steps_checked"] >= 2, json.dumps(parity)[:6000]
    assert parity["reference"].startswith("transformers 5.0.0 "), parity["reference"]
    assert len({r["prompt_tokens"] for r in parity["per_request"]}) == 2       # unequal lengths, one packed batch


def test_bad_transformers_source_on_the_command_line_is_one_line_and_exit_10(tmp_path, tiny_checkpoints):
    from agent.recipe.targets import REGISTRY

    checkout = tmp_path / "co"          # a checkout as far as the target rows look: its registry and its pin
    (checkout / REGISTRY).parent.mkdir(parents=True)
    (checkout / REGISTRY).write_text("_specs = {}\n")
    (checkout / "models").mkdir()
    (checkout / "AGENTS.md").write_text("CANN 9.0.0 + PyTorch 2.8.0 + torch_npu 2.8.0 + transformers 5.0.0\n")
    proc = run_cli("run", str(tiny_checkpoints("llama")), "--output-dir", str(checkout / "models"),
                   "--transformers-source", str(tmp_path))
    assert proc.returncode == 10, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "no transformers/ package in that folder" in proc.stderr
    assert not any((checkout / "models").iterdir())


@pytest.mark.slow
def test_migrator_run_with_5_24_installed_runs_and_checks_the_recipe_on_5_0(tmp_path):
    """The whole workflow: `migrator standin -- migrator run CKPT --output-dir CHECKOUT/models
    --transformers-source DIR --reference-python PY`: vendored from 5.0.0, the trial run under
    upstream's infer.sh in PY, the baseline's parity against transformers 5.0.0."""
    import transformers

    from agent.measure import reference as upstream
    from upstream_checkout import copy_checkout

    python, site = tf50_site()
    if transformers.__version__ == "5.0.0":
        pytest.skip("the installed transformers is the checkout's own 5.0.0: nothing to vendor across")
    checkout = copy_checkout(tmp_path)
    checkpoint = upstream.tiny_checkpoint("llama", tmp_path / "ckpt")
    proc = run_cli("standin", "--", sys.executable, "-m", "agent.cli", "run", str(checkpoint), "--output-dir",
                   str(checkout / "models"), "--name", "xv_run", "--max-new-tokens", "8", "--max-rounds", "0",
                   "--transformers-source", str(site), "--reference-python", str(python), "--json",
                   cwd=tmp_path, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1])
    recipe = checkout / "models" / "xv_run"
    report = json.loads((recipe / "res" / ".migrator" / "migration_report.json").read_text())
    assert report["vendored"]["origin"] == "transformers 5.0.0" and report["transformers"]["python"] == str(python)
    parity = json.loads(Path(summary["baseline_path"]).read_text())["verification"]["parity"]
    assert parity["ok"] and parity["checked"] and parity["reference"].startswith("transformers 5.0.0 "), parity
    # re-baselined later without --reference-python: the interpreter its migration ran it with
    again = run_cli("standin", "--", sys.executable, "-m", "agent.cli", "run", str(recipe), "--max-rounds", "0", "--json",
                    cwd=tmp_path, timeout=1500)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout[again.stdout.index("{"):again.stdout.rindex("}") + 1])
    parity = json.loads(Path(summary["baseline_path"]).read_text())["verification"]["parity"]
    assert summary["scenario"] == "C" and parity["ok"] and parity["reference"].startswith("transformers 5.0.0 "), \
        (summary, parity)
