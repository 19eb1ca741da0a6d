"""#31.7 off-NPU answers: a migration into a checkout (which needs an NPU) on a host without one is exit 4
before anything is written, naming the stand-in command that validates it; a standalone recipe's exit-4
line names `migrator standin -- bash infer.sh`, which works; rollback after a repair round takes the
registry line out; upstream's launch guard is a known failure naming the other process; the launcher
environment's python3 is used under the stand-in too."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from locations import REPO_ROOT
from migrator_cli import run_cli
from agent.recipe.targets import REGISTRY, state_dir


def _fake_checkout(root: Path, name: str = "co") -> Path:
    checkout = root / name
    (checkout / REGISTRY).parent.mkdir(parents=True)
    (checkout / REGISTRY).write_text("_specs = {\n}\n")
    (checkout / "models").mkdir()
    return checkout


def _everything(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


@pytest.mark.parametrize("variant", ["default_target", "legacy_target_relative_paths", "hub_reference",
                                     "checkout_of_another_name_with_models_dot_slash"])
def test_a_migration_into_a_checkout_off_an_npu_is_exit_4_before_anything_is_written(tiny_checkpoints, tmp_path,
                                                                                      variant):
    checkout = _fake_checkout(tmp_path, "recipes-ü" if "another" in variant else "co")
    before = _everything(checkout)
    registry = (checkout / REGISTRY).read_bytes()
    ckpt = tiny_checkpoints("llama")
    cwd, env = tmp_path, {"HF_HUB_OFFLINE": "1"}
    if variant == "default_target":
        args = ["run", str(ckpt), "--output-dir", str(checkout / "models"), "--name", "m1"]
    elif variant == "legacy_target_relative_paths":
        shutil.copytree(ckpt, tmp_path / "ck")
        args = ["run", "ck", "--output-dir", f"{checkout.name}/models", "--target", "legacy"]
    elif variant == "hub_reference":
        args = ["run", "SomeOrg/some-model", "--output-dir", str(checkout / "models")]
    else:
        args = ["run", str(ckpt), "--output-dir", str(checkout / "models") + "/./", "--max-rounds", "0"]
    proc = run_cli(*args, cwd=cwd, env=env, timeout=300)
    assert proc.returncode == 4, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "needs an Ascend NPU" in lines[0] and "nothing was written" in lines[0], lines[0]
    assert "pip install" not in lines[0]
    advice = re.search(r"`(migrator standin -- migrator run [^`]+)`", lines[0])
    assert advice and shlex.split(advice.group(1))[4:] == args, lines[0]     # the user's own command, under standin
    assert _everything(checkout) == before and (checkout / REGISTRY).read_bytes() == registry
    assert not (tmp_path / ".migrator").exists()


def test_under_the_standin_the_checkout_check_lets_the_migration_go_on(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from agent import errors
    from agent.workflow import inputs

    checkout = _fake_checkout(tmp_path)
    args = SimpleNamespace(recipe_target=None, output_dir=str(checkout / "models"), target="x", typed=["run", "x"])
    with pytest.raises(errors.EnvironmentProblem, match="migrator standin -- migrator run x"):
        inputs.check_npu_for_checkout(args)
    monkeypatch.setenv("NPU_STANDIN", "cpu")
    inputs.check_npu_for_checkout(args)        # the stand-in's own run: nothing refused
    monkeypatch.delenv("NPU_STANDIN")
    args.output_dir = str(tmp_path / "elsewhere")      # a standalone recipe: runs on this host's engine
    inputs.check_npu_for_checkout(args)


def _needs_npu(recipe: Path) -> None:
    """A module-level torch_npu import and a kernel call in a helper nothing calls: the scan sees an
    NPU recipe, the stand-in runs it."""
    runner = next(recipe.glob("runner_*.py"))
    text = runner.read_text()
    runner.write_text("import torch_npu\n" + text.rstrip("\n") +
                      "\n\n\ndef _npu_norm(x, w):\n    return torch_npu.npu_rms_norm(x, w)[0]\n")


def test_a_standalone_recipe_that_needs_an_npu_names_the_standin_command_and_it_works(working_recipe, tmp_path):
    _needs_npu(working_recipe)
    proc = run_cli("run", str(working_recipe), cwd=tmp_path)
    assert proc.returncode == 4, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    advice = re.search(r"`(migrator standin -- bash [^`]+)`", line)
    assert advice, line
    assert not (working_recipe / ".migrator").exists()
    command = shlex.split(advice.group(1))
    follow = subprocess.run([sys.executable, "-m", "agent.cli", *command[1:]], cwd=tmp_path, capture_output=True,
                            text=True, timeout=600, env={**os.environ, "RES_PATH": str(tmp_path / "res")})
    assert follow.returncode == 0, follow.stderr[-3000:]
    assert "[npu-standin] exit 0" in follow.stderr


# ---- upstream's launch guard --------------------------------------------------------------------
GUARD_LINE = ("A Python process executing infer.py or server.py was detected to be running, and the script was "
              "interrupted and exited.")


@pytest.mark.parametrize("script", ["infer.py", "server.py"])
@pytest.mark.parametrize("how", ["absolute_path", "relative_path_with_arguments"])
def test_the_launch_guard_is_a_known_failure_naming_the_other_process(tmp_path, script, how):
    from agent.repair.diagnose import diagnose, rule_named
    from agent.repair.failure import Failure
    from agent.repair.rules.rule import RepairContext

    folder = tmp_path / "other job"
    folder.mkdir()
    (folder / script).write_text("import time\ntime.sleep(120)\n")
    argv = [sys.executable, str(folder / script)] if how == "absolute_path" else \
        [sys.executable, f"./{script}", "--yaml", "x.yaml"]
    other = subprocess.Popen(argv, cwd=folder)
    try:
        time.sleep(0.3)
        output = f"No such thing\n{GUARD_LINE}\n"
        result = diagnose(tmp_path, {"output_file": _write(tmp_path, output)})
        assert result["rule"] == "another_launch_running", result
        rule = rule_named("another_launch_running")
        failure = Failure.from_output(tmp_path, output)
        ours = [o for o in result["facts"]["others"] if o.startswith(f"pid {other.pid}: ")]
        assert len(ours) == 1 and ours[0].endswith(" ".join(argv[1:])), result["facts"]
        alone = dict(result["facts"], others=ours)      # (a shared host may run other jobs' infer.py too)
        note = rule.fix(failure, alone, RepairContext())
        assert ours[0] in note and "check_launch" in note and "nothing changed" in note, note
        assert "closest known rule" not in json.dumps(result)
    finally:
        other.kill()
        other.wait()
    # the other process gone: still this rule, saying it ended
    gone = diagnose(tmp_path, {"output_file": _write(tmp_path, GUARD_LINE + "\n")})
    assert gone["rule"] == "another_launch_running"
    assert not [o for o in gone["facts"]["others"] if o.startswith(f"pid {other.pid}: ")]
    assert "ended since" in rule.fix(failure, dict(gone["facts"], others=[]), RepairContext())


def test_the_launch_guards_all_clear_line_is_not_this_rule(tmp_path):
    from agent.repair.diagnose import diagnose

    output = ("No Python process running infer.py or server.py was detected.\n"
              "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nValueError: other\n")
    assert diagnose(tmp_path, {"output_file": _write(tmp_path, output)})["rule"] != "another_launch_running"


def _write(folder: Path, text: str) -> str:
    path = folder / f"out_{time.monotonic_ns()}.log"
    path.write_text(text)
    return str(path)


# ---- the launcher environment's python3 ---------------------------------------------------------
def _fake_python(folder: Path, version: str) -> Path:
    folder.mkdir(parents=True)
    python = folder / "python3"
    python.write_text(f"#!/bin/sh\necho {version}\n")
    python.chmod(0o755)
    return python


@pytest.mark.parametrize("standin", [False, True])
def test_the_launcher_environments_python3_with_the_pin_is_used_with_or_without_the_standin(tmp_path, monkeypatch,
                                                                                           standin):
    from agent.errors import EnvironmentProblem
    from agent.migrate.transformers_source import reference_python
    from npu_standin.environment import standin_env

    launcher = _fake_python(tmp_path / "launcher env" / "bin", "4.99.1")
    other = _fake_python(tmp_path / "other" / "bin", "4.0.0")
    base = {**os.environ, "PATH": os.pathsep.join([str(launcher.parent), str(other.parent), "/usr/bin", "/bin"])}
    env = standin_env("cpu", base=base) if standin else base
    if standin:     # the stand-in puts its guards and the migrator's interpreter first, as it must
        assert env["PATH"].split(os.pathsep)[1] == os.path.dirname(os.path.abspath(sys.executable))
    monkeypatch.setattr(os, "environ", env)
    assert reference_python("4.99.1", None) == str(launcher)
    with pytest.raises(EnvironmentProblem, match="python3 on PATH has not 4.0.0"):
        reference_python("4.0.0", None)          # only the first python3 on the user's PATH is the launcher's


# ---- rollback after repair rounds: the registry line goes too ---------------------------------
from framework_recipes import migrated  # noqa: E402,F401  (the module's fixture)
from upstream_checkout import copy_checkout


@pytest.mark.parametrize("rounds, asked", [(1, None), (2, "2"), (2, "1")])
def test_rollback_after_repair_rounds_takes_the_registry_line_out(tmp_path, migrated, rounds, asked):
    from agent.recipe.backup import backup_round, start_backup_run

    checkout = copy_checkout(tmp_path)
    recipe = checkout / "models" / "tiny_llama"
    shutil.copytree(migrated["recipe"], recipe)
    shutil.copy2(migrated["checkout"] / REGISTRY, checkout / REGISTRY)
    record = json.loads((state_dir(recipe) / "registry_edit.json").read_text())
    record["registry"] = str(checkout / REGISTRY)
    (state_dir(recipe) / "registry_edit.json").write_text(json.dumps(record))
    assert b"tiny_llama" in (checkout / REGISTRY).read_bytes()
    yaml = next((recipe / "config").glob("*.yaml"))
    original = yaml.read_bytes()
    start_backup_run(recipe, "run-1")
    for number in range(1, rounds + 1):          # what repair rounds do: back up, then edit
        with backup_round(recipe, number):
            with open(yaml, "ab") as f:
                f.write(f"# repaired in round {number}\n".encode())
    proc = run_cli("rollback", str(recipe), *(["--round", asked] if asked else []))
    assert proc.returncode == 0, proc.stderr
    restored = original if asked in (None, "1") else original + b"# repaired in round 1\n"
    assert yaml.read_bytes() == restored
    assert "removed tiny_llama from" in proc.stdout, proc.stdout
    assert (checkout / REGISTRY).read_bytes() == migrated["registry_before"]


@pytest.mark.slow
def test_the_checkout_advice_works_when_followed(tmp_path, tiny_checkpoints):
    """The exit-4 line's `migrator standin -- migrator run …`, run as printed, migrates into the checkout."""
    from agent.measure import reference as upstream

    checkout = copy_checkout(tmp_path)
    checkpoint = upstream.tiny_checkpoint("llama", tmp_path / "ckpt")
    args = ["run", str(checkpoint), "--output-dir", str(checkout / "models"), "--name", "adv", "--max-new-tokens", "4",
            "--transformers-source", "installed", "--max-rounds", "0"]
    refused = run_cli(*args, cwd=tmp_path)
    assert refused.returncode == 4, refused.stderr[-2000:]
    command = shlex.split(re.search(r"`(migrator standin -- migrator run [^`]+)`", refused.stderr).group(1))
    followed = run_cli(*command[1:], cwd=tmp_path, timeout=1500)
    assert followed.returncode == 0, followed.stderr[-3000:]
    assert (checkout / "models" / "adv" / "agentic" / "baseline" / "baseline_metadata.json").is_file()
