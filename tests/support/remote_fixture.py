"""A tiny Hugging Face "remote code" checkpoint: a small custom decoder-only architecture that is
not in transformers, shipped the way Hub repos with `auto_map` ship it (config.json with auto_map
plus configuration_*.py / modeling_*.py and a third local module next to the weights).

`build_remote_code_checkpoint(out_dir)` writes everything; load it with
`AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True)`.

Cache/mask contract of the model (what the project's engine calls, and what transformers'
`generate()` calls): `forward(input_ids, attention_mask=<2D [batch, past+current], 1 = real token,
left padding allowed>, position_ids=..., past_key_values=<DynamicCache>)`. transformers 5.x's
`generate()` passes the cache as `cache=` instead; the model accepts both names.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import shutil
import sys
import uuid
from pathlib import Path

CONFIGURATION_SRC = '''\
"""TinyCustom configuration (remote code)."""

from transformers import PretrainedConfig


class TinyCustomConfig(PretrainedConfig):
    model_type = "tinycustom"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=0.02,
        use_cache=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
'''

LAYERS_SRC = '''\
"""Small building blocks shared by the TinyCustom modeling code."""

import torch
from torch import nn


class TinyRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
'''

MODELING_SRC = '''\
"""TinyCustom: a small decoder-only transformer (remote code).

RMSNorm, rotary position embeddings, grouped-query attention through
torch.nn.functional.scaled_dot_product_attention, SwiGLU MLP.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_tinycustom import TinyCustomConfig
from .tinycustom_layers import TinyRMSNorm, rotate_half


class TinyCustomRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dim = config.head_dim
        self.base = config.rope_theta

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq = 1.0 / (
            self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float32, device=x.device) / self.dim)
        )
        freqs = position_ids[:, :, None].float() * inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def build_causal_mask(attention_mask, batch_size, query_length, past_length, device):
    """A boolean [batch, 1, query, past + query] mask (True = attend) from a 2D padding mask."""
    kv_length = past_length + query_length
    if attention_mask is None:
        attention_mask = torch.ones(batch_size, kv_length, dtype=torch.long, device=device)
    attention_mask = attention_mask[:, -kv_length:].to(device=device, dtype=torch.bool)
    query_index = torch.arange(query_length, device=device)[:, None] + past_length
    key_index = torch.arange(kv_length, device=device)[None, :]
    causal = key_index <= query_index
    mask = causal[None, None, :, :] & attention_mask[:, None, None, :]
    # A padding query sees no key at all: let it see itself so its (unused) output stays finite.
    mask = mask | (key_index == query_index)[None, None, :, :]
    return mask


class TinyCustomMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TinyCustomAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None):
        bsz, q_len, _ = hidden_states.shape
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states, attn_mask=attention_mask, scale=self.scaling
        )
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim)
        return self.o_proj(attn_output)


class TinyCustomDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = TinyCustomAttention(config, layer_idx)
        self.mlp = TinyCustomMLP(config)
        self.input_layernorm = TinyRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = TinyRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_embeddings, attention_mask, past_key_values)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class TinyCustomPreTrainedModel(PreTrainedModel):
    config_class = TinyCustomConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["TinyCustomDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, TinyRMSNorm):
            nn.init.ones_(module.weight)


class TinyCustomModel(TinyCustomPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [TinyCustomDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = TinyRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = TinyCustomRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        use_cache=None,
        cache=None,
        **kwargs,
    ):
        # transformers >= 5 generate() passes the cache as `cache=`; older callers as `past_key_values=`.
        if past_key_values is None:
            past_key_values = cache
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)

        batch_size, seq_length = inputs_embeds.shape[:2]
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0

        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -seq_length:]
            else:
                position_ids = torch.arange(past_length, past_length + seq_length, device=inputs_embeds.device)
                position_ids = position_ids.unsqueeze(0).expand(batch_size, -1)
        position_ids = position_ids.to(inputs_embeds.device)
        if position_ids.shape[0] != batch_size:
            position_ids = position_ids.expand(batch_size, -1)

        causal_mask = build_causal_mask(attention_mask, batch_size, seq_length, past_length, inputs_embeds.device)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)

        for decoder_layer in self.layers:
            if self.gradient_checkpointing and self.training:
                hidden_states = self._gradient_checkpointing_func(
                    decoder_layer.__call__, hidden_states, position_embeddings, causal_mask, past_key_values
                )
            else:
                hidden_states = decoder_layer(hidden_states, position_embeddings, causal_mask, past_key_values)

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values)


class TinyCustomForCausalLM(TinyCustomPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = TinyCustomModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        cache=None,
        **kwargs,
    ):
        # transformers >= 5 generate() passes the cache as `cache=`; older callers as `past_key_values=`.
        if past_key_values is None:
            past_key_values = cache
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :]).float()

        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous().to(shift_logits.device)
            loss = F.cross_entropy(
                shift_logits.view(-1, self.config.vocab_size), shift_labels.view(-1), ignore_index=-100
            )

        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values)
'''

MODULE_FILES = {
    "configuration_tinycustom.py": CONFIGURATION_SRC,
    "modeling_tinycustom.py": MODELING_SRC,
    "tinycustom_layers.py": LAYERS_SRC,
}

AUTO_MAP = {
    "AutoConfig": "configuration_tinycustom.TinyCustomConfig",
    "AutoModelForCausalLM": "modeling_tinycustom.TinyCustomForCausalLM",
}

DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    # Larger than the usual 0.02 so random logits are peaked and greedy tokens are stable.
    "initializer_range": 0.2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def _import_as_package(src_dir: Path):
    """Import the modules in `src_dir` as a throwaway package, so their relative imports resolve."""
    pkg_name = f"_tinycustom_fixture_{uuid.uuid4().hex}"
    spec = importlib.machinery.ModuleSpec(pkg_name, None, is_package=True)
    spec.submodule_search_locations = [str(src_dir)]
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [str(src_dir)]
    sys.modules[pkg_name] = package
    dont_write = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        configuration = importlib.import_module(f"{pkg_name}.configuration_tinycustom")
        modeling = importlib.import_module(f"{pkg_name}.modeling_tinycustom")
    finally:
        sys.dont_write_bytecode = dont_write
    return configuration, modeling


def build_remote_code_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """Write a tiny `auto_map` remote-code checkpoint (config, code, weights, tokenizer) to `out_dir`."""
    import torch

    from agent.testing.tiny_checkpoint import build_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, src in MODULE_FILES.items():
        (out / name).write_text(src)
    tokenizer = build_tokenizer(out)

    configuration, modeling = _import_as_package(out)
    config = configuration.TinyCustomConfig(vocab_size=len(tokenizer), **DIMS)
    torch.manual_seed(seed)
    model = modeling.TinyCustomForCausalLM(config).to(torch.float32).eval()
    model.generation_config.bos_token_id = DIMS["bos_token_id"]
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)

    # save_pretrained of a class that was never registered for an auto class writes no auto_map
    # (and may copy nothing): put config.json and the code into the shape Hub remote repos have.
    config_path = out / "config.json"
    cfg = json.loads(config_path.read_text())
    cfg.update(DIMS)
    cfg.update(
        model_type="tinycustom",
        architectures=["TinyCustomForCausalLM"],
        auto_map=dict(AUTO_MAP),
        vocab_size=len(tokenizer),
        dtype="float32",
    )
    cfg.pop("torch_dtype", None)
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for name, src in MODULE_FILES.items():
        (out / name).write_text(src)
    shutil.rmtree(out / "__pycache__", ignore_errors=True)

    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen.update(bos_token_id=DIMS["bos_token_id"], eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    gen_path.write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    return out
