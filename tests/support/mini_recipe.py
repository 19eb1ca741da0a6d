"""A minimal recipe (YAML, runner, infer.sh) carrying a field-corpus entry's recipe code: what the catalogue
matches a corpus log against (tests/unit/agent/repair/test_field_corpus.py, scripts/repair_coverage.py)."""

from __future__ import annotations

from pathlib import Path


MINI_YAML = """model_name: fi
model_path: ./weights
device: auto
world_size: 1
model_config:
  dtype: bfloat16
  attn_implementation: sdpa
data_config:
  dataset: default
  input_max_len: 32
  max_new_tokens: 8
  batch_size: 1
"""
MINI_RUNNER = '''import torch

from engine.model_runner import ModelRunner


class FiRunner(ModelRunner):
    def __init__(self, runner_settings):
        super().__init__(runner_settings)
'''
MINI_INFER_SH = "#!/usr/bin/env bash\nset -eo pipefail\nexec python3 -m engine.launch --yaml-file-path config/fi.yaml infer.py\n"


def mini_recipe(root: Path, entry: dict) -> Path:
    """A minimal recipe (YAML, runner, infer.sh) carrying the entry's recipe code."""
    recipe = root / entry["id"]
    (recipe / "config").mkdir(parents=True)
    (recipe / "models").mkdir()
    (recipe / "weights").mkdir()
    (recipe / "weights" / "config.json").write_text('{"model_type": "llama"}')
    settings = MINI_YAML.replace("world_size: 1\n", f"world_size: 1\n{entry['yaml_line']}\n") \
        if entry.get("yaml_line") else MINI_YAML
    (recipe / "config" / "fi.yaml").write_text(settings)
    (recipe / "runner_fi.py").write_text(MINI_RUNNER + ("\n\n" + entry["recipe_code"] if entry.get("recipe_code") else ""))
    sh = MINI_INFER_SH.replace("\n", "\r\n") if entry.get("crlf") else MINI_INFER_SH
    (recipe / "infer.sh").write_bytes(sh.encode())
    return recipe
