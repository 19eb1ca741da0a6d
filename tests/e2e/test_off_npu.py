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
    python.write_text(f"#!/bin/sh\necho '{{\"version\": \"{version}\", \"failure\": null, \"error\": null}}'\n")   # the import probe's answer
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
    with pytest.raises(EnvironmentProblem, match="python3 on PATH has no transformers 4.0.0"):
        reference_python("4.0.0", None)          # only the first python3 on the user's PATH is the launcher's


# ---- the exit-4 command works as printed in a checkout that pins another transformers ----------------------
def _pinned_checkout(root: Path, version: str = "5.0.0") -> Path:
    checkout = _fake_checkout(root)
    (checkout / "models" / "qwen").mkdir()
    (checkout / "models" / "qwen" / "requirements.txt").write_text(f"transformers=={version}\n")
    return checkout


def _refusal(checkout: Path, monkeypatch, **given):
    """check_npu_for_checkout's exit-4 line for `migrator run ck --output-dir CHECKOUT/models [given]`, python3 on
    PATH the migrator's own (the installed transformers, not the pin): the printed command, split."""
    from types import SimpleNamespace

    from agent import errors
    from agent.workflow import inputs

    monkeypatch.setenv("PATH", os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"]))
    typed = ["run", "ck", "--output-dir", str(checkout / "models")]
    for key, value in given.items():
        typed += [f"--{key.replace('_', '-')}", value]
    args = SimpleNamespace(recipe_target=None, output_dir=str(checkout / "models"), target="ck", typed=typed,
                           **{"transformers_source": None, "reference_python": None, **given})
    with pytest.raises(errors.EnvironmentProblem) as caught:
        inputs.check_npu_for_checkout(args)
    line = str(caught.value)
    assert caught.value.exit_code == 4 and "\n" not in line
    printed = re.search(r"`([^`]+)`", line).group(1)
    return printed, typed


def _planned_interpreter(command: list[str]) -> str:
    """The printed `migrator standin -- migrator run …` up to the check that failed before: its arguments
    through the CLI's parser, then the interpreter check plan_for makes (transformers_source.reference_python)."""
    from agent import cli
    from agent.migrate.transformers_source import reference_python

    assert command[:4] == ["migrator", "standin", "--", "migrator"], command
    args = cli._parser().parse_args(command[4:])
    return reference_python("5.0.0", args.reference_python)


def test_the_exit_4_command_names_an_interpreter_with_the_checkouts_pin_and_passes_that_check(tmp_path, monkeypatch):
    """A checkout pinning transformers 5.0.0, this interpreter 5.24 and python3 on PATH too: the printed command
    carries `--reference-python` this checkout's .venv-tf5.0 (make install-tf50's), and gets past the check that
    refused it before ('python3 on PATH has not 5.0.0: pass --reference-python PY')."""
    from agent.migrate import transformers_source

    tf50 = transformers_source.PROJECT / ".venv-tf5.0" / "bin" / "python"
    if not tf50.is_file():
        pytest.skip("no .venv-tf5.0 here (make install-tf50)")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    printed, typed = _refusal(_pinned_checkout(tmp_path), monkeypatch)
    command = shlex.split(printed)
    assert command[4:] == typed + ["--reference-python", str(tf50)], printed
    assert _planned_interpreter(command) == str(tf50)


def test_without_an_interpreter_with_the_pin_the_command_builds_one_first(tmp_path, monkeypatch):
    """None here: this checkout's `make install-tf50`, then the command `--reference-python` what it builds; outside a
    checkout of this project (a pip install), a venv in the cache that sees the migrator's packages."""
    from agent.migrate import transformers_source

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(transformers_source, "interpreter_with", lambda version: None)
    printed, typed = _refusal(_pinned_checkout(tmp_path), monkeypatch)
    build, run = printed.split(" && migrator standin -- ")
    assert build == f"make -C {shlex.quote(str(transformers_source.PROJECT))} install-tf50"
    assert shlex.split(run)[1:] == typed + ["--reference-python", str(transformers_source.PROJECT / ".venv-tf5.0" / "bin" / "python")]
    monkeypatch.setattr(transformers_source, "PROJECT", tmp_path / "site-packages")
    printed, typed = _refusal(_pinned_checkout(tmp_path / "pip"), monkeypatch)
    venv = tmp_path / "cache" / "infer-migrator" / "transformers" / "venvs" / "transformers-5.0.0"
    assert printed.startswith(f"{shlex.quote(sys.executable)} -m venv {venv} && echo ") and \
        f" && {venv}/bin/python -m pip install -q transformers==5.0.0 && migrator standin -- " in printed, printed
    assert shlex.split(printed.split(" && migrator standin -- ")[1])[1:] == typed + ["--reference-python", f"{venv}/bin/python"]


@pytest.mark.slow
def test_the_venv_the_exit_4_command_builds_has_the_pin(tmp_path, monkeypatch):
    """The pip-install form, run as printed up to the migrator (pip from the index): its interpreter passes the
    check the migration makes."""
    from agent.migrate import transformers_source

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(transformers_source, "PROJECT", tmp_path / "site-packages")
    printed, _ = _refusal(_pinned_checkout(tmp_path), monkeypatch)
    build, run = printed.split(" && migrator standin -- ")
    proc = subprocess.run(["bash", "-c", build], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 and "No matching distribution" in proc.stderr + proc.stdout:
        pytest.skip("the package index cannot be reached here")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _planned_interpreter(["migrator", "standin", "--", "migrator", *shlex.split(run)[1:]]) == \
        str(transformers_source.cache_venv("5.0.0") / "bin" / "python")


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
@pytest.mark.parametrize("source", ["installed", "the checkout's pin"])
def test_the_checkout_advice_works_when_followed(tmp_path, tiny_checkpoints, source):
    """The exit-4 line's `migrator standin -- migrator run …`, run as printed, migrates into the checkout — with the
    installed transformers, and with the checkout's pin (5.0.0): then the line names `--reference-python` this
    checkout's .venv-tf5.0 (make install-tf50), which the run needs. The default case of that check:
    test_the_exit_4_command_names_an_interpreter_with_the_checkouts_pin_and_passes_that_check."""
    from agent.measure import reference as upstream

    checkout = copy_checkout(tmp_path)
    checkpoint = upstream.tiny_checkpoint("llama", tmp_path / "ckpt")
    args = ["run", str(checkpoint), "--output-dir", str(checkout / "models"), "--name", "adv", "--max-new-tokens", "4",
            "--max-rounds", "0"] + (["--transformers-source", "installed"] if source == "installed" else [])
    refused = run_cli(*args, cwd=tmp_path)
    assert refused.returncode == 4, refused.stderr[-2000:]
    command = shlex.split(re.search(r"`(migrator standin -- migrator run [^`]+)`", refused.stderr).group(1))
    assert ("--reference-python" in command) is (source != "installed"), command
    followed = run_cli(*command[1:], cwd=tmp_path, timeout=1500)
    assert followed.returncode == 0, followed.stderr[-3000:]
    assert (checkout / "models" / "adv" / "agentic" / "baseline" / "baseline_metadata.standin.json").is_file()   # a stand-in run's
