"""Base models (issue #35.6): a tokenizer without a chat template and upstream's offline executor.

Upstream's offline path has no switch for plain prompts (offline_inference.generate wraps every str
prompt as a user message; its scheduler calls apply_chat_template on it; infer.py builds its prompts
with is_chat=True), so `migrator run` refuses such a checkpoint for the framework target before
anything is written: exit 2, one line saying what to add. The legacy target (ModelRunner,
is_chat=False) takes it."""

from __future__ import annotations

import sys

import json
import re
import shutil

import pytest

from agent.recipe.chat_template import has_chat_template
from agent.recipe.targets import REGISTRY
from migrator_cli import run_cli
from upstream_checkout import SNAPSHOT, _git, copy_checkout
from agent.measure import reference as upstream


def test_upstreams_offline_path_has_no_plain_prompt_switch():
    """The decision rests on upstream's code as it is: if a plain-prompt path appears, use it instead."""
    offline = (SNAPSHOT / "executor" / "offline" / "offline_inference.py").read_text()
    assert '[{"role": "user", "content": p}] if isinstance(p, str) else p' in offline
    scheduler = (SNAPSHOT / "executor" / "core" / "scheduler" / "scheduler.py").read_text()
    assert "self.tokenizer.apply_chat_template(" in scheduler
    infer = (SNAPSHOT / "executor" / "offline" / "infer.py").read_text()
    assert re.search(r"build_dataset_input\([^)]*is_chat=True\)", infer, re.S)
    # no YAML key or option names a chat switch
    config = (SNAPSHOT / "executor" / "core" / "config" / "inference_config.py").read_text()
    assert not re.search(r"chat|template", config, re.I)
    # the ModelRunner path (the legacy target) tokenizes plain prompts
    runner = (SNAPSHOT / "executor" / "model_runner.py").read_text()
    assert "is_chat=False" in runner


def test_where_a_chat_template_is_found(tmp_path, tiny_checkpoints):
    base = tmp_path / "base"
    shutil.copytree(tiny_checkpoints("llama"), base)
    assert not has_chat_template(base)
    chat = tmp_path / "chat"
    shutil.copytree(base, chat)
    config = json.loads((chat / "tokenizer_config.json").read_text())
    (chat / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": upstream.CHATML_TEMPLATE}))
    assert has_chat_template(chat)
    jinja = tmp_path / "jinja"
    shutil.copytree(base, jinja)
    (jinja / "chat_template.jinja").write_text(upstream.CHATML_TEMPLATE)
    assert has_chat_template(jinja)
    empty = tmp_path / "empty"
    shutil.copytree(base, empty)
    (empty / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": ""}))
    (empty / "chat_template.json").write_text('{"chat_template": null}')
    assert not has_chat_template(empty)
    # as transformers itself sees them (an empty template renders every prompt as nothing)
    from transformers import AutoTokenizer

    assert [bool(AutoTokenizer.from_pretrained(d).chat_template) for d in (base, chat, jinja, empty)] == \
        [False, True, True, False]


@pytest.fixture(scope="module")
def base_setup(tmp_path_factory, tiny_checkpoints):
    root = tmp_path_factory.mktemp("base_model")
    return copy_checkout(root), tiny_checkpoints("llama")


def test_a_base_model_is_refused_for_the_framework_target_before_anything_is_written(base_setup):
    checkout, checkpoint = base_setup
    assert not has_chat_template(checkpoint)
    registry = (checkout / REGISTRY).read_bytes()
    # under the stand-in, as a user off an NPU runs it (without it, the answer is the exit-4 stand-in line)
    proc = run_cli("standin", "--", sys.executable, "-m", "agent.cli", "run", str(checkpoint), "--output-dir",
                   str(checkout / "models"), "--name", "base_llama", "--transformers-source", "installed",
                   "--max-rounds", "0")
    assert proc.returncode == 2, proc.stderr[-2000:]
    progress = ("[migrator]", "[npu-standin]")
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith(progress)]
    assert len(lines) == 1 and lines[0].startswith("migrator: error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert "no chat template" in lines[0] and '"chat_template" to tokenizer_config.json' in lines[0], lines[0]
    assert "--target legacy" in lines[0]
    assert not (checkout / "models" / "base_llama").exists()
    assert (checkout / REGISTRY).read_bytes() == registry
    # (the workflow's own state under the ignored models/res/.migrator/ is #35.5's, not this check's)
    assert _git(checkout, "status", "--porcelain", "--untracked-files=all") == ""


def test_a_base_model_migrates_for_the_legacy_target(base_setup):
    from agent.workflow.run import run_migration

    checkout, checkpoint = base_setup
    summary = run_migration({"target": str(checkpoint), "output_dir": str(checkout / "models"), "name": "base_leg",
                             "device": "cpu", "max_new_tokens": 8, "max_rounds": 0, "world_size": 1,
                             "recipe_target": "legacy", "transformers_source": "installed"}, stop_after="render")
    assert (checkout / "models" / "base_leg" / "runner_base_leg.py").is_file(), summary
    shutil.rmtree(checkout / "models" / "base_leg")
