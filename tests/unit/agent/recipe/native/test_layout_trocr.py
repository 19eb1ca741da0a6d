"""trocr's causal LM (TrOCRForCausalLM: its decoder inside TrOCRDecoderWrapper, output_projection its head), read by
the layout (parts/layout.py): the input embedding through the causal LM where the wrapper's accessor raises, the
decoder layers' cross-attention (encoder_attn and its norm, never called without encoder states) skipped, the base
model's one norm (layernorm_embedding), run before the first layer on the embedding plus its learned positions (row
offset 2), the file's embedding norm after the positions; its post-LN layers (norm(h + attn(h)), then norm(h +
mlp(h)), no final norm) with the MLP as the layer's own fc1 / fc2 (parts/block_post_ln.py). The file against
transformers, with faults that must fail: slow case below."""

from __future__ import annotations

import re

import pytest

from part_selfcheck import selfcheck_with_faults


def _trocr():
    from transformers import AutoConfig, TrOCRForCausalLM

    config = AutoConfig.for_model("trocr", d_model=32, hidden_size=32, decoder_layers=2, decoder_attention_heads=4,
                                  decoder_ffn_dim=64, vocab_size=40, max_position_embeddings=64)
    return TrOCRForCausalLM(config).eval()


def test_the_layout_reads_trocrs_wrapped_decoder():
    from agent.recipe.native.parts.layout import read_layout
    from agent.recipe.native.parts.probe import children

    model = _trocr()
    layout = read_layout(model, 32)
    decoder = model.model.decoder
    assert layout.refusal is None and layout.base is decoder
    assert children(decoder)["embed_tokens"] is decoder.embed_tokens
    assert children(decoder)["embed_norm"] is decoder.layernorm_embedding and layout.embed_norm == "after positions"
    layer = children(decoder)["layers"][0]
    shown = children(layer)
    assert "encoder_attn" not in shown and "encoder_attn_layer_norm" not in shown
    assert shown["post_attention_layernorm"] is layer.self_attn_layer_norm
    assert shown["post_feedforward_layernorm"] is layer.final_layer_norm
    renamed = "model.decoder.layernorm_embedding.weight"
    for pattern, replacement in layout.renames:
        renamed = re.sub(pattern, replacement, renamed, count=1)
    assert renamed == "model.embed_norm.weight"


def test_the_post_ln_layer_is_read_with_the_layers_own_linears():
    """The layer's MLP (fc1 / activation_fn / fc2, a view) replaced by a fixed map: h = norm(h + attn(h)), then
    norm(h + mlp(h)); the layer with its norms swapped is not that layer."""
    from agent.recipe.native.parts.block_post_ln import post_ln_layer
    from agent.recipe.native.parts.layout import read_layout
    from agent.recipe.native.parts.probe import children

    model = _trocr()
    read_layout(model, 32)
    layer = children(model.model.decoder)["layers"][0]
    assert post_ln_layer(layer, 32)
    import torch

    with torch.no_grad():
        layer.final_layer_norm.weight.mul_(3.0)
    norms = layer.__dict__["_native_children"]
    norms["post_attention_layernorm"], norms["post_feedforward_layernorm"] = (
        norms["post_feedforward_layernorm"], norms["post_attention_layernorm"])
    object.__setattr__(layer, "post_attention_layernorm", norms["post_attention_layernorm"])
    object.__setattr__(layer, "post_feedforward_layernorm", norms["post_feedforward_layernorm"])
    assert not post_ln_layer(layer, 32)


# faults: (text of the correct file, its faulty replacement)
ADD = "        hidden_states = hidden_states + self.embed_positions(position_ids).to(hidden_states.dtype)\n"
NORM = "        hidden_states = self.embed_norm(hidden_states)\n"
FAULTS = [
    (ADD + NORM, NORM + ADD),               # the embedding normed before its positions are added (bloom's place)
    ("position_ids = position_ids + 2", "position_ids = position_ids + 0"),      # the table's row offset lost
]


@pytest.mark.slow
def test_trocrs_file_matches_transformers_and_faults_fail(tmp_path):
    """Default cases covering its paths: the two above (the layout's reading, the post-LN layer with the layer's own
    linears); the learned positions' offset: test_part_gpt2_layouts.py (opt, gpt2)."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    config = AutoConfig.for_model("trocr").to_dict()         # no checkpoint shape recorded: its defaults
    composition = derive(config)
    assert composition.parts["block"] == "post_ln" and composition.options["EMBED_NORM_AFTER_POSITIONS"]
    assert composition.options["POSITION_OFFSET"] == 2 and composition.options["FINAL_NORM"] is False
    selfcheck_with_faults({"trocr": (config, composition)}, {"trocr": FAULTS}, "TrOCRForCausalLM", tmp_path)
