"""Base models in a framework recipe (issue #35.6): upstream's offline path needs a chat template.

cann-recipes-infer's executor/offline/offline_inference.py wraps every str prompt as
`[{"role": "user", "content": p}]` and its scheduler tokenizes such a prompt with
`tokenizer.apply_chat_template(...)`; executor/offline/infer.py builds its prompts with
`build_dataset_input(..., is_chat=True)`. No YAML key or flag skips it (the scheduler takes a plain
str prompt, but the offline path never hands it one), so a tokenizer without a template fails there,
mid-run. A framework migration of such a checkpoint is refused before anything is written (exit 2),
saying what to add. A legacy recipe (executor/model_runner.py: `is_chat=False`) tokenizes plain
prompts and takes it as it is.
"""

from __future__ import annotations

from pathlib import Path

from agent.errors import InputError
from engine.safe_load import load_json

# Where transformers (5.x) finds a tokenizer's chat template beside tokenizer_config.json's "chat_template".
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
TEMPLATE_FOLDER = "additional_chat_templates"


def has_chat_template(model_dir: Path) -> bool:
    """Whether AutoTokenizer.from_pretrained(model_dir) gets a chat template (read from the files, no import)."""
    model_dir = Path(model_dir)
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        try:
            data = load_json(config)
        except (OSError, ValueError):
            data = {}
        if isinstance(data, dict) and data.get("chat_template"):
            return True
    for name in TEMPLATE_FILES:
        path = model_dir / name
        if path.is_file() and path.stat().st_size > 0:
            if name.endswith(".json"):
                try:
                    if not load_json(path).get("chat_template"):
                        continue
                except (OSError, ValueError, AttributeError):
                    continue
            return True
    folder = model_dir / TEMPLATE_FOLDER
    return folder.is_dir() and any(p.suffix == ".jinja" for p in folder.iterdir())


def require_chat_template(model_dir: Path) -> None:
    """InputError (exit 2), one line, when the checkpoint's tokenizer has no chat template (the framework target's
    check: upstream's executor runs every prompt through it)."""
    if has_chat_template(model_dir):
        return
    raise InputError(
        f"{model_dir}: the tokenizer has no chat template, and upstream's offline executor applies one to every "
        "prompt (apply_chat_template; no option skips it); add a \"chat_template\" to tokenizer_config.json "
        "(or a chat_template.jinja), or migrate it with --target legacy, whose ModelRunner takes plain prompts")
