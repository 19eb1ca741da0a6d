"""#20 items on exits: `--json` gives one JSON object on stdout on every exit, `--device npu` on a host
without an NPU says "no NPU here" in one line, `migrator run RECIPE` from another working directory
leaves that directory as it was (no `./models/`), and filesystem faults — disk full, a read-only
recipe (scenario C), the output folder removed during the trial run — end with one line and exit 74.

The filesystem faults are real: a size-limited tmpfs (disk full) and a read-only remount, which
need root (mount); they are skipped with the reason where mounting is not allowed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from locations import REPO_ROOT
from migrator_cli import run_cli

EXIT_FILESYSTEM = 74


def _one_error_line(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("migrator:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def _npu_recipe(root: Path) -> Path:
    """A recipe (infer.sh + Python) that calls a torch_npu kernel: exit 4 before anything runs here."""
    recipe = root / "npu_recipe"
    recipe.mkdir(parents=True)
    (recipe / "infer.sh").write_text("#!/bin/bash\npython infer.py\n")
    (recipe / "infer.py").write_text("import torch_npu\n\n\ndef norm(x, w):\n"
                                     "    return torch_npu.npu_rms_norm(x, w)[0]\n")
    return recipe


def _npu_usable() -> bool:
    from agent.recipe.npu_scan import npu_usable

    return npu_usable()


# ---- --json on every exit -------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["missing_target", "needs_npu", "usage_error", "device_npu"])
def test_json_is_one_object_on_every_exit(case, tmp_path):
    if case in ("needs_npu", "device_npu") and _npu_usable():
        pytest.skip("this host has a usable NPU")
    recipe = str(_npu_recipe(tmp_path))
    args = {"missing_target": ["run", str(tmp_path / "absent"), "--json"],
            "needs_npu": ["run", recipe, "--json"],
            "usage_error": ["run", recipe, "--json", "--max-rounds", "-1"],
            "device_npu": ["run", recipe, "--device", "npu", "--json"]}[case]
    proc = run_cli(*args, cwd=tmp_path, timeout=300)
    line = _one_error_line(proc)
    assert proc.returncode in (2, 4), (proc.returncode, line)
    summary = json.loads(proc.stdout)            # the whole of stdout is one JSON object
    assert summary["status"] == "error" and summary["exit_code"] == proc.returncode, summary
    assert summary["error"] == line.removeprefix("migrator: error: "), (summary, line)


# ---- --device npu without an NPU -----------------------------------------------------------------
@pytest.mark.parametrize("target", ["npu_recipe", "checkpoint"])
def test_device_npu_without_an_npu_says_no_npu_here(target, tmp_path, tiny_checkpoints):
    if _npu_usable():
        pytest.skip("this host has a usable NPU")
    path = _npu_recipe(tmp_path) if target == "npu_recipe" else tiny_checkpoints("llama")
    out = tmp_path / "out"
    proc = run_cli("run", str(path), "--device", "npu", "--output-dir", str(out), cwd=tmp_path, timeout=300)
    line = _one_error_line(proc)
    assert proc.returncode == 4, line
    assert line.startswith("migrator: error: no NPU here"), line        # not the kernel message
    assert "needs an Ascend NPU" not in line, line
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())


# ---- `migrator run RECIPE` from elsewhere ------------------------------------------------------------
def test_run_recipe_from_another_directory_creates_no_models_folder(tmp_path):
    if _npu_usable():
        pytest.skip("this host has a usable NPU")
    recipe = _npu_recipe(tmp_path / "recipes")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run_cli("run", str(recipe), cwd=elsewhere, timeout=300)
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert list(elsewhere.iterdir()) == [], list(elsewhere.iterdir())   # no ./models/ (nor anything else)


# ---- filesystem faults -------------------------------------------------------------------------------
def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size, mode="rw") -> a fresh tmpfs folder; unmounted afterwards."""
    mounted: list[Path] = []

    def mount(size: str, where: str = "fs") -> Path:
        point = tmp_path / where
        point.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode}): needs root")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def _remount(point: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(point)], check=True, capture_output=True)


def _bytes_of(folder: Path) -> int:
    """What the folder takes on a tmpfs: every file and folder rounded up to whole 4 KiB pages."""
    return sum(-(-max(p.stat().st_size, 1) // 4096) * 4096 for p in folder.rglob("*") if p.is_file() or p.is_dir())


@pytest.mark.slow  # exit 74 is covered by default by the disk-full case below
def test_read_only_recipe_is_one_line_and_untouched(working_recipe, tmpfs):
    point = tmpfs("64m")
    recipe = point / "fi"
    shutil.copytree(working_recipe, recipe)
    before = _snapshot(recipe)
    _remount(point, "ro")
    proc = run_cli("run", str(recipe), "--json", timeout=600)
    line = _one_error_line(proc)
    assert proc.returncode == EXIT_FILESYSTEM, line
    assert "read-only" in line and str(recipe) in line, line
    assert json.loads(proc.stdout)["exit_code"] == EXIT_FILESYSTEM
    _remount(point, "rw")
    assert _snapshot(recipe) == before


def test_disk_full_is_one_line_and_a_rerun_works(working_recipe, tmpfs):
    """A recipe on a nearly full disk: wherever the run runs out of space (run logs, the checkpoint
    store, the baseline, the report) it ends with one line naming the fault; with space again the
    same command works."""
    need = _bytes_of(working_recipe)
    point = tmpfs(str(need + 48 * 1024))
    recipe = point / "fi"
    shutil.copytree(working_recipe, recipe)
    proc = run_cli("run", str(recipe), timeout=900)
    line = _one_error_line(proc)
    assert proc.returncode == EXIT_FILESYSTEM, (line, proc.stderr[-3000:])
    assert "no space left" in line, line
    _remount(point, "size=256m")
    again = run_cli("run", str(recipe), timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (recipe / "baseline" / "baseline_metadata.json").is_file()


@pytest.mark.slow
def test_output_folder_removed_during_the_trial_run(tiny_checkpoints, tmp_path):
    """Scenario A: the recipe folder is moved away while its trial run runs — one line (exit 74)
    naming the folder, and the same command run again migrates from the start."""
    out = tmp_path / "out"
    args = [sys.executable, "-m", "agent.cli", "run", str(tiny_checkpoints("llama")), "--name", "m",
            "--output-dir", str(out), "--device", "cpu", "--max-new-tokens", "4"]
    proc = subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("[migrator] trial_run ..."):
            time.sleep(1.0)
            (out / "m").rename(tmp_path / "moved_away")
            break
    stdout, rest = proc.communicate(timeout=600)
    stderr = "".join(seen) + rest
    errors = [ln for ln in stderr.splitlines() if ln.startswith("migrator:")]
    assert "Traceback" not in stderr and len(errors) == 1, stderr[-3000:]
    assert proc.returncode == EXIT_FILESYSTEM, stderr[-3000:]
    assert "removed" in errors[0] and str(out / "m") in errors[0], errors[0]
    again = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
