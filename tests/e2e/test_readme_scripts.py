"""Every script README.md (and docs/, where there is one) tells users to run is run here, in its smallest
form: its `--help` (a shell script: `bash -n`), and a real run where one takes seconds. The scripts are
found by parsing the documents for `scripts/…` paths, so a newly named script is covered without editing
this file. The real runs that take longer are `slow`; the default cases that cover their paths are named
beside them. (scripts/bench_recipe.py's `render` died of a NameError and its `RecipeSystem` of an
IndexError, and no test ran it: tests/lint/test_undefined_names.py catches the first class, the
bench-recipe case below the second.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from locations import REPO_ROOT

# `scripts/x.py` as the documents name it; not upstream's `executor/scripts/…`
SCRIPT_RE = re.compile(r"(?<![\w./-])scripts/[\w./-]+?\.(?:py|sh)\b")
UPSTREAM = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"

# the smallest real run of a named script where it takes seconds: (arguments, what its stdout must show)
REAL_RUNS = {
    "scripts/repair_coverage.py": ([], "field corpus:"),
    "scripts/standin_coverage.py": ([str(UPSTREAM), "--missing-only"], "missing"),
}
# real runs that take a minute or more here (each `slow`); its --help and the case named run by default
SLOW_RUNS = {
    "scripts/bench_recipe.py": (["--quick", "--new-tokens", "3", "--threads", "1"], "ratio eager / transformers"),
    "scripts/native_coverage.py": (["llama"], "1 native"),
    "scripts/try_architectures.py": (["--quick", "llama"], "parity"),
}


def named_scripts() -> list[str]:
    documents = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
    return sorted({m.group(0) for doc in documents if doc.is_file() for m in SCRIPT_RE.finditer(doc.read_text())})


NAMED = named_scripts()


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    return env


def test_the_documents_name_scripts_that_exist():
    assert {"scripts/bench_recipe.py", "scripts/try_architectures.py"} <= set(NAMED), NAMED   # the parse finds them
    assert "scripts/infer.sh" not in NAMED          # upstream's executor/scripts/infer.sh is not ours
    missing = [name for name in NAMED if not (REPO_ROOT / name).is_file()]
    assert not missing, f"the README names scripts that are not there: {missing}"
    unknown = sorted((set(REAL_RUNS) | set(SLOW_RUNS)) - set(NAMED))
    assert not unknown, f"real runs listed for scripts no document names: {unknown}"


@pytest.mark.parametrize("script", NAMED)
def test_each_named_script_answers_its_help(script, tmp_path):
    if script.endswith(".sh"):
        command = ["bash", "-n", str(REPO_ROOT / script)]
    else:
        command = [sys.executable, str(REPO_ROOT / script), "--help"]
    proc = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if script.endswith(".py"):
        assert "usage:" in proc.stdout, proc.stdout[-2000:]


def _real_run(script: str, args: list[str], shows: str, tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(REPO_ROOT / script), *args], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert shows in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("script", sorted(REAL_RUNS))
def test_named_script_real_run(script, tmp_path):
    _real_run(script, *REAL_RUNS[script], tmp_path)


@pytest.mark.slow  # a minute or more each here; their --help and test_bench_recipe_times_a_recipe_from_its_log run by default
@pytest.mark.parametrize("script", sorted(SLOW_RUNS))
def test_named_script_real_run_slow(script, tmp_path):
    _real_run(script, *SLOW_RUNS[script], tmp_path)


BENCH_ON_A_RECIPE = """
import os, runpy, sys
recipe, res = sys.argv[1], sys.argv[2]
os.environ["RES_PATH"] = res
bench = runpy.run_path(sys.argv[3])
system = bench["RecipeSystem"]("recipe eager", bench["load_runner"](__import__("pathlib").Path(recipe), "eager",
                                                                   "cpu", 4), ["An attention function"])
system.generate(4)
print("tokens", len(system.runner.last_generate_ids[0]), "log", system.log, "decode_ms", system.logged_decode_ms(4))
"""


def test_bench_recipe_times_a_recipe_from_its_log(working_recipe_source, tmp_path):
    """bench_recipe's recipe side on the session's migrated recipe, in seconds: the runner it builds as
    infer.py does, and the decode times read back from the log the engine writes (it found that log
    through a handler attribute the engine's logger no longer has: IndexError)."""
    proc = subprocess.run([sys.executable, "-c", BENCH_ON_A_RECIPE, str(working_recipe_source), str(tmp_path / "res"),
                           str(REPO_ROOT / "scripts" / "bench_recipe.py")],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"tokens (\d+) log (\S+) decode_ms ([\d.]+)", proc.stdout)
    assert found, proc.stdout[-2000:]
    assert int(found.group(1)) == 4 and found.group(2) == str(tmp_path / "res" / "log_0.log")
    assert float(found.group(3)) > 0
