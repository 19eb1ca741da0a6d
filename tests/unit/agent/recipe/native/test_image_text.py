"""Image-text checkpoints served by their text decoder (agent.recipe.text_decoder, the one place they are
classified; agent.recipe.native.compose.derive and the self-check go through it).

In-process and fast: the decoder's config, its tensors' names and what is skipped, read from transformers'
image-text class for each type of the table; the loader's renames on the names a checkpoint stores (the current
layout and the legacy `language_model.model.*` one); the M-RoPE reduction proved against transformers (Qwen2.5-VL
on a text-only prompt is Qwen2 with the reduced rope, and a reduction that gives the height / width sections
other positions is not). Per step against the image-text model, under the stand-in (one self-check process):
LLaVA, Gemma 3, Mistral 3 and Qwen2.5-VL by default, the rest of the table slow; a file that reads the decoder
under the wrong prefix fails the same check; a type whose decoder is not written keeps the adapter with its
reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.recipe.text_decoder import NotServedByText, apply_renames, reduce_mrope, text_decoder
from agent.recipe.native.compose import derive
from agent.recipe.native.decide import render_native, selfcheck, selfcheck_jobs
from agent.recipe.native.not_native import NotNative
from agent.testing.tiny_checkpoint import tiny_config
from locations import REPO_ROOT

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"

# image-text type -> (the causal-LM type its decoder is served as, where the decoder sits, what is skipped)
TYPES = {
    "llava": ("llama", "model.language_model", {"model.vision_tower", "model.multi_modal_projector"}),
    "gemma3": ("gemma3_text", "model.language_model", {"model.vision_tower", "model.multi_modal_projector"}),
    "mistral3": ("mistral", "model.language_model", {"model.vision_tower", "model.multi_modal_projector"}),
    "qwen2_5_vl": ("qwen2", "model.language_model", {"model.visual"}),
    "qwen2_vl": ("qwen2", "model.language_model", {"model.visual"}),
    "qwen3_vl": ("qwen3", "model.language_model", {"model.visual"}),
    "qwen3_vl_moe": ("qwen3_moe", "model.language_model", {"model.visual"}),
    "idefics3": ("llama", "model.text_model", {"model.vision_model", "model.connector"}),
    "smolvlm": ("llama", "model.text_model", {"model.vision_model", "model.connector"}),
    "paligemma": ("gemma", "model.language_model", {"model.vision_tower", "model.multi_modal_projector"}),
    "internvl": ("qwen2", "model.language_model", {"model.vision_tower", "model.multi_modal_projector"}),
    "llava_next": ("llama", "model.language_model", {"model.vision_tower", "model.multi_modal_projector",
                                                    "model.image_newline"}),
    "got_ocr2": ("qwen2", "model.language_model", {"model.vision_tower", "model.multi_modal_projector"}),
    "lighton_ocr": ("qwen3", "model.language_model", {"model.vision_encoder", "model.vision_projection"}),
}
PER_STEP_DEFAULT = ("llava", "gemma3", "mistral3", "qwen2_5_vl", "qwen3_vl_moe")


def vl_config(model_type: str) -> dict:
    """A tiny config of the type as its checkpoint's config.json holds it (Qwen-VL's with their M-RoPE sections)."""
    config = tiny_config(model_type, vocab_size=384).to_dict()
    if model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        assert config["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    return config


@pytest.mark.parametrize("model_type", sorted(TYPES))
def test_the_text_decoder_is_read_from_the_image_text_class(model_type):
    causal_type, prefix, skipped = TYPES[model_type]
    decoder = text_decoder(vl_config(model_type))
    assert (decoder.causal_lm_type, decoder.decoder_prefix, set(decoder.skipped)) == (causal_type, prefix, skipped)
    assert decoder.config["hidden_size"] == 64 and "vision_config" not in decoder.config
    assert prefix in decoder.note() and all(name in decoder.note() for name in skipped)


def test_a_causal_lm_checkpoint_has_no_text_decoder():
    assert text_decoder(tiny_config("llama", vocab_size=384).to_dict()) is None


@pytest.mark.parametrize("stored,served", [
    ("model.language_model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("lm_head.weight", "lm_head.weight"),
    # the legacy layout (llava-1.5-hf and its kin as first published): the decoder stored as a whole causal LM
    ("language_model.model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"),
    ("language_model.model.norm.weight", "model.norm.weight"),
    ("language_model.lm_head.weight", "lm_head.weight"),
    # not served: left under the image-text model's name, which the loader skips
    ("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
     "model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight"),
    ("multi_modal_projector.linear_1.weight", "model.multi_modal_projector.linear_1.weight"),
])
def test_the_loader_reads_the_decoder_under_its_image_text_names(stored, served):
    renames = derive(vl_config("llava")).options["CHECKPOINT_RENAMES"]
    assert apply_renames(renames, stored) == served


def test_idefics3_reads_its_decoder_at_text_model():
    renames = text_decoder(vl_config("idefics3")).renames
    assert apply_renames(renames, "model.text_model.layers.0.self_attn.o_proj.weight") == \
        "model.layers.0.self_attn.o_proj.weight"
    assert apply_renames(renames, "model.vision_model.post_layernorm.weight").startswith("model.vision_model.")


@pytest.mark.parametrize("rope,reduced", [
    ({"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}, {"rope_type": "default", "rope_theta": 1e6}),
    ({"type": "mrope", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}, {"rope_type": "default", "rope_theta": 1e6}),
    ({"rope_type": "default", "rope_theta": 5e5, "mrope_section": [24, 20, 20], "mrope_interleaved": True},
     {"rope_type": "default", "rope_theta": 5e5}),
    ({"rope_type": "default", "rope_theta": 1e6}, {"rope_type": "default", "rope_theta": 1e6}),
])
def test_mrope_keys_are_reduced_to_a_1d_rope(rope, reduced):
    text, note = reduce_mrope({"rope_parameters": rope})
    assert text["rope_parameters"] == reduced
    assert (note is not None) is ("mrope_section" in rope)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_on_a_text_only_prompt_is_the_1d_rope_of_the_causal_lm(model_type):
    """transformers' image-text model on a text-only prompt equals its decoder's causal-LM type with the reduced
    rope, weights read by the loader's renames; the same model given the positions an image grid gives the
    height / width sections (not the token's position) does not: the test tells the two apart."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = vl_config(model_type)
    decoder = text_decoder(config)
    torch.manual_seed(0)
    vl = getattr(transformers, decoder.image_text_class)._from_config(
        AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"}),
        dtype=torch.float32).eval()
    text = dict(decoder.config)
    causal = AutoModelForCausalLM.from_config(AutoConfig.for_model(text.pop("model_type"), **text),
                                              dtype=torch.float32).eval()
    stored = {apply_renames(decoder.renames, k): v for k, v in vl.state_dict().items()}
    missing, _ = causal.load_state_dict({k: v for k, v in stored.items() if not k.startswith(decoder.skipped)},
                                        strict=False)
    assert not [k for k in missing if k != "lm_head.weight" or not decoder.config["tie_word_embeddings"]]
    ids = torch.randint(4, 384, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = vl(input_ids=ids).logits
        got = causal(input_ids=ids).logits
        positions = torch.arange(11)[None]
        grid = torch.stack([positions, torch.zeros_like(positions), torch.zeros_like(positions)])
        wrong = vl(input_ids=ids, position_ids=grid).logits
    scale = float(expected.abs().max())
    assert float((got - expected).abs().max()) <= 1e-5 * scale
    assert float((wrong - expected).abs().max()) > 1e-2 * scale


def test_a_key_the_decoders_code_fixes_is_read_with_that_value_as_its_default():
    """Qwen3-VL-MoE's text router always divides the top-k weights by their sum (transformers'
    Qwen3VLMoeTextTopKRouter); its config has no norm_topk_prob, the key qwen3_moe's arithmetic reads: the decoder's
    causal-LM config sets it True, and the file reads it with that default from the decoder's own config class (which
    the recipe registers: it has no such attribute)."""
    from agent.recipe.native.parts.part import Expr

    decoder = text_decoder(vl_config("qwen3_vl_moe"))
    assert decoder.config["norm_topk_prob"] is True and "norm_topk_prob" not in decoder.own_config
    assert decoder.fixed_in_code == (("norm_topk_prob", True),)
    assert derive(vl_config("qwen3_vl_moe"))["moe"].options["RENORMALIZE"] == \
        Expr('getattr(config, "norm_topk_prob", True)')
    # a causal-LM checkpoint's own key is read as it is
    assert derive(tiny_config("qwen3_moe", vocab_size=384).to_dict())["moe"].options["RENORMALIZE"] == \
        Expr("config.norm_topk_prob")


def test_a_decoder_with_no_causal_lm_type_is_not_native_with_its_reason():
    config = tiny_config("glm4v", vocab_size=384).to_dict()
    with pytest.raises(NotServedByText, match="glm4v_text has no causal-LM class"):
        text_decoder(config)
    with pytest.raises(NotNative, match="image-text model: its text decoder glm4v_text"):
        derive(config)


# ---- per step against transformers' image-text model, under the stand-in -----------------------------------
def ctx_for(model_type: str) -> dict:
    return {"model_name": f"tiny_{model_type}", "framework_class": "TinyForCausalLM", "display_name": model_type,
            "model_class": "ForConditionalGeneration", "transformers_version": "5.0.0"}


def per_step(model_types, tmp_path: Path, fault=None) -> dict:
    """The float32 job of each type's checkpoint config (held to its image-text model), in one process."""
    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    jobs = []
    for model_type in model_types:
        config = vl_config(model_type)
        composition = derive(config)
        source = render_native(ctx_for(model_type), composition)
        if fault is not None:
            source = fault(source)
        path = tmp_path / f"modeling_tiny_{model_type}.py"
        path.write_text(source)
        jobs.append(selfcheck_jobs(config, composition.checked_variants, str(path), "TinyForCausalLM")[0][1])
    return dict(zip(model_types, selfcheck(jobs, SNAPSHOT)))


def test_text_decoders_match_their_image_text_model_per_step(tmp_path):
    results = per_step(PER_STEP_DEFAULT, tmp_path)
    assert {t: r["reason"] for t, r in results.items() if not r["ok"]} == {}
    assert all(r["max_rel"] < 1e-4 for r in results.values())


@pytest.mark.slow
def test_every_text_decoder_of_the_table_matches_its_image_text_model_per_step(tmp_path):
    """Slow: the table's other types; its default-path case is test_text_decoders_match_their_image_text_model_per_step."""
    others = [t for t in TYPES if t not in PER_STEP_DEFAULT]
    results = per_step(others, tmp_path)
    assert {t: r["reason"] for t, r in results.items() if not r["ok"]} == {}


def _wrong_prefix(source: str) -> str:
    # the decoder looked for where another image-text class keeps it (idefics3's model.text_model): the
    # checkpoint's model.language_model.* (and legacy language_model.model.*) tensors are then not the decoder's
    stored = "^model\\\\.language_model\\\\."
    assert source.count(stored) == 2
    return source.replace(stored, "^model\\\\.text_model\\\\.")


def test_a_decoder_read_under_the_wrong_prefix_fails_the_check(tmp_path):
    results = per_step(["llava"], tmp_path, fault=_wrong_prefix)
    assert not results["llava"]["ok"]
    assert "the checkpoint has no tensor for" in results["llava"]["reason"]


def _temporal_section_only(source: str) -> str:
    # M-RoPE reduced wrongly: the temporal section (mrope_section[0] = 2 frequencies) by the token's position, the
    # height / width sections at position 0 (as an image grid's first row would give them)
    line = "freqs, scaling = torch.outer(positions, inv_freq), 1.0\n"
    assert source.count(line) == 1
    indent = source.split(line)[0].rsplit("\n", 1)[1]
    return source.replace(line, line + f"{indent}freqs[:, 2:] = 0.0\n")


def test_an_mrope_reduced_wrongly_fails_the_check(tmp_path):
    results = per_step(["qwen2_5_vl"], tmp_path, fault=_temporal_section_only)
    assert not results["qwen2_5_vl"]["ok"]
    assert "logits differ from transformers'" in results["qwen2_5_vl"]["reason"]


def _never_renormalised(source: str) -> str:
    # the top-k weights left as the softmax gives them (qwen3_moe's default norm_topk_prob False)
    line = 'self.renormalize = getattr(config, "norm_topk_prob", True)'
    assert source.count(line) == 1, [ln for ln in source.splitlines() if "renormalize =" in ln]
    return source.replace(line, "self.renormalize = False")


@pytest.mark.slow
def test_a_qwen3_vl_moe_decoder_that_does_not_renormalise_fails_the_check(tmp_path):
    """Slow (a second self-check process); the default-path case is
    test_text_decoders_match_their_image_text_model_per_step (qwen3_vl_moe among them, renormalising)."""
    results = per_step(["qwen3_vl_moe"], tmp_path, fault=_never_renormalised)
    assert not results["qwen3_vl_moe"]["ok"]
    assert "logits differ from transformers'" in results["qwen3_vl_moe"]["reason"]


def test_a_conversion_of_the_vision_tower_is_dropped_and_one_of_the_decoder_refused():
    """qianfan_ocr's mapping splits the vision tower's fused qkv (a converter, not a rename): its decoder is served;
    the same converter on names the decoder has is not a rename the loader writes."""
    from agent.recipe.text_decoder import stored_name_renames

    decoder = text_decoder(tiny_config("qianfan_ocr", vocab_size=384).to_dict())
    assert decoder.causal_lm_type == "qwen3"
    assert apply_renames(decoder.renames, "language_model.model.layers.0.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(NotServedByText, match="converts the text decoder's tensors"):
        stored_name_renames("qianfan_ocr", ["model.language_model.layers.0.attention.q_proj.weight"])


# ---- the recipe rendered for an image-text checkpoint -----------------------------------------------------------
def render_context(tmp_path: Path, config: dict, decision: dict, source) -> dict:
    """The framework target's render context of a tiny checkpoint of the type (its config.json in tmp_path), with
    the native decision the workflow recorded (agent.workflow.nodes.node_decide_native)."""
    import json

    from agent.recipe.render import template_context
    from agent.recipe.routing import route
    from agent.recipe.spec import RecipeSpec
    from agent.recipe.targets import TARGETS

    (tmp_path / "config.json").write_text(json.dumps(config))
    family = route(config.get("text_config") or config)
    spec = RecipeSpec(model_name="tiny", model_path=str(tmp_path), model_source=str(tmp_path),
                      architecture=(config.get("architectures") or ["TinyForConditionalGeneration"])[0], family=family.name, dtype="bfloat16",
                      input_max_len=64, max_new_tokens=8, transformers_version="5.0.0")
    ctx = dict(spec.context(), native_decision=decision, native_source=source)
    return template_context(ctx, family, TARGETS["framework"])


def test_an_image_text_checkpoint_whose_self_check_failed_is_refused_at_render_with_the_reason(tmp_path):
    """Cheap (no self-check runs): the decision a failed self-check records (the adapter, with the check's line) is
    what render refuses on, in one line that names the image-text class and the check's reason — the adapter would
    run a causal LM's code on the image-text checkpoint's names; the same checkpoint with a passed check renders."""
    from agent.errors import UnsupportedModelError

    failed = {"native": False, "parts": {}, "fell_back": "adapter",
              "reason": "self-check failed: logits differ from transformers' at decode step 2 (max rel 3.1e-01)"}
    with pytest.raises(UnsupportedModelError) as caught:
        render_context(tmp_path, vl_config("llava"), failed, None)
    message = str(caught.value)
    assert caught.value.exit_code == 3 and "\n" not in message
    assert message.startswith("LlavaForConditionalGeneration: image-text model served by its text decoder (llama)")
    assert "logits differ from transformers' at decode step 2" in message
    # a decision with no file written (the target writes no native model): refused too, saying so
    with pytest.raises(UnsupportedModelError, match="the target writes no native model"):
        render_context(tmp_path, vl_config("llava"), None, None)
    passed = {"native": True, "parts": {}, "selfcheck_max_rel": 1e-6}
    out = render_context(tmp_path, vl_config("llava"), passed, "# the file")
    assert out["image_text"]["image_text_class"] == "LlavaForConditionalGeneration"


@pytest.mark.parametrize("model_type", ["llava", "qwen2_5_vl"])
def test_the_readme_says_an_image_text_checkpoint_is_one_served_by_its_text_decoder(tmp_path, model_type):
    """The README's overview names what the checkpoint is (an image-text model, served by its text decoder), never a
    causal language model; a causal-LM checkpoint's still says it is one."""
    from agent.recipe.templating import environment

    passed = {"native": True, "parts": {}, "selfcheck_max_rel": 1e-6, "fused": [], "not_fused": []}

    def overview(config):
        out = render_context(tmp_path, config, passed, "# the file")
        readme = environment().get_template("framework/README.md.j2").render(**out)
        return readme.split("## 概述", 1)[1].strip().split("\n", 1)[0], readme

    first, readme = overview(vl_config(model_type))
    assert "是图文多模态模型" in first and "因果语言模型" not in readme
    assert f"语言解码器（{text_decoder(vl_config(model_type)).text_type}）提供文本推理" in first
    assert "视觉编码器暂不覆盖" in readme
    first, readme = overview(tiny_config("llama", vocab_size=384).to_dict())
    assert "结构的因果语言模型" in first and "图文多模态" not in readme
