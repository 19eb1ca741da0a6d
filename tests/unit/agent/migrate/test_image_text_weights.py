"""The input check of an image-text checkpoint's weights against its config.json
(agent.migrate.checkpoint_check.check_image_text_weights): the text decoder's tensors against `text_config`, the
vision tower's and projector's against transformers' image-text class built on the checkpoint's config, the stored
names read as that class reads them (agent.recipe.text_decoder: the current layout and the legacy
`language_model.model.*` one). A check that cannot run says why (never passes silently).

In-process: the stored shapes are those transformers' image-text class gives on the meta device (no weight is
allocated); the faults are config.json fields that disagree with them. One tiny checkpoint is written and read by
check_checkpoint, as the input step reads it."""

from __future__ import annotations

import copy
import json

import pytest

from agent.errors import InputError
from agent.migrate.checkpoint_check import _build_on_meta, check_checkpoint, check_weights_match_config
from agent.testing.tiny_checkpoint import tiny_config

# the legacy layout (llava-1.5-hf and its kin as first published): the decoder stored as a whole causal LM
LEGACY = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
          ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head."))
TYPES = ["llava", "llava-legacy", "gemma3", "mistral3", "qwen2_5_vl", "qwen3_vl_moe", "idefics3"]


def vl(kind: str) -> tuple[dict, dict]:
    """(config.json, tensor name -> shape as the checkpoint stores them) of a tiny checkpoint of the type."""
    model_type = kind.split("-")[0]
    config = tiny_config(model_type, vocab_size=384).to_dict()
    shapes = {name: list(tensor.shape) for name, tensor in _build_on_meta(config).state_dict().items()}
    if kind.endswith("-legacy"):
        def legacy(name):
            return next((old + name[len(new):] for new, old in LEGACY if name.startswith(new)), name)
        shapes = {legacy(name): shape for name, shape in shapes.items()}
        assert any(name.startswith("language_model.model.layers.") for name in shapes)
    return config, shapes


def text_key(config: dict) -> str:
    return next(k for k in ("text_config", "llm_config", "language_config") if isinstance(config.get(k), dict))


def wider_text_mlp(config):
    text = config[text_key(config)]
    key = "moe_intermediate_size" if "moe_intermediate_size" in text else "intermediate_size"
    text[key] *= 2
    return f"config.json's {text_key(config)} makes it"


def more_text_layers(config):
    text = config[text_key(config)]
    text["num_hidden_layers"] += 2
    if isinstance(text.get("layer_types"), list):       # a valid config lists every layer's kind
        text["layer_types"] += text["layer_types"][-1:] * 2
    return f"config.json's {text_key(config)} says num_hidden_layers"


def larger_vocabulary(config):
    config[text_key(config)]["vocab_size"] += 64
    return "vocab_size"


def wider_vision_mlp(config):
    config["vision_config"]["intermediate_size"] *= 2
    return "config.json's vision_config makes it"


FAULTS = {"text mlp": wider_text_mlp, "text layers": more_text_layers, "vocabulary": larger_vocabulary,
          "vision mlp": wider_vision_mlp}


@pytest.mark.parametrize("kind", TYPES)
def test_an_image_text_checkpoint_whose_weights_are_its_config_passes(tmp_path, kind):
    config, shapes = vl(kind)
    assert check_weights_match_config(tmp_path, config, shapes) is None      # checked, and it holds


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("kind", TYPES)
def test_an_image_text_checkpoint_whose_weights_disagree_with_its_config_is_refused(tmp_path, kind, fault):
    config, shapes = vl(kind)
    wrong = copy.deepcopy(config)
    says = FAULTS[fault](wrong)
    with pytest.raises(InputError) as caught:
        check_weights_match_config(tmp_path, wrong, shapes)
    message = str(caught.value)
    assert caught.value.exit_code == 2 and "\n" not in message
    assert "the weights do not match config.json" in message and says in message, message
    if fault in ("text mlp", "vision mlp"):
        # the tensor as the checkpoint stores it, not as the check renamed it
        named = message.split("match config.json: ", 1)[1].split(" is ", 1)[0]
        assert named in shapes, message


def test_weights_of_no_text_decoder_are_refused(tmp_path):
    config, shapes = vl("llava")
    vision = {name: shape for name, shape in shapes.items() if "language_model" not in name and name != "lm_head.weight"}
    with pytest.raises(InputError, match="none of them is the text decoder's"):
        check_weights_match_config(tmp_path, config, vision)


@pytest.mark.parametrize("config,shapes,why", [
    (tiny_config("glm4v", vocab_size=384).to_dict(), {"model.language_model.embed_tokens.weight": [384, 64]},
     "text decoder is not served"),
    (tiny_config("llava", vocab_size=384).to_dict(), {}, "no safetensors header"),
    ({"model_type": "llama", "text_config": {"model_type": "llama"}}, {"model.embed_tokens.weight": [8, 8]},
     "not an image-text model's"),
])
def test_a_check_that_cannot_run_says_why(tmp_path, config, shapes, why):
    assert why in check_weights_match_config(tmp_path, config, shapes)


def test_the_input_step_checks_a_written_image_text_checkpoint_and_says_when_it_cannot(tmp_path, capsys):
    """check_checkpoint on a tiny LLaVA checkpoint as written: accepted, nothing said; its config.json's
    text_config made wider than its weights: refused (before, such a checkpoint passed: composite configs were
    skipped); its weights only as a .bin file: accepted, and the input step says the shapes were not checked."""
    import torch
    from safetensors.torch import load_file

    from agent.testing.tiny_checkpoint import build_tiny_checkpoint

    checkpoint = build_tiny_checkpoint("llava", tmp_path / "llava")
    assert check_checkpoint(checkpoint)["model_type"] == "llava"
    assert "not checked" not in capsys.readouterr().err
    # --quantize w8a8 reads a causal LM's linear layers: an image-text checkpoint is refused in one line
    from agent.migrate.quantize import plan
    with pytest.raises(InputError, match="is an image-text checkpoint \\(llava\\), served by its text decoder"):
        plan(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    original = json.dumps(config)
    config["text_config"]["intermediate_size"] *= 2
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="config.json's text_config makes it"):
        check_checkpoint(checkpoint)
    (checkpoint / "config.json").write_text(original)
    torch.save(load_file(checkpoint / "model.safetensors"), checkpoint / "pytorch_model.bin")
    (checkpoint / "model.safetensors").unlink()
    check_checkpoint(checkpoint)
    assert "the weights are not checked against config.json: no safetensors header" in capsys.readouterr().err
