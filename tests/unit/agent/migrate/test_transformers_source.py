"""Cross-version vendoring (agent/migrate/transformers_source.py): a recipe for a cann-recipes-infer
checkout pins the checkout's transformers (5.0.0 at fbc225d) and is vendored from that release's
source files whatever the installed one is; its trial runs and parity run in an interpreter that has
that release. Bad sources are one line and exit 10; a source that cannot be fetched is exit 9. End to end
(a recipe vendored from 5.0.0 run on 5.0.0): tests/e2e/test_recipe_on_transformers_5_0.py."""

from __future__ import annotations

import json
import os
import sys
import zipfile
from pathlib import Path

import pytest

from agent.migrate import transformers_source as ts
from locations import REPO_ROOT

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


def test_a_relative_reference_python_is_made_absolute_with_its_links_kept(tmp_path, monkeypatch):
    """`--reference-python .venv-tf5.0/bin/python` from the checkout: the precision check runs it from the run's
    record folder, where the relative path named nothing (exit 70, FileNotFoundError); a venv's python is a link
    out of the venv, so it is made absolute, not resolved."""
    import os

    monkeypatch.chdir(tmp_path)
    relative = os.path.relpath(sys.executable, tmp_path)        # ../../.venv/bin/python: a link into the venv
    python = ts.reference_python(ts.installed_version(), relative)
    assert python == os.path.abspath(sys.executable) and Path(python).is_absolute()
