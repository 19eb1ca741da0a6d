"""Tiny local HF checkpoints: small config, random safetensors weights, a `tokenizers` tokenizer.

Used by `migrator demo` (the embedded default) and by the tests (SPEC §5): no hub access needed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from agent.recipe.shrink import TINY_DIMS
from engine.data import DEFAULT_PROMPT
from agent.processes import owned_temp
from engine.safe_write import UserTree

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"]

CORPUS = [
    DEFAULT_PROMPT,
    "The output is computed as a weighted sum of the values, where the weight assigned to each "
    "value is computed by a compatibility function of the query with the corresponding key.",
    "Multi-head attention allows the model to jointly attend to information from different "
    "representation subspaces at different positions.",
    "We call our particular attention scaled dot-product attention. The input consists of queries "
    "and keys of dimension d_k, and values of dimension d_v.",
    "In addition to attention sub-layers, each of the layers in our encoder and decoder contains "
    "a fully connected feed-forward network, which is applied to each position separately.",
    "0123456789 !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
]

# Types whose layer counts are tied together: TINY_DIMS' two layers would make them a nonsense model
# that still validates (dory: input + recurrent + output sections must add up to num_hidden_layers;
# its defaults of 8 + 8 leave a recurrent section of -14 layers, each layer then run twice).
TYPE_DIMS = {
    "dory": {"num_hidden_layers": 3, "n_input_layers": 1, "n_output_layers": 1},
    # Gemma 4's MoE checkpoints (gemma-4-26B-A4B: upstream's models/gemma_4) name their MoE keys apart:
    # the type's defaults are a dense model with top_k_experts None.
    "gemma4_text": {"enable_moe_block": True, "top_k_experts": 2},
}

# Image-text types: their text decoder's settings a tiny checkpoint must still have (Qwen2-VL / 2.5-VL / 3-VL's
# M-RoPE sections: the published checkpoints' 16/24/24 of a head of 128, here of TINY_DIMS' 16).
TEXT_DIMS = {
    "qwen2_vl": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
    "qwen2_5_vl": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
    "qwen3_vl": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                     "mrope_interleaved": True}},
    # Qwen3.5's hybrid decoder: a full-attention layer every full_attention_interval (4) layers, as every checkpoint
    # has one; TINY_DIMS' two layers would be linear attention only
    "qwen3_5": {"num_hidden_layers": 4},
    "qwen3_5_moe": {"num_hidden_layers": 4},
}


def train_bpe_tokenizer(corpus: list[str], vocab_size: int, **init_kwargs):
    """Byte-level BPE trained on `corpus`, wrapped as a fast HF tokenizer (pad/bos/eos/unk)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>",
        unk_token="<|unk|>", **init_kwargs)


def build_tokenizer(out_dir: str | Path, vocab_size: int = 384):
    """Train a byte-level BPE tokenizer on CORPUS and save it as a fast HF tokenizer."""
    fast = train_bpe_tokenizer(CORPUS, vocab_size)
    UserTree(out_dir, "the checkpoint folder", create=True).fill_with(out_dir, lambda tmp: fast.save_pretrained(tmp),
                                                                      owned_temp("fill"))
    return fast


def tiny_config(model_type: str, vocab_size: int, tiny_dims: bool = True, **overrides):
    """A transformers config of `model_type` with TINY_DIMS (only the keys it knows) and overrides
    (`tiny_dims=False`: the type's defaults and the overrides only)."""
    from transformers import AutoConfig

    if not tiny_dims:
        return AutoConfig.for_model(model_type, vocab_size=vocab_size, pad_token_id=0, bos_token_id=1,
                                    eos_token_id=2, **overrides)
    base = AutoConfig.for_model(model_type)
    known = set(base.to_dict()) | set(getattr(base, "attribute_map", {}))
    kwargs = {k: v for k, v in TINY_DIMS.items() if k in known}
    kwargs.update(TYPE_DIMS.get(model_type, {}))
    if "kv_lora_rank" in known:
        kwargs.pop("head_dim", None)  # MLA derives head_dim from the rope/nope dims
    kwargs.update(vocab_size=vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    # Composite configs (text_config + vision_config, ...): the sub-models get TINY_DIMS too, the
    # text model the vocabulary; otherwise the "tiny" checkpoint has full-size sub-models. A
    # sub-config that does not validate with them keeps its defaults.
    for key in getattr(base, "sub_configs", None) or {}:
        sub = getattr(base, key, None)
        if sub is None or not hasattr(sub, "to_dict") or key in overrides:
            continue
        sub_known = set(sub.to_dict()) | set(getattr(sub, "attribute_map", {}))
        sub_kwargs = {k: v for k, v in TINY_DIMS.items() if k in sub_known}
        if "kv_lora_rank" in sub_known:
            sub_kwargs.pop("head_dim", None)
        if "vocab_size" in sub_known and key == "text_config":
            sub_kwargs.update(vocab_size=vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2)
            # Overrides of the text model's fields (e.g. num_hidden_layers) reach it here too.
            sub_kwargs.update({k: v for k, v in overrides.items() if k in sub_known and k not in known})
            sub_kwargs.update(TEXT_DIMS.get(model_type, {}))
        if getattr(sub, "model_type", None):
            sub_kwargs["model_type"] = sub.model_type
        try:
            AutoConfig.for_model(model_type, **{key: sub_kwargs})
        except Exception:  # noqa: BLE001
            continue
        kwargs[key] = sub_kwargs
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def build_tiny_checkpoint(model_type: str, out_dir: str | Path, seed: int = 0, tiny_dims: bool = True,
                          max_params: int | None = None, **overrides) -> Path:
    """Write config.json, model.safetensors, tokenizer and generation config to `out_dir`.

    `max_params`: refuse (ValueError) a config whose model would be larger, counted on the meta
    device before any memory is allocated (config keys TINY_DIMS does not know, e.g. an expert
    count under another name, can leave a "tiny" config at its full default size)."""
    import torch

    out = Path(out_dir)
    checkpoint_tree = UserTree(out, "the checkpoint folder", create=True)
    tokenizer = build_tokenizer(out)
    config = tiny_config(model_type, vocab_size=len(tokenizer), tiny_dims=tiny_dims, **overrides)
    model_class = model_class_of(config)
    if max_params is not None:
        with torch.device("meta"):
            count = sum(p.numel() for p in model_class.from_config(config).parameters())
        if count > max_params:
            raise ValueError(f"{count / 1e6:.0f}M parameters > {max_params / 1e6:.0f}M: not a tiny config")
    torch.manual_seed(seed)
    model = model_class.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    checkpoint_tree.fill_with(out, lambda tmp: model.save_pretrained(tmp, safe_serialization=True),
                              owned_temp("fill"))
    checkpoint_tree.write_text(out / "tiny_checkpoint.json", json.dumps({"model_type": model_type, "seed": seed}) + "\n")

    return out


def model_class_of(config):
    """The auto class that builds a checkpoint of `config` (agent.recipe.text_decoder.auto_class_for): the causal
    LM where transformers maps the type to one (gemma3's is its image-text class), else the image-text one for an
    image-text type (llava, mistral3, qwen2_5_vl: its text and vision configs tiny, tiny_config's sub-configs;
    saved as its checkpoints are)."""
    from agent.recipe.text_decoder import auto_class_for

    return auto_class_for(config.to_dict())


# Integer config fields that are sizes (widths), scaled down together by `scaled_default_overrides`
# so that the relations a config class validates (hidden = heads x head_dim, d_head = d_model //
# n_head, hidden x expand = heads x head_dim, ...) still hold. Counts (heads, layers, experts) stay.
_SIZE_FIELD = re.compile(r"(^|_)(hidden_size|intermediate_size|head_dim|d_model|d_head|d_inner|d_ff|n_embd|n_inner|rotary_dim|"
                         r"ffn_dim|embed_dim|hidden_dim|ffn_hidden_size|moe_intermediate_size|"
                         r"shared_expert_intermediate_size|kv_lora_rank|q_lora_rank|qk_rope_head_dim|"
                         r"qk_nope_head_dim|v_head_dim|d_state|state_size)$")


def scaled_default_overrides(model_type: str, hidden_size: int = 64) -> dict:
    """The type's own default config with every width divided by the same factor (hidden_size of
    the default / `hidden_size`); counts and layer patterns are kept. For configs whose validation
    ties dimensions together, where TINY_DIMS' independent values fail."""
    from transformers import AutoConfig

    try:
        base = AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001 - the type's own defaults do not validate: nothing to scale
        return {}
    default_hidden = getattr(base, "hidden_size", None)
    if not isinstance(default_hidden, int) or default_hidden <= hidden_size:
        return {}
    factor = default_hidden // hidden_size
    overrides = {}
    for key, value in base.to_dict().items():
        if isinstance(value, int) and not isinstance(value, bool) and _SIZE_FIELD.search(key) and value >= factor:
            overrides[key] = value // factor
    if "initializer_range" in base.to_dict():
        overrides["initializer_range"] = TINY_DIMS["initializer_range"]   # peaked logits, as above
    return overrides
