"""modernbert-decoder's causal LM, read by the layout (parts/layout.py) and two parts: its embeddings wrapper
(tok_embeddings and the norm of the embedding), its layers' attn / attn_norm / mlp_norm and the attention's Wo under
the skeleton's names, its prediction head `lm_head` (dense, activation, LayerNorm) read as the head_transform before
its `decoder`, the real output head (parts/head_transform.py), and its first layer's Identity in attn_norm's place
(parts/block_first_unnormed.py). The file against transformers, with faults that must fail: slow case below."""

from __future__ import annotations

import re

import pytest

from part_selfcheck import selfcheck_with_faults


def _model(**changes):
    from transformers import AutoConfig, ModernBertDecoderForCausalLM

    config = AutoConfig.for_model("modernbert-decoder", hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                  num_attention_heads=4, vocab_size=40, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, cls_token_id=1, sep_token_id=2, **changes)
    return ModernBertDecoderForCausalLM(config).eval()


def _renamed(name: str, renames) -> str:
    for pattern, replacement in renames:
        name = re.sub(pattern, replacement, name, count=1)
    return name


def test_the_layout_reads_modernbert_decoders_embeddings_head_and_layers():
    import torch

    from agent.recipe.native.parts.layout import read_layout
    from agent.recipe.native.parts.probe import children

    model = _model()
    layout = read_layout(model, 32)
    assert layout.refusal is None and layout.base is model.model and layout.embed_norm is True
    top = children(model)
    assert top["lm_head"] is model.decoder and top["head_transform"] is model.lm_head
    base = children(model.model)
    assert base["embed_tokens"] is model.model.embeddings.tok_embeddings
    assert base["embed_norm"] is model.model.embeddings.norm and base["norm"] is model.model.final_norm
    assert "embeddings" not in base
    first, second = (children(layer) for layer in model.model.layers[:2])
    assert isinstance(first["input_layernorm"], torch.nn.Identity)
    assert second["input_layernorm"] is model.model.layers[1].attn_norm
    assert second["post_attention_layernorm"] is model.model.layers[1].mlp_norm
    assert children(second["self_attn"])["o_proj"] is model.model.layers[1].attn.Wo
    # the transform's stored name lm_head moves before the head's decoder takes it
    stored = {"lm_head.dense.weight": "head_transform.dense.weight", "lm_head.norm.weight": "head_transform.norm.weight",
              "decoder.bias": "lm_head.bias", "model.embeddings.tok_embeddings.weight": "model.embed_tokens.weight",
              "model.embeddings.norm.weight": "model.embed_norm.weight", "model.final_norm.weight": "model.norm.weight",
              "model.layers.1.attn.Wo.weight": "model.layers.1.self_attn.o_proj.weight",
              "model.layers.1.attn_norm.weight": "model.layers.1.input_layernorm.weight",
              "model.layers.0.mlp_norm.weight": "model.layers.0.post_attention_layernorm.weight"}
    assert {name: _renamed(name, layout.renames) for name in stored} == stored


def test_the_head_transform_is_read_numerically():
    """norm(act(dense(x))) with the activation the config key the transform follows (classifier_activation, not
    hidden_activation of the same value); a transform whose activation differs is not that."""
    import torch

    from agent.recipe.native.parts.head_transform import computes

    model = _model(classifier_activation="gelu", hidden_activation="silu")
    assert computes(model.lm_head, 32, "gelu") and not computes(model.lm_head, 32, "silu")
    model.lm_head.act = torch.nn.ReLU()
    assert not computes(model.lm_head, 32, "gelu")


def test_the_head_transforms_norm_must_be_the_models_kind():
    """The file builds the transform's norm as the model's norm class: one of another epsilon or with a bias the
    final norm has not is refused."""
    import torch

    from agent.recipe.native.parts.head_transform import norm_of_model_kind

    class Probe:
        hidden = 32
        base = type("Base", (), {"norm": torch.nn.LayerNorm(32, eps=1e-5, bias=False)})()

    assert norm_of_model_kind(Probe, torch.nn.LayerNorm(32, eps=1e-5, bias=False))
    assert not norm_of_model_kind(Probe, torch.nn.LayerNorm(32, eps=1e-6, bias=False))
    assert not norm_of_model_kind(Probe, torch.nn.LayerNorm(32, eps=1e-5, bias=True))
    assert not norm_of_model_kind(Probe, torch.nn.RMSNorm(32, eps=1e-5))


def test_the_first_layer_without_an_attention_norm_is_read_numerically():
    """Layer 0's attn_norm is an identity (x + attn(x), then + mlp(mlp_norm(.))) and the others' a norm; with a norm
    put in its place the layer is no longer that."""
    import torch

    from agent.recipe.native.parts.block import residual_scaled
    from agent.recipe.native.parts.block_first_unnormed import unnormed_layers
    from agent.recipe.native.parts.layout import read_layout

    model = _model()
    read_layout(model, 32)

    class Probe:
        hidden = 32
        layers = list(model.model.layers)

    assert unnormed_layers(Probe, "input_layernorm") == [0]
    layer = model.model.layers[0]
    roles = {"mlp_in": "post_attention_layernorm"}
    assert residual_scaled(layer, 32, 1.0, roles)
    layer.attn_norm = torch.nn.LayerNorm(32, bias=False)
    assert not residual_scaled(layer, 32, 1.0, roles)


# faults: (text of the correct file, its faulty replacement)
FAULTS = [
    # the first layer's attention given a norm of its input (and the checkpoint then lacks its weight)
    ("        if layer_idx == 0:\n            self.input_layernorm = ", "        if layer_idx == -1:\n"
                                                                    "            self.input_layernorm = "),
    ("        return self.norm(self.act_fn(self.dense(hidden_states)))",        # the transform's norm dropped
     "        return self.act_fn(self.dense(hidden_states))"),
    ("        hidden_states = self.head_transform(hidden_states)\n", ""),     # no transform before the head
    ("        hidden_states = self.embed_norm(hidden_states)\n", ""),             # the embedding not normed
]


@pytest.mark.slow
def test_modernbert_decoders_file_matches_transformers_and_faults_fail(tmp_path):
    """Default cases covering its paths: the four above (the layout's reading, the head transform and its norm, the
    unnormed first layer); the gated MLP of one merged linear: test_layout_attention_rotary.py (moshi); the rope per
    layer type and the sliding layers: test_part_rotary_typed.py."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    config = AutoConfig.for_model("modernbert-decoder").to_dict()     # no checkpoint shape recorded: its defaults
    composition = derive(config)
    assert composition.parts["block"] == "pre_norm_first_unnormed" and composition.parts["head"] == "lm_head_transform"
    assert composition.options["HEAD_ACT"] == "classifier_activation" and composition.options["EMBED_NORM"]
    selfcheck_with_faults({"modernbert-decoder": (config, composition)}, {"modernbert-decoder": FAULTS},
                          "ModernBertDecoderForCausalLM", tmp_path)
