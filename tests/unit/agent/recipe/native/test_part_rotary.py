"""The rotary part's table (agent/recipe/native/parts/code/rotary.py, imported as it stands: it needs neither
torch_npu nor a checkout) against transformers' own rotary embedding, per rope type, position by position as
transformers decodes (a prompt, then one position at a time): every type ROPE_INIT_FUNCTIONS knows and the default,
partial rotary, dynamic and longrope past their original context. The documented difference — a prompt longer than
the original context, which transformers rotates with the whole prompt's frequencies — is shown too."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from agent.recipe.native.assemble import CODE_DIR
from agent.recipe.native.parts.position import ROPE_TYPES, rope_variant

HEAD_DIM, PROMPT, STEPS, ORIGINAL = 32, 10, 8, 14


def rotary_code():
    spec = importlib.util.spec_from_file_location("native_rotary_code", CODE_DIR / "rotary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llama_config(rope_type: str, partial: float = 1.0):
    from transformers import AutoConfig

    spec, changes = rope_variant(rope_type, {"rope_theta": 10000.0, "partial_rotary_factor": partial},
                                 int(HEAD_DIM * partial))
    if rope_type in ("dynamic", "longrope"):
        changes = {"max_position_embeddings": ORIGINAL if rope_type == "dynamic" else 4 * ORIGINAL}
        if rope_type == "longrope":
            spec["original_max_position_embeddings"] = ORIGINAL
    return AutoConfig.for_model("llama", hidden_size=4 * HEAD_DIM, num_attention_heads=4, head_dim=HEAD_DIM,
                                rope_parameters=spec, **{"max_position_embeddings": 512, **changes})


def transformers_tables(config, lengths):
    """cos / sin of each position as transformers' rotary gives them, the positions fed in `lengths` chunks."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, 1, HEAD_DIM)
    cos, sin, start = [], [], 0
    for length in lengths:
        positions = torch.arange(start, start + length)[None]
        c, s = rotary(x, positions)
        cos.append(c[0])
        sin.append(s[0])
        start += length
    return torch.cat(cos), torch.cat(sin)


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_the_table_is_transformers_rotary_as_it_decodes(rope_type):
    config = llama_config(rope_type)
    ours = rotary_code().ModelRotaryEmbedding(config, HEAD_DIM)
    positions = torch.arange(PROMPT + STEPS)
    cos, sin = ours(torch.zeros(1), positions)
    want_cos, want_sin = transformers_tables(config, [PROMPT] + [1] * STEPS)
    width = want_cos.shape[-1]
    assert ours.rotary_dim == width
    torch.testing.assert_close(cos[:, 0], want_cos, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(sin[:, 0], want_sin, atol=1e-6, rtol=1e-5)
    if rope_type in ("dynamic", "longrope"):       # the decode passed the original context: the frequencies changed
        plain = transformers_tables(llama_config("default"), [PROMPT + STEPS])[0]
        assert not torch.allclose(want_cos[ORIGINAL:], plain[ORIGINAL:], atol=1e-4)


def test_a_partial_rotary_covers_the_first_dims():
    config = llama_config("linear", partial=0.5)
    ours = rotary_code().ModelRotaryEmbedding(config, HEAD_DIM)
    assert ours.rotary_dim == HEAD_DIM // 2
    cos, _ = ours(torch.zeros(1), torch.arange(6))
    torch.testing.assert_close(cos[:, 0], transformers_tables(config, [6])[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_a_prompt_past_the_original_context_is_the_documented_difference(rope_type):
    """transformers rotates a prompt longer than the original context with the whole prompt's frequencies; the
    table gives each position its own (what incremental decoding gives it): they differ on that prompt."""
    config = llama_config(rope_type)
    ours = rotary_code().ModelRotaryEmbedding(config, HEAD_DIM)
    long_prompt = ORIGINAL + 6
    cos, _ = ours(torch.zeros(1), torch.arange(long_prompt))
    whole = transformers_tables(config, [long_prompt])[0]
    stepwise = transformers_tables(config, [1] * long_prompt)[0]
    torch.testing.assert_close(cos[:, 0], stepwise, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(cos[:ORIGINAL, 0], whole[:ORIGINAL], atol=1e-4)
