"""Llama 4's text decoder (llama4_text): its MoE routing scaling the experts' inputs (parts/moe.py INPUT_SCALED) and
picking its top-k by the router's logits (SELECT_ON_LOGITS: their sigmoids tie at 1 where they are large), its
complex-table rotary read as the interleaved one (parts/rotary_interleaved.py complex_pairs_form) on the rotating
layers of no_rope_layers (parts/rotary_nope.py), its weightless q/k norm on those layers after the rotary
(parts/attention_qk_l2.py), its chunked local attention (parts/attention_chunked.py) and its NoPE layers' query
temperature (parts/attention_temperature.py). The whole file against transformers on llama4_text's config with a
chunk and a floor_scale the self-check's prompts cross, and faults: the experts' inputs unscaled, the q/k norm
dropped, the top-k of the sigmoid scores, the temperature's step a token late, a prefill not cut at its chunks, a
decode reading from the first block."""

from __future__ import annotations

import pytest

# the chunk and the temperature's floor within the self-check's prompts (13 tokens, decoded to 18)
WITHIN_PROMPTS = {"attention_chunk_size": 8, "floor_scale": 4}
FAULTS = {"llama4_text": [
    ("return expanded_x * row_weights.to(expanded_x.dtype)[:, None]", "return expanded_x"),
    ("query, key = self.qk_norm(query), self.qk_norm(key)", "query, key = query, key"),
    ("choice = logits.float()", "choice = logits.float().sigmoid()"),
    ("torch.floor((positions.float() + 1.0) / floor_scale)", "torch.floor(positions.float() / floor_scale)"),
    ("bounds += list(range(start + chunk, end, chunk)) + [end]", "bounds += [end]"),
    ("start = (kv_lens - 1) // self.attention_chunk * self.attention_chunk", "start = kv_lens * 0"),
]}


def test_llama4s_complex_rotary_is_the_interleaved_one():
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.llama4.modeling_llama4 as llama4

    from agent.recipe.native.parts.rotary_interleaved import interleaved_form

    assert interleaved_form(llama4) and not interleaved_form(llama)


def _probe(**changes):
    from transformers import AutoConfig

    from agent.recipe.native.parts.probe import Probe

    return Probe(AutoConfig.for_model("llama4_text", num_hidden_layers=4, **changes).to_dict())


def test_llama4s_chunked_attention_and_query_temperature_are_read_and_a_changed_form_refused(monkeypatch):
    """Both read on transformers' modules (a config without chunked layers has none); transformers' chunked mask
    replaced by its causal one, or the NoPE layers' attn_scale unlike the config's, is refused."""
    import transformers.models.llama4.modeling_llama4 as llama4

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.attention_chunked import chunked_attention
    from agent.recipe.native.parts.attention_temperature import query_temperature

    probe = _probe()
    assert chunked_attention(probe) and query_temperature(probe)
    assert not chunked_attention(_probe(attention_chunk_size=None))
    for layer in probe.layers:
        layer.self_attn.attn_scale *= 2
    probe.memo.clear()
    with pytest.raises(NotNative, match="query temperature"):
        query_temperature(probe)
    monkeypatch.setattr(llama4, "create_chunked_causal_mask", llama4.create_causal_mask)
    with pytest.raises(NotNative, match="chunked_attention layers whose attention"):
        chunked_attention(_probe())


def test_chunk_bounds_cut_each_packed_prompt_at_its_chunks():
    import torch

    from agent.recipe.native.parts.code.attention_chunked import chunk_bounds

    assert chunk_bounds(torch.tensor([13, 19, 22]), 8).tolist() == [8, 13, 19, 22]
    assert chunk_bounds(torch.tensor([16, 33]), 8).tolist() == [8, 16, 24, 32, 33]


@pytest.mark.slow
def test_llama4_text_file_matches_transformers_and_faults_fail(tmp_path):
    """Slow (llama4's derive and its file's self-check, every family setting); the default cases of its paths:
    test_moe_features.py's llama4_text blocks and faults, test_llama4s_complex_rotary_is_the_interleaved_one,
    test_llama4s_chunked_attention_and_query_temperature_are_read_and_a_changed_form_refused,
    test_chunk_bounds_cut_each_packed_prompt_at_its_chunks."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from part_selfcheck import selfcheck_with_faults

    config = AutoConfig.for_model("llama4_text", **WITHIN_PROMPTS).to_dict()
    composition = derive(config)
    assert composition.parts["moe"] == "sparse_moe" and composition.options["INPUT_SCALED"]
    assert composition.options["SELECT_ON_LOGITS"]
    assert composition.parts["position"] == "rotary_nope" and composition.options["QK_L2_NORM"]
    assert composition.options["CHUNKED"] and composition.options["QUERY_TEMPERATURE"]
    selfcheck_with_faults({"llama4_text": (config, composition)}, FAULTS, "Llama4ForCausalLM", tmp_path)
