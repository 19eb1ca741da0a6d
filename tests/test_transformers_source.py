"""Cross-version vendoring (agent/migrate/transformers_source.py): a recipe for a cann-recipes-infer
checkout pins the checkout's transformers (5.0.0 at fbc225d) and is vendored from that release's
source files whatever the installed one is; its trial runs and parity run in an interpreter that has
that release.

End to end (default suite, one case): a tiny llama migrated with the tested newest transformers
installed into a copy of the snapshot, from `.venv-tf5.0`'s site-packages (5.0.0) as
--transformers-source; the recipe then runs under upstream's executor/scripts/infer.sh with
`.venv-tf5.0`'s python under the stand-in, and its parity is checked against transformers 5.0.0 in
that interpreter. Bad sources are one line and exit 10; a source that cannot be fetched is exit 9."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from agent.migrate import transformers_source as ts
from locations import REPO_ROOT
from migrator_cli import run_cli
from transformers_5_0 import tf50_site

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"


def fake_tree(root: Path, version: str) -> Path:
    (root / "transformers").mkdir(parents=True)
    (root / "transformers" / "__init__.py").write_text(f'__version__ = "{version}"\n')
    return root


# ---- the pin and the sources, in-process ------------------------------------------------------
def test_the_snapshots_pin_is_read_from_its_agents_md_else_its_requirements(tmp_path):
    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT} (../shared is absent)")
    assert ts.checkout_pin(SNAPSHOT) == ("5.0.0", "AGENTS.md")
    co = tmp_path / "co"
    for name, pin in (("a", "5.0.0"), ("b", "5.0.0"), ("c", "4.55.0"), ("d", "5.2.0")):
        (co / "models" / name).mkdir(parents=True)
        (co / "models" / name / "requirements.txt").write_text(f"torch\ntransformers=={pin}\n")
    assert ts.checkout_pin(co) == ("5.0.0", "models/*/requirements.txt")     # 4.55 is outside 5.x
    assert ts.checkout_pin(tmp_path / "nothing") is None


def test_a_folder_or_a_wheel_is_a_source_tree_and_bad_ones_are_refused(tmp_path):
    site = fake_tree(tmp_path / "site", "5.3.1")
    tree = ts.open_source(site)
    assert (tree.version, tree.root) == ("5.3.1", site.resolve())
    assert ts.open_source(site / "transformers").root == site.resolve()        # the package folder itself
    wheel = tmp_path / "transformers-5.3.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("transformers/__init__.py", '__version__ = "5.3.1"\n')
        archive.writestr("transformers/models/llama/modeling_llama.py", "class LlamaForCausalLM: ...\n")
        archive.writestr("transformers-5.3.1.dist-info/METADATA", "Name: transformers\n")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    try:
        tree = ts.open_source(wheel)
        assert tree.version == "5.3.1" and str(tree.root).startswith(str(tmp_path / "cache"))
        assert tree.module_file("transformers.models.llama.modeling_llama").read_text().startswith("class Llama")
        assert tree.module_file("transformers.models.llama.nothing") is None
        other = tmp_path / "other.whl"
        with zipfile.ZipFile(other, "w") as archive:
            archive.writestr("requests/__init__.py", "")
        bad = [(other, "not a transformers wheel"), (tmp_path / "site" / "transformers" / "__init__.py", "not a wheel"),
               (tmp_path, "no transformers/ package"), (fake_tree(tmp_path / "old", "4.55.0"), "outside the supported range"),
               (tmp_path / "missing", "no such file or folder")]
        for given, why in bad:
            with pytest.raises(ts.BadTransformersSource, match=why) as caught:
                ts.open_source(given)
            assert caught.value.exit_code == ts.EXIT_BAD_SOURCE == 10
    finally:
        del os.environ["XDG_CACHE_HOME"]


def test_an_unreachable_index_is_one_line_naming_transformers_source(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(ts.NoTransformersSource, match="pass --transformers-source WHEEL|DIR") as caught:
        ts.fetch_source("5.0.0")
    assert caught.value.exit_code == ts.EXIT_NO_SOURCE == 9 and "\n" not in str(caught.value)


def test_the_plan_follows_the_pin_and_needs_an_interpreter_with_it(tmp_path, monkeypatch):
    from agent.errors import EnvironmentProblem

    installed = ts.installed_version()
    co = tmp_path / "co"
    (co / "models" / "a").mkdir(parents=True)
    (co / "models" / "a" / "requirements.txt").write_text(f"transformers=={installed}\n")
    assert ts.plan_for(co, None, None) == ts.Plan(installed, None, None)          # the pin is installed
    assert ts.plan_for(None, None, None) == ts.Plan(installed, None, None)        # no checkout
    assert ts.plan_for(co, "installed", None).version == installed
    other = fake_tree(tmp_path / "site", "5.0.0" if installed != "5.0.0" else "5.1.0")
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))      # python3 here has the installed release
    with pytest.raises(EnvironmentProblem, match="pass --reference-python PY") as caught:
        ts.plan_for(co, str(other), None)
    assert caught.value.exit_code == 4 and "\n" not in str(caught.value)
    with pytest.raises(EnvironmentProblem, match=f"has transformers {installed}, the recipe pins"):
        ts.plan_for(co, str(other), sys.executable)


def test_a_release_that_lacks_the_model_is_refused_before_anything_is_written(tmp_path):
    from agent.errors import UnsupportedModelError
    from agent.migrate.vendor import from_tree, locate_source
    from agent.testing.tiny_checkpoint import build_tiny_checkpoint

    config = json.loads((build_tiny_checkpoint("llama", tmp_path / "ckpt") / "config.json").read_text())
    source = locate_source(config)
    empty = ts.SourceTree("5.0.0", fake_tree(tmp_path / "site", "5.0.0"), "test")
    with pytest.raises(UnsupportedModelError, match="transformers 5.0.0 has no LlamaForCausalLM"):
        from_tree(source, empty)


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
    assert parity["ok"] and parity["requests"] == 2 and parity["decode_steps_checked"] >= 2, parity
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


@pytest.mark.slow
def test_the_pinned_release_is_fetched_once_into_the_cache(tmp_path, monkeypatch):
    """Where PyPI is reachable: `pip download transformers==5.0.0 --no-deps` into the cache, unpacked
    there; a second call reads the cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    try:
        tree = ts.fetch_source("5.0.0", timeout=600)
    except ts.NoTransformersSource as exc:
        pytest.skip(f"no package index reachable here: {exc}")
    assert tree.version == "5.0.0" and tree.origin == "transformers 5.0.0 wheel (pip download)"
    assert tree.module_file("transformers.models.llama.modeling_llama") is not None
    wheels = list((tmp_path / "cache" / "infer-migrator" / "transformers" / "wheels").glob("*.whl"))
    assert len(wheels) == 1
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")     # the cache answers now
    assert ts.fetch_source("5.0.0").root == tree.root
