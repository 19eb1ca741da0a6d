"""Image-text checkpoints served by their text decoder, end to end: `migrator standin -- migrator run CKPT
--output-dir COPY/models` on a tiny image-text checkpoint (transformers' own image-text class, save_pretrained:
the decoder stored under the image-text model's names, a vision tower and a projector beside it) writes a native
framework recipe of the decoder into a copy of the snapshot; its trial run is upstream's launcher under the
stand-in and its parity is against transformers' image-text model on the text-only prompt; the README names the
vision tower as not served and the repo's chat template is the recipe's. Default: a LLaVA-style checkpoint; slow:
Gemma 3, Mistral 3 and Qwen2.5-VL (its M-RoPE reduced; default-path case: the LLaVA one, and
tests/unit/agent/recipe/native/test_image_text.py per step against each image-text model)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agent.measure import reference as upstream
from agent.recipe.targets import REGISTRY
from framework_recipes import MAX_NEW_TOKENS
from migrator_cli import run_cli
from upstream_checkout import _git, copy_checkout


def migrate(tmp_path: Path, model_type: str) -> tuple[Path, dict, Path]:
    checkout = copy_checkout(tmp_path)
    checkpoint = upstream.tiny_checkpoint(model_type, tmp_path / "ckpt")
    name = f"vl_{model_type}"
    proc = run_cli("standin", "--", sys.executable, "-m", "agent.cli", "run", str(checkpoint), "--output-dir",
                   str(checkout / "models"), "--name", name, "--max-new-tokens", str(MAX_NEW_TOKENS),
                   "--transformers-source", "installed", "--max-rounds", "0", "--json", cwd=tmp_path, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1])
    recipe = checkout / "models" / name
    assert summary["status"] == "ok", summary
    status = _git(checkout, "status", "--porcelain", "--untracked-files=all").splitlines()
    assert all(line[3:].startswith(f"models/{name}/") or line[3:] == REGISTRY.as_posix() for line in status), status
    return recipe, summary, checkpoint


def check_served_by_its_text_decoder(recipe: Path, summary: dict, checkpoint: Path, architecture: str,
                                     skipped: tuple[str, ...]) -> None:
    name = recipe.name
    # the native file of the decoder, registered with the decoder's own config class
    assert (recipe / "models" / f"modeling_{name}.py").is_file()
    assert not (recipe / "models" / f"modeling_{name}_framework.py").exists()
    report = json.loads((recipe / "res" / ".migrator" / "migration_report.json").read_text())
    assert report["architecture"] == architecture
    # what is served, under its own field (no auto_map is involved)
    assert "served by its text decoder" in report["vendored"]["text_decoder_note"]
    assert "auto_map_note" not in report["vendored"]
    baseline = json.loads((recipe / "agentic/baseline/baseline_metadata.standin.json").read_text())
    parity = baseline["verification"]["parity"]
    assert parity["ok"] and parity["checked"] and parity["decode_steps_checked"] >= 1, parity
    readme = (recipe / "README.md").read_text()
    assert "本样例仅适配语言解码器" in readme and "视觉编码器暂不覆盖" in readme
    assert f"{architecture} 是图文多模态模型" in readme and "因果语言模型" not in readme
    assert all(f"`{module}`" in readme for module in skipped), readme
    # the repo's chat template is what the recipe's runs tokenize with: the checkpoint's own files
    assert (checkpoint / "chat_template.jinja").is_file() or "chat_template" in (checkpoint / "tokenizer_config.json").read_text()


def test_a_llava_checkpoint_migrates_natively_by_its_text_decoder_under_the_standin(tmp_path):
    recipe, summary, checkpoint = migrate(tmp_path, "llava")
    check_served_by_its_text_decoder(recipe, summary, checkpoint, "LlavaForConditionalGeneration",
                                     ("model.vision_tower", "model.multi_modal_projector"))


@pytest.mark.slow
@pytest.mark.parametrize("model_type,architecture,skipped", [
    ("gemma3", "Gemma3ForConditionalGeneration", ("model.vision_tower", "model.multi_modal_projector")),
    ("mistral3", "Mistral3ForConditionalGeneration", ("model.vision_tower", "model.multi_modal_projector")),
    ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", ("model.visual",)),
])
def test_image_text_checkpoints_migrate_natively_by_their_text_decoder(tmp_path, model_type, architecture, skipped):
    """Slow; default-path case: test_a_llava_checkpoint_migrates_natively_by_its_text_decoder_under_the_standin."""
    recipe, summary, checkpoint = migrate(tmp_path, model_type)
    check_served_by_its_text_decoder(recipe, summary, checkpoint, architecture, skipped)
    if model_type == "qwen2_5_vl":
        assert "M-RoPE" in (recipe / "README.md").read_text()
