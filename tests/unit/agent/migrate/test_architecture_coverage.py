"""Coverage of transformers' causal-LM types.

- Vendoring is closed under imports: types whose causal-LM class lives in another model's module
  (exaone -> llama's modeling, sarvam_mla -> deepseek_v3's, ...) get that model's configuration
  vendored too, and the vendored files import nothing from `transformers.models.*` but the auto
  registry. Their parity is checked in one fresh process against AutoModelForCausalLM.
- Refusals say the true reason, derived from the class's code and the config (table below).
- The runner feeds the whole sequence to models whose generation step wants it (openai-gpt, cpmant),
  and builds the step with the model's own prepare_inputs_for_generation where it feeds other
  tokens (xlm appends its mask token).
- The untrained-weights figure never depends on the reference running.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from locations import REPO_ROOT
from migrator_cli import run_cli

LEFTOVER = re.compile(r"^\s*(from|import) transformers\.models\.(?!auto[ .])", re.M)

# model_type -> the module of another model that vendoring must pull in (and the file it becomes)
CLOSURE_CASES = {
    "exaone": "configuration_llama.py",
    "internlm3": "configuration_llama.py",
    "iquestcoder": "configuration_llama.py",
    "sarvam_mla": "configuration_deepseek_v3.py",
    "sarvam_moe": "configuration_glm4_moe.py",
    # Its own configuration, imported absolutely (`from transformers.models.llama4.configuration_llama4
    # import Llama4VisionConfig`): pointed at the vendored configuration, nothing more to vendor.
    "llama4_text": "configuration_llama4_text.py",
}

CLOSURE_PROBE = textwrap.dedent("""
    import importlib, json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from transformers import AutoModelForCausalLM
    from engine.loading import check_loading_info, reuse_checkpoint_conversions
    results = {}
    for name, ckpt, model_cls, config_cls in json.loads(sys.argv[1]):
        configuration = importlib.import_module(f"models.configuration_{name}")
        modeling = importlib.import_module(f"models.modeling_{name}")
        config = getattr(configuration, config_cls).from_pretrained(ckpt)
        Model = getattr(modeling, model_cls)
        reuse_checkpoint_conversions(Model, config)
        ours, info = Model.from_pretrained(ckpt, config=config, dtype=torch.float32, output_loading_info=True)
        check_loading_info(info, ckpt)
        ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        ids = torch.tensor([[5, 17, 33, 65, 101, 7, 9]])
        with torch.inference_mode():
            diff = (ours.eval()(ids).logits - ref.eval()(ids).logits).abs().max().item()
            same = torch.equal(ours.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False),
                               ref.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False))
        loaded = sorted(m for m in sys.modules if m.startswith("models."))
        results[name] = {"diff": diff, "tokens_equal": same, "module": type(ours).__module__,
                         "config_module": type(config).__module__, "loaded": loaded}
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def closure_recipe(tiny_checkpoints, tmp_path_factory):
    """One recipe dir holding every CLOSURE_CASES type, vendored under its own name."""
    from agent.migrate.vendor import locate_source, read_config, vendor_source

    recipe = tmp_path_factory.mktemp("closure")
    vendored = {}
    for model_type in CLOSURE_CASES:
        ckpt = tiny_checkpoints(model_type)
        source = locate_source(read_config(ckpt), ckpt)
        vendored[model_type] = (ckpt, source, vendor_source(source, recipe, model_type))
    return recipe, vendored


@pytest.mark.parametrize("model_type,dependency", sorted(CLOSURE_CASES.items()))
def test_vendoring_takes_the_closure(model_type, dependency, closure_recipe):
    recipe, vendored = closure_recipe
    _, source, result = vendored[model_type]
    # The causal-LM class is another model's: its configuration is vendored as well ...
    written = {path.name for path in result.files.values()}
    assert {f"modeling_{model_type}.py", f"configuration_{model_type}.py", dependency} <= written
    modeling = (recipe / "models" / f"modeling_{model_type}.py").read_text()
    assert f"from models.{dependency[:-3]} import" in modeling
    # ... and no vendored file imports a model's code from transformers any more.
    for path in (recipe / "models").glob("*.py"):
        assert not LEFTOVER.search(path.read_text()), (path.name, LEFTOVER.search(path.read_text()).group(0))
    assert "VendoredImportsCommand" in result.codemods[f"modeling_{model_type}.py"]


def test_closure_types_match_transformers(closure_recipe):
    """All CLOSURE_CASES in one fresh process: vendored classes only, same logits and tokens."""
    recipe, vendored = closure_recipe
    cases = [[t, str(ckpt), s.model_class, s.config_class] for t, (ckpt, s, _) in vendored.items()]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(recipe), str(REPO_ROOT)])
    proc = subprocess.run([sys.executable, "-c", CLOSURE_PROBE, json.dumps(cases)], cwd=recipe, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for model_type, dependency in CLOSURE_CASES.items():
        got = results[model_type]
        assert got["diff"] <= 1e-4 and got["tokens_equal"], (model_type, got)
        assert got["module"] == f"models.modeling_{model_type}"
        assert f"models.{dependency[:-3]}" in got["loaded"], got


def test_vendored_init_weights_fills_non_persistent_buffers(tiny_checkpoints, tmp_path):
    """falcon_h1: FalconH1Model's `_init_weights` fills its layers' non-persistent `mup_vector`.
    transformers skips it for custom code (a class outside `transformers.*`) on a module with no
    tensors of its own, so the vendored copy kept `torch.empty` there (NaN logits) until
    TransformersInitWeightsCommand declared the vendored classes transformers code."""
    from agent.migrate.vendor import locate_source, read_config, vendor_source

    ckpt = tiny_checkpoints("falcon_h1")
    source = locate_source(read_config(ckpt), ckpt)
    result = vendor_source(source, tmp_path, "falcon_h1")
    assert "TransformersInitWeightsCommand" in result.codemods["modeling_falcon_h1.py"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO_ROOT)])
    case = [["falcon_h1", str(ckpt), source.model_class, source.config_class]]
    proc = subprocess.run([sys.executable, "-c", CLOSURE_PROBE, json.dumps(case)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])["falcon_h1"]
    assert got["diff"] <= 1e-4 and got["tokens_equal"], got
    assert got["module"] == "models.modeling_falcon_h1"


def test_contract_check_names_a_configuration_class(tmp_path):
    """Exit 7 (VendorError) when a configuration class would still come from transformers."""
    from agent.errors import VendorError
    from agent.migrate.vendor import ModelSource, vendor_source

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "configuration_x.py").write_text(
        "from transformers import PreTrainedConfig\nclass XConfig(PreTrainedConfig):\n    model_type = 'x'\n")
    # `transformers.models.bert` is a package, not a module of a model: nothing to vendor, so it stays.
    (repo / "modeling_x.py").write_text(
        "from transformers.models.bert import BertConfig\nfrom .configuration_x import XConfig\n\n\n"
        "class XForCausalLM:\n    config_class = BertConfig\n")
    source = ModelSource(model_type="x", architecture="XForCausalLM", model_class="XForCausalLM",
                         config_class="XConfig", modeling_module="hf_remote_code.modeling_x",
                         configuration_module="hf_remote_code.configuration_x",
                         modeling_file=repo / "modeling_x.py", configuration_file=repo / "configuration_x.py",
                         origin="remote code")
    with pytest.raises(VendorError, match="transformers.models.bert.BertConfig") as caught:
        vendor_source(source, tmp_path / "recipe", "x")
    assert caught.value.exit_code == 7


# ---------------------------------------------------------------------------------------------
# Refusals: the true reason, from code and config
# ---------------------------------------------------------------------------------------------

def _config(model_type: str, architecture: str | None = None, **changes) -> dict:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.for_model(model_type).to_dict()
    config["architectures"] = [architecture or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    config.update(changes)
    return config


REFUSALS = [
    # (model_type, config changes, expected reason, words it must not contain)
    ("bert", {}, "encoder-only model", "multimodal"),
    ("bert-generation", {}, "encoder-only model", "multimodal"),   # was "multimodal" by its class name
    ("roberta", {}, "encoder-only model", None),
    ("bart", {}, "decoder half of an encoder-decoder model", None),
    ("whisper", {}, "decoder half of an encoder-decoder model", "multimodal"),
    ("git", {}, "image-text model (GitForCausalLM.forward takes pixel_values)", "text-only"),
    ("gemma4_unified_assistant", {}, "draft model for assisted generation", None),
    # quantized: what is served (compressed-tensors W8A8 int8) or converted (awq, fp8, ...) is no refusal; these are
    # (agent.migrate.quantization)
    ("llama", {"quantization_config": {"quant_method": "hqq"}},
     "weights are quantized: quant_method hqq, which the migrator neither serves nor converts", "unquantized model"),
    ("llama", {"quantization_config": {"quant_method": "awq", "version": "exllama"}},
     "weights are quantized: AWQ (quant_method awq, version exllama), which the migrator neither", None),
    ("llama", {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "channel"},
                    "input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}}}},
     "compressed-tensors (int4 W4A8 dynamic, format pack-quantized)", "use the original unquantized model"),
]


@pytest.mark.parametrize("model_type,changes,expected,not_expected", REFUSALS,
                         ids=[r[0] + ("-" + next(iter(r[1])) if r[1] else "") for r in REFUSALS])
def test_refusal_says_the_true_reason(model_type, changes, expected, not_expected):
    from agent.errors import UnsupportedModelError
    from agent.migrate.vendor import locate_source

    with pytest.raises(UnsupportedModelError) as caught:
        locate_source(_config(model_type, **changes))
    message = str(caught.value)
    assert caught.value.exit_code == 3 and "\n" not in message
    assert expected in message, message
    assert not_expected is None or not_expected not in message.split("; supported")[0]


# Image-text checkpoints as their config.json has them (transformers' own config classes, architectures as the
# hub's): (model_type, architecture, the text decoder's model_type or None, the causal-LM type it is served as or
# None: refused)
IMAGE_TEXT = [
    ("llava", "LlavaForConditionalGeneration", "llama", "llama"),
    ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl_text", "qwen2"),    # M-RoPE reduced
    ("mistral3", "Mistral3ForConditionalGeneration", "mistral", "mistral"),
    ("paligemma", "PaliGemmaForConditionalGeneration", "gemma", "gemma"),
    ("idefics3", "Idefics3ForConditionalGeneration", "llama", "llama"),
    ("gemma3", "Gemma3ForConditionalGeneration", "gemma3_text", "gemma3_text"),     # a class in the causal-LM mapping
    ("cohere2_vision", "Cohere2VisionForConditionalGeneration", "cohere2", "cohere2"),  # parallel block, NoPE layers
    ("llama4", "Llama4ForConditionalGeneration", "llama4_text", "llama4_text"),     # chunked attention, NoPE layers
    # not in the issue's list: a text decoder the generator does not write, one with no causal-LM class, none of
    # its own, an image input not named pixel_values
    ("gemma3n", "Gemma3nForConditionalGeneration", "gemma3n_text", None),
    ("glm4v", "Glm4vForConditionalGeneration", "glm4v_text", None),
    ("chameleon", "ChameleonForConditionalGeneration", None, None),
    ("fuyu", "FuyuForCausalLM", "persimmon", "persimmon"),             # persimmon is native too
    ("phi4_multimodal", "Phi4MultimodalForCausalLM", None, None),
]


@pytest.mark.parametrize("model_type,architecture,text_type,served_as", IMAGE_TEXT, ids=[r[0] for r in IMAGE_TEXT])
def test_an_image_text_checkpoint_is_served_by_its_text_decoder_or_named_with_it(model_type, architecture, text_type,
                                                                                 served_as):
    """Served: the source is the decoder's causal-LM class and the decoder's own config class (which reads
    config.json's text_config), the note names what is not served. Refused: one true line, an image-text model,
    why, its text decoder's model_type and whether the native generator writes it; not 'encoder-only'."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from agent.errors import UnsupportedModelError
    from agent.migrate.vendor import locate_source

    config = _config(model_type, architecture)
    if served_as is not None:
        source = locate_source(config)
        assert source.model_class == MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[served_as] and source.model_type == served_as
        config_cls = getattr(transformers, source.config_class)
        assert config_cls.model_type == text_type
        assert source.architecture == architecture and "served by its text decoder" in source.text_decoder_note
        # the vision tower named as not served (model.visual, model.vision_tower, llama4's vision_model)
        assert "vis" in source.text_decoder_note.split("not served: ")[1] and source.note is None
        vendored = source.vendored()        # the report's field says what it is; no auto_map is involved
        assert vendored["text_decoder_note"] == source.text_decoder_note and "auto_map_note" not in vendored
        return
    with pytest.raises(UnsupportedModelError) as caught:
        locate_source(config)
    message = str(caught.value)
    assert caught.value.exit_code == 3 and "\n" not in message
    assert message.startswith(f"{architecture}: image-text model (") and "served by their text decoder only" in message
    assert "encoder-only" not in message and "text-only" not in message
    if text_type is None:
        assert "its text decoder has no separate config" in message or "no separate text decoder" in message, message
    else:
        assert f"its text decoder is {text_type}" in message, message
    if text_type is not None and text_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        assert f"{text_type}, which has no causal-LM class in transformers" in message, message
    assert "a type the native generator writes" not in message, message


def test_a_remote_code_image_text_checkpoint_is_not_sent_to_trust_remote_code():
    """InternVL-style remote code (auto_map without AutoModelForCausalLM, llm_config): --trust-remote-code would only
    lead to the same refusal, so the line says what it is whatever the flag."""
    from agent.errors import UnsupportedModelError
    from agent.migrate.vendor import locate_source

    config = {"model_type": "internvl_chat", "architectures": ["InternVLChatModel"],
              "auto_map": {"AutoConfig": "configuration_internvl_chat.InternVLChatConfig",
                           "AutoModel": "modeling_internvl_chat.InternVLChatModel"},
              "vision_config": {"model_type": "intern_vit_6b"}, "llm_config": {"model_type": "qwen2"}}
    for trust in (False, True):
        with pytest.raises(UnsupportedModelError) as caught:
            locate_source(config, trust_remote_code=trust)
        message = str(caught.value)
        assert message.startswith("InternVLChatModel: image-text model (its auto_map names no AutoModelForCausalLM); "
                                  "its text decoder is qwen2 (Qwen2ForCausalLM), a type the native generator writes")
        assert "--trust-remote-code" not in message


def test_an_audio_text_checkpoint_is_not_told_to_find_a_text_only_one():
    from agent.errors import UnsupportedModelError
    from agent.migrate.vendor import refusal_reason

    class AudioForCausalLM:
        def forward(self, input_ids, input_features=None):
            pass

    reason = refusal_reason({"model_type": "x"}, AudioForCausalLM)
    assert reason == "multimodal model (AudioForCausalLM.forward takes input_features): checkpoints with audio inputs are not served"
    assert UnsupportedModelError


def test_encoder_decoder_checkpoint_is_refused_as_a_whole():
    from agent.errors import UnsupportedModelError
    from agent.migrate.vendor import locate_source

    with pytest.raises(UnsupportedModelError, match=r"encoder-decoder model \(is_encoder_decoder: true\)"):
        locate_source(_config("bart", "BartForConditionalGeneration"))


@pytest.mark.parametrize("model_type,changes", [
    ("bert-generation", {"is_decoder": True}),   # a causal decoder when configured as one
    ("bert", {"is_decoder": True}),
    ("trocr", {}),                               # TrOCRForCausalLM sets config.is_decoder itself
    ("qwen3_5", {}),                             # text-only class of a multimodal family's config
    ("xlm", {}),
])
def test_servable_types_are_not_refused(model_type, changes):
    from agent.migrate.vendor import locate_source

    source = locate_source(_config(model_type, **changes))
    assert source.model_type == model_type


# ---------------------------------------------------------------------------------------------
# Run failures the coverage sweep found, at their cause
# ---------------------------------------------------------------------------------------------


def hand_built_runner(model, name: str, max_new_tokens: int, exe_mode: str = "eager"):
    """The base ModelRunner around a transformers model, without a checkpoint: `use_model` asks the
    model how it steps, as init_model does."""
    import logging

    import torch

    from engine.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    runner.__dict__.update(
        exe_mode=exe_mode, max_new_tokens=max_new_tokens, device=torch.device("cpu"), logger=logging.getLogger(name),
        model_name=name, parity_dump=None, rank=0, dtype=torch.float32)
    tokenizer = types.SimpleNamespace(batch_decode=lambda ids, **_: [str(r) for r in ids.tolist()], pad_token_id=0,
                                      eos_token_id=None)
    runner.use_model(model, tokenizer)
    runner.eos_ids = torch.tensor([], dtype=torch.long)    # no EOS: every test generates all its tokens
    return runner


def generate_both(runner, ids, tokens: int):
    """The engine's greedy tokens (runner.last_generate_ids) and generate()'s, for prompt `ids`."""
    import torch
    from transformers import GenerationConfig

    from engine.generate import generate

    generate(runner, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "generate_ids": ids.new_zeros((1, 0)),
                      "finished": torch.zeros(1, dtype=torch.bool), "is_prefill": True,
                      "cache": runner.new_cache(1, ids.shape[1] + tokens)})
    with torch.inference_mode():
        reference = runner.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=GenerationConfig(
            do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens))[:, ids.shape[1]:]
    assert len(set(reference[0].tolist())) > 2, reference   # not a constant stream: it proves something
    return runner.last_generate_ids, reference


def test_engine_generates_xlm_as_transformers_does():
    """The engine's loop on xlm (its own step: sequence + mask token, the cache filled in place)
    gives generate()'s greedy tokens. mask_token_id 7, not the pad id 0: with the tiny default
    (mask = pad = 0) every token is 0 on both sides, which would prove nothing."""
    import torch
    from transformers import AutoModelForCausalLM

    from agent.testing.tiny_checkpoint import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("xlm", vocab_size=384, mask_token_id=7)).eval()
    runner = hand_built_runner(model, "xlm", 8)
    assert runner.traits.builds_own_step
    ours, reference = generate_both(runner, torch.tensor([[5, 17, 33, 65, 101, 7, 9]]), 8)
    assert ours.tolist() == reference.tolist()


# model_type -> (tiny config overrides transformers itself generates with, the cache argument):
#   rwkv             its recurrent `state`, returned by each forward and passed back the next step;
#   xlnet            its `mems`, the same way, through its own step (perm_mask, target_mapping);
#   recurrent_gemma  recurrent state in its modules and a Cache it fills but does not return (3
#                    layers: its block pattern is recurrent, recurrent, attention; with 2, no
#                    attention layer, transformers' own generate fails);
#   mamba            its conv / SSM states in the Cache; its own step gives a decode step no
#                    attention mask (its mixer would broadcast the new token over the whole mask).
STATE_CASES = {"rwkv": ({}, "state"), "xlnet": ({"d_head": 16}, "mems"),
               "recurrent_gemma": ({"num_hidden_layers": 3}, "cache"), "mamba": ({}, "cache")}


@pytest.mark.parametrize("model_type", sorted(STATE_CASES))
def test_engine_carries_the_models_state_as_transformers_does(model_type, tmp_path, monkeypatch):
    """The engine asks the model what one step hands the next (its forward's cache argument, what
    its outputs return under that name, the cache generate() would give it) and gets generate()'s
    greedy tokens. With the migrator's parity dump on, the dump's extra forwards (prompt logits,
    prompt NLL, without the cache) run after the loop: between two steps they cleared
    recurrent_gemma's state, and the dumped tokens were not the model's."""
    import torch
    from transformers import AutoModelForCausalLM

    from agent.testing.tiny_checkpoint import tiny_config
    from engine.parity_dump import PARITY_DUMP_ENV

    overrides, cache_kwarg = STATE_CASES[model_type]
    monkeypatch.setenv(PARITY_DUMP_ENV, str(tmp_path / "dump.pt"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=384, **overrides)).eval()
    runner = hand_built_runner(model, model_type, 16)
    assert runner.cache_kwarg == cache_kwarg == runner.traits.cache_kwarg
    ids = torch.tensor([[5, 17, 33, 65, 101, 7, 9]])
    ours, reference = generate_both(runner, ids, 16)
    assert ours.tolist() == reference.tolist()
    dump = torch.load(tmp_path / "dump.pt", weights_only=True)
    assert dump["generate_ids"].tolist() == reference.tolist()
    with torch.inference_mode():
        prompt_logits = model(ids, use_cache=False).logits[:, -1, :]
    torch.testing.assert_close(dump["logits"], prompt_logits)
    assert dump["prompt_nll"] > 0


@pytest.mark.parametrize("model_type,overrides,reason", [
    ("rwkv", {}, "carries its own state from step to step (`state`"),
    ("xlnet", {"d_head": 16}, "carries its own state from step to step (`mems`"),
    ("xlm", {}, "its own generation step (prepare_inputs_for_generation)")])
def test_graph_mode_falls_back_to_eager_where_a_static_cache_cannot_apply(model_type, overrides, reason):
    """A compiled decode step runs on a StaticCache: a model whose step carries another state, or
    builds its own inputs on a growing cache, runs eager, and the log says why."""
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import StaticCache

    from agent.testing.tiny_checkpoint import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=384, **overrides)).eval()
    runner = hand_built_runner(model, model_type, 8, exe_mode="graph")
    warnings = []
    runner.logger = types.SimpleNamespace(warning=warnings.append, info=lambda msg: None)
    runner.use_model(model, runner.tokenizer, {"dynamic": False})
    assert runner.exe_mode == "eager" and runner.graph is None
    assert len(warnings) == 1 and reason in warnings[0] and "running eager instead" in warnings[0], warnings
    assert not isinstance(runner.new_cache(1, 16), StaticCache)


def test_shrink_keeps_a_repeated_pattern_of_layer_kinds_whole():
    """The parity check's shrunk config of a 4-layer recurrent_gemma: block_types [recurrent,
    recurrent, attention] repeats over the layers, so 3 layers (every kind), the pattern kept.
    Cut to 2 it had no attention layer and neither transformers nor the recipe could run it."""
    from agent.recipe.shrink import shrink_config

    pattern = ["recurrent", "recurrent", "attention"]
    config = {"num_hidden_layers": 4, "block_types": pattern, "hidden_size": 64}
    assert shrink_config(config) == {"num_hidden_layers": 3}
    # Per-layer lists (one entry a layer) are still cut to the prefix.
    assert shrink_config({"num_hidden_layers": 6, "layer_types": ["a", "a", "b", "a", "a", "b"]}) == \
        {"num_hidden_layers": 3, "layer_types": ["a", "a", "b"]}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["xlm", "cpmant", "openai-gpt", "lfm3", "moshi",
                                        "rwkv", "xlnet", "recurrent_gemma", "mamba",
                                        # from the full --all sweep: tied layer counts (dory), a layer
                                        # count derived from cycles (hrm_text), mamba's mask (falcon_mamba)
                                        "dory", "hrm_text", "falcon_mamba", "gptj", "codegen"])
def test_issue_run_failures_migrate_with_parity(model_type, tmp_path):
    """The run failures the coverage sweep found, each through `scripts/try_architectures.py` (full mode:
    `migrator run` + parity from the recipe's baseline)."""
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "try_architectures.py"), model_type,
                           "--out", str(tmp_path), "--json", str(tmp_path / "rows.json")],
                          capture_output=True, text=True, timeout=1800, cwd=REPO_ROOT)
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows[0]["status"] == "parity", (rows, proc.stdout[-2000:], proc.stderr[-2000:])
    assert rows[0]["max_abs_logits_diff"] <= 1e-4 and rows[0]["greedy_tokens_equal"]


PARITY_WITH_FAILING_REFERENCE = textwrap.dedent("""
    import sys
    import transformers

    def fails(cls, *args, **kwargs):  # stands in for a checkpoint transformers cannot run
        raise ValueError("get_seq_length can only be called on Attention layers")

    transformers.AutoModelForCausalLM.from_pretrained = classmethod(fails)
    from agent.measure.precision import main
    sys.exit(main(["--record", sys.argv[1], "--checkpoint", sys.argv[2]]))
""")


@pytest.mark.slow  # the untrained-weight verdict is also checked by tests/unit/agent/measure/test_parity.py
def test_untrained_weights_are_judged_without_the_reference_simulated_failure(working_recipe_source, working_recipe):
    """The reference fails to load (simulated: transformers' loader raises, as it does for lfm3 with
    two layers): the precision check says why it could not compare instead of crashing, and the
    recipe's own logits (its parity dump) still say the weights are untrained."""
    from agent.measure.verify import recipe_nll
    from agent.recipe.recipe import Recipe

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    runs = sorted((working_recipe_source / ".migrator" / "runs").glob("run_*"))
    checkpoint = Recipe.at(working_recipe_source).checkpoint_dir()
    proc = subprocess.run([sys.executable, "-c", PARITY_WITH_FAILING_REFERENCE, str(runs[-1] / "precision"),
                           str(checkpoint)], cwd=working_recipe, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parity = json.loads(proc.stdout.strip().splitlines()[-1])
    assert parity["ok"] is None and parity["checked"] is False, parity
    assert "did not run: transformers failed on this checkpoint: ValueError: get_seq_length" in parity["reason"]
    nll = recipe_nll({"res_path": str(runs[-1])})
    assert nll["untrained_weights"] is True and nll["prompt_nll"] >= 0.8 * nll["uniform_nll"]


# ---------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_sweep_sorts_types_and_prints_the_table(tmp_path):
    """A small sweep through the script's --quick mode: one of each outcome it can see here."""
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "try_architectures.py"), "--quick",
                           "exaone", "bart", "bamba", "--out", str(tmp_path), "--json", str(tmp_path / "rows.json"),
                           "--markdown", str(tmp_path / "table.md")],
                          capture_output=True, text=True, timeout=1800, cwd=REPO_ROOT)
    rows = {r["model_type"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert rows["exaone"]["status"] == "parity", rows["exaone"]
    assert rows["bart"]["status"] == "refused" and "decoder half" in rows["bart"]["message"]
    assert rows["bamba"]["status"] in ("parity", "hf-fails"), rows["bamba"]
    table = (tmp_path / "table.md").read_text()
    assert "| migrated with parity |" in table and "parity / testable" in table
    assert proc.returncode == 0, proc.stdout[-2000:]


@pytest.mark.slow
def test_sweep_all_reaches_the_goal(tmp_path):
    """`--all`, full mode (each type really migrated, its recipe run, parity read from its baseline):
    every causal-LM type; >= 95 % of testable types with parity (long: ~1 h on 2 cores)."""
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "try_architectures.py"), "--all",
                           "--out", str(tmp_path), "--json", str(tmp_path / "rows.json")],
                          capture_output=True, text=True, timeout=6 * 3600, cwd=REPO_ROOT)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {r["model_type"] for r in rows} == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    parity = sum(r["status"] == "parity" for r in rows)
    failed = [r for r in rows if r["status"] == "failed"]
    assert parity / (parity + len(failed)) >= 0.95, (failed, proc.stdout[-3000:])


# ---------------------------------------------------------------------------------------------
# Found by the full-mode sample sweep of this redesign (the --quick sweep never runs the recipe)
# ---------------------------------------------------------------------------------------------

def test_a_model_without_a_position_limit_keeps_the_default_prompt_budget():
    """xlnet says max_position_embeddings -1 (relative positions, no limit): the recipe's prompt
    budget stays 1024 and the engine's length check does not refuse it."""
    import types

    from agent.recipe.spec import input_max_len, position_limit
    from engine.loading import check_lengths

    assert position_limit({"max_position_embeddings": -1}) is None
    assert input_max_len({"max_position_embeddings": -1}, 32) == 1024
    assert input_max_len({"max_position_embeddings": 512}, 32) == 480
    check_lengths(types.SimpleNamespace(max_position_embeddings=-1), 1024, 32)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        check_lengths(types.SimpleNamespace(max_position_embeddings=512), 1024, 32)


def test_more_embedding_rows_than_vocab_size_are_not_refused(tmp_path):
    """moshi builds vocab_size + 1 embedding rows: the pre-flight check refuses only fewer rows than
    vocab_size (token ids past the table), not more."""
    from agent.migrate.checkpoint_check import check_weights_match_config
    from agent.errors import InputError

    config = {"vocab_size": 384, "num_hidden_layers": 2}
    check_weights_match_config(tmp_path, config, {"model.embed_tokens.weight": [385, 64]})
    with pytest.raises(InputError, match="has 383 rows, config.json says vocab_size 384"):
        check_weights_match_config(tmp_path, config, {"model.embed_tokens.weight": [383, 64]})
