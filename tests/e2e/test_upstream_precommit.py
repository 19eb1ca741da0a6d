"""Upstream's own pre-commit hooks pass on what a framework recipe writes (issue #23, Deliver 5).

The hooks are the checkout's .pre-commit-config.yaml, run by pre-commit itself on the recipe's files
and the registry, as a contributor's commit on a branch would run them. Their repository
(github.com/pre-commit/pre-commit-hooks) is cloned by pre-commit where GitHub is reachable; where it is
not (this machine), each hook of that repository runs as a local hook with the same entry point of the
pre-commit-hooks package installed by the test extra (its version is upstream's `rev`), the same file
types and upstream's args — pre-commit still picks the files and runs them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from locations import REPO_ROOT

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"
HOOKS_REPO = "https://github.com/pre-commit/pre-commit-hooks"
# id -> (entry point, file types, pass_filenames) of the hooks pre-commit-hooks defines (its
# .pre-commit-hooks.yaml) that upstream's config uses.
HOOKS = {
    "check-symlinks": ("check-symlinks", ["symlink"], True),
    "destroyed-symlinks": ("destroyed-symlinks", ["file"], True),
    "trailing-whitespace": ("trailing-whitespace-fixer", ["text"], True),
    "end-of-file-fixer": ("end-of-file-fixer", ["text"], True),
    "check-yaml": ("check-yaml", ["yaml"], True),
    "check-json": ("check-json", ["json"], True),
    "check-ast": ("check-ast", ["python"], True),
    "check-added-large-files": ("check-added-large-files", [], True),
    "check-merge-conflict": ("check-merge-conflict", ["text"], True),
    "check-shebang-scripts-are-executable": ("check-shebang-scripts-are-executable", ["text"], True),
    "detect-private-key": ("detect-private-key", ["text"], True),
    "debug-statements": ("debug-statement-hook", ["python"], True),
    "no-commit-to-branch": ("no-commit-to-branch", [], False),
}


def github_reachable() -> bool:
    try:
        return subprocess.run(["git", "ls-remote", HOOKS_REPO, "HEAD"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def local_config(config: dict, bin_dir: Path) -> dict:
    """upstream's config with pre-commit-hooks' hooks as local ones on the installed package's entry points."""
    repos = []
    for repo in config["repos"]:
        if repo["repo"] != HOOKS_REPO:
            pytest.skip(f"upstream's config has a hook repository this test does not map: {repo['repo']}")
        hooks = []
        for hook in repo["hooks"]:
            if hook["id"] not in HOOKS:
                pytest.skip(f"hook {hook['id']} of {HOOKS_REPO} is not mapped to its entry point here")
            entry, types, pass_filenames = HOOKS[hook["id"]]
            if not (bin_dir / entry).is_file():
                pytest.skip(f"{entry} is not installed (pip install -c constraints.txt -e '.[test]')")
            local = {"id": hook["id"], "name": hook["id"], "entry": str(bin_dir / entry), "language": "system",
                     "pass_filenames": pass_filenames, "always_run": not pass_filenames}
            if types:
                local["types"] = types
            if hook.get("args"):
                local["args"] = hook["args"]
            hooks.append(local)
        repos.append({"repo": "local", "hooks": hooks})
    return {**{k: v for k, v in config.items() if k != "repos"}, "repos": repos}


def pre_commit_script() -> Path | None:
    """pre-commit's script: next to this interpreter, else in the environment its package is installed in
    (a venv layered on another one's site-packages)."""
    import pre_commit

    for folder in (Path(sys.executable).parent, Path(pre_commit.__file__).resolve().parents[4] / "bin"):
        if (folder / "pre-commit").is_file():
            return folder / "pre-commit"
    return None


# Every family the tests migrate into a checkout (tests/e2e/test_framework_target.py's and the parity tests'),
# with the overrides those tests use: each one's files go through the hooks.
FAMILIES = [("llama", {}), ("mistral", {"sliding_window": 16}), ("gemma2", {}), ("phi3", {}), ("mixtral", {}),
            ("qwen3_moe", {}), ("deepseek_v3", {"num_key_value_heads": 4})]


# by default a dense, a soft-capped and an MLA + MoE file (the most distinct code); the slow case: every family
DEFAULT_FAMILIES = ("llama", "gemma2", "deepseek_v3")


@pytest.mark.parametrize("families", [pytest.param("default", id="dense-softcap-mla"),
                                      pytest.param("all", marks=pytest.mark.slow, id="every-family")])
def test_upstreams_pre_commit_hooks_pass_on_a_framework_recipe_of_every_family(tmp_path, families):
    from importlib.metadata import PackageNotFoundError, version

    from agent.recipe.targets import REGISTRY
    from agent.workflow.run import run_migration
    from agent.measure import reference as upstream
    from upstream_checkout import _git, copy_checkout

    try:
        hooks_version = version("pre-commit-hooks")
        version("pre-commit")
    except PackageNotFoundError as exc:
        pytest.skip(f"{exc.name} is not installed (the test extra installs it)")
    pre_commit = pre_commit_script()
    if pre_commit is None:
        pytest.skip(f"no pre-commit next to {sys.executable} or its installed package")
    checkout = copy_checkout(tmp_path)
    config = yaml.safe_load((checkout / ".pre-commit-config.yaml").read_text())
    recipes = []
    for model_type, overrides in [f for f in FAMILIES if families == "all" or f[0] in DEFAULT_FAMILIES]:
        checkpoint = upstream.tiny_checkpoint(model_type, tmp_path / f"ckpt_{model_type}", **overrides)
        summary = run_migration({"target": str(checkpoint), "output_dir": str(checkout / "models"),
                                 "name": f"pc_{model_type}", "device": "cpu", "max_new_tokens": 8, "max_rounds": 0,
                                 "world_size": 1, "recipe_target": "framework", "transformers_source": "installed"},
                                stop_after="render")
        recipes.append(Path(summary["recipe_dir"]))
        # the N-card YAML `--world-size` writes is one of the files a contributor commits too
        from agent.recipe.recipe import Recipe
        ncard = Recipe.at(recipes[-1]).write_yaml_for(2)
        check_ncard_yaml(ncard, moe=model_type in ("mixtral", "qwen3_moe", "deepseek_v3"))
    # a contributor's commit: on a branch of its own (no-commit-to-branch protects main), files staged
    _git(checkout, "checkout", "-qb", "add-pc-models")
    _git(checkout, "add", "-A")
    files = [line for line in _git(checkout, "diff", "--cached", "--name-only").splitlines()]
    assert REGISTRY.as_posix() in files and all(f.startswith("models/pc_") or f == REGISTRY.as_posix()
                                                for f in files), files
    for recipe in recipes:
        mine = [f for f in files if f.startswith(f"models/{recipe.name}/")]
        assert any(f.endswith(".py") for f in mine) and any(f.endswith(".yaml") for f in mine), (recipe, mine)
        check_headers(recipe)
    if github_reachable():
        how = f"upstream's config as it is ({HOOKS_REPO} {config['repos'][0]['rev']})"
        config_file = checkout / ".pre-commit-config.yaml"
    else:
        rev = str(config["repos"][0].get("rev", "")).lstrip("v")
        if rev and hooks_version != rev:
            pytest.skip(f"pre-commit-hooks {hooks_version} is installed, upstream's config pins {rev}")
        how = f"upstream's hooks as local hooks on pre-commit-hooks {hooks_version} (GitHub unreachable)"
        config_file = tmp_path / "upstream-pre-commit-local.yaml"
        config_file.write_text(yaml.safe_dump(local_config(config, pre_commit.parent), sort_keys=False))
    before = {f: (checkout / f).read_bytes() for f in files}

    def run_hooks(*paths: str):
        return subprocess.run([str(pre_commit), "run", "--config", str(config_file), "--color", "never", "--files", *paths],
                              cwd=checkout, capture_output=True, text=True, timeout=600,
                              env={"PATH": f"{pre_commit.parent}:/usr/bin:/bin", "HOME": str(tmp_path),
                                   "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home")})

    proc = run_hooks(*files)
    print(how)
    print(proc.stdout)
    # the fixers' changes, if any, name the file and line that failed
    changed = _git(checkout, "diff", "--", *files)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:] + changed[-3000:]
    results = [line for line in proc.stdout.splitlines() if line.rstrip().endswith(("Passed", "Skipped", "Failed"))]
    assert len(results) == sum(len(repo["hooks"]) for repo in config["repos"]), proc.stdout   # every hook ran
    assert not any(line.rstrip().endswith("Failed") for line in results)
    assert sum(line.rstrip().endswith("Passed") for line in results) >= 8, results    # text, python, yaml ... files
    # fixers changed nothing: what we wrote was already clean
    assert {f: (checkout / f).read_bytes() for f in files} == before
    # the hooks bite: a file with a trailing blank, no final newline and a debugger import fails them
    probe = recipes[0] / "models" / "probe.py"
    probe.write_text("import pdb\nx = 1 \ny = 2")
    _git(checkout, "add", "-A")
    bad = run_hooks(probe.relative_to(checkout).as_posix())
    failed = [line.split(".")[0] for line in bad.stdout.splitlines() if line.rstrip().endswith("Failed")]
    assert bad.returncode != 0 and len(failed) == 3, bad.stdout


def check_headers(recipe: Path) -> None:
    """Checklist 二.9 on every Python file of the recipe: a licence header, "Adapted from" and the exact
    source (a transformers release's file), the source's copyright lines; no generated-file banner."""
    import transformers

    pys = sorted((recipe / "models").glob("*.py"))
    assert pys, recipe
    for py in pys:
        head = py.read_text().split("\n\"\"\"", 1)[0][:4000]
        lines = head.splitlines()
        assert lines[0] == "# coding=utf-8", (py, lines[:3])
        at = lines.index("# Adapted from")
        source = lines[at + 1].removeprefix("# ")
        assert source.startswith("https://github.com/huggingface/transformers/blob/v"), (py, source)
        # the named file is the release's: its path exists in the installed tree (the same layout)
        rel = source.split("/blob/", 1)[1].split("/", 1)[1]
        assert (Path(transformers.__file__).parents[1] / rel.removeprefix("src/")).is_file(), (py, rel)
        assert any(line.startswith("# Copyright ") for line in lines), (py, lines[:8])
        assert "Licensed under the Apache License, Version 2.0" in head, py
        text = py.read_text()
        assert "automatically generated from" not in text and "Do NOT edit this file manually" not in text, py


def check_ncard_yaml(path: Path, moe: bool) -> None:
    """The `--world-size 2` YAML as upstream's 2tp YAMLs write it: True / False (never true / false),
    strings quoted, a dense model's moe_tp_size 1 with upstream's comment, an MoE model's split."""
    import re

    text = path.read_text()
    values = [line.split(":", 1)[1].split("#", 1)[0].strip() for line in text.splitlines()
              if ":" in line and not line.lstrip().startswith("#") and line.startswith("  ")]
    assert not [v for v in values if v in ("true", "false", "yes", "no")], text
    assert {"True", "False"} <= set(values) and ('"npugraph_ex"' in values or '"eager"' in values), text
    data = yaml.safe_load(text)
    assert data["parallel_config"]["attn_tp_size"] == 2
    line = next(line for line in text.splitlines() if line.strip().startswith("moe_tp_size:"))
    if moe:
        assert data["parallel_config"]["moe_tp_size"] == 2 and "#" not in line, text
    else:
        assert re.fullmatch(r"  moe_tp_size: 1 +# Dense model has no MoE layer.*", line), line
