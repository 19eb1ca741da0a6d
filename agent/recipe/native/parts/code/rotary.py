"""Rotary position embedding: cos / sin tables of the config's rope type, looked up per token (TND)."""

import copy

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

NTK_ALPHA = False       # a fixed NTK alpha in the rope settings stretches the base (hunyuan; its checkpoints say "dynamic")
# rope types whose frequencies depend on the sequence length (transformers' dynamic_rope_update)
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
ROTARY_DIM = None       # the config key of a head's rotary dims where the config names them (gptj: rotary_dim)
ROTATE_BACKWARD = False  # the architecture rotates by the negative angle (nanochat's rotate_half): the sin table negated
PROPORTIONAL_ROPE = False   # "proportional" rope (lfm3's full-attention layers): a rotary fraction of the angles over
                            # the whole head's width, the other angles 0 (transformers 5.0.0 has no such rope type)
DEFAULT_WHOLE_HEAD = False  # the architecture's default rope ignores partial_rotary_factor (lfm3's own default)


def rope_parameters(config, layer_type=None):
    """The rope settings of `config`, of one layer type where the architecture keeps them per type."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


class ModelRotaryEmbedding(nn.Module):
    """cos / sin of every position, looked up per token: [tokens, 1, rotary_dim] (TND). The rope type is the
    config's, read at run time: default here, the others (linear, dynamic, yarn, longrope, llama3) by
    transformers' ROPE_INIT_FUNCTIONS; a partial rotary covers the first rotary_dim dims of each head. dynamic
    and longrope change their frequencies with the sequence's length: position p gets what transformers'
    incremental decoding gives it (the frequencies of a sequence p + 1 long). A prompt longer than the original
    context is the one case where the two differ: transformers rotates all of it with the whole prompt's
    frequencies, this table each position with its own."""

    def __init__(self, config, head_dim, layer_type=None):
        super().__init__()
        params = rope_parameters(config, layer_type)
        rope_type = params.get("rope_type", "default")
        if NTK_ALPHA and params.get("alpha"):
            # the default rope on the base stretched by alpha ** (head_dim / (head_dim - 2)), whatever the length
            params["rope_theta"] = float(params["rope_theta"]) * float(params["alpha"]) ** (head_dim / (head_dim - 2))
            rope_type = "default"
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        if rope_type == "default":
            factor = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
            dim = int(head_dim * factor)
            if DEFAULT_WHOLE_HEAD:
                dim = head_dim
            if ROTARY_DIM:
                dim = rotary_width(config, head_dim)      # the config's own count (gptj's rotary_dim)
            inv_freq = 1.0 / (float(params["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            freqs, scaling = torch.outer(positions, inv_freq), 1.0
        elif PROPORTIONAL_ROPE and rope_type == "proportional":
            freqs, scaling = torch.outer(positions, proportional_inv_freq(params, head_dim)), 1.0
        elif rope_type in LENGTH_DEPENDENT_ROPE:
            freqs, scaling = length_dependent_freqs(config, params, rope_type, layer_type)
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
            freqs = torch.outer(positions, inv_freq.float())
        self.rotary_dim = 2 * freqs.shape[-1]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cached", emb.sin() * scaling, persistent=False)
        if ROTATE_BACKWARD:
            self.sin_cached.neg_()

    def forward(self, x, position_ids):
        cos = self.cos_cached[position_ids].unsqueeze(1)
        sin = self.sin_cached[position_ids].unsqueeze(1)
        return cos.to(x.dtype), sin.to(x.dtype)


def proportional_inv_freq(params, head_dim):
    """transformers' proportional rope: the first partial_rotary_factor of the head's angles at base ** (-2i /
    head_dim), the rest 0 (those dims not rotated), all divided by its factor."""
    angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    rotated = 1.0 / (float(params["rope_theta"]) ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
    return torch.cat((rotated, torch.zeros(head_dim // 2 - angles))) / float(params.get("factor", 1.0))


def layer_rope_bases(config, key):
    """The distinct non-zero rope bases of config.`key` (one per layer; 0: the layer has no rotary), sorted; the
    config's own base where every layer has none (one table, read by no layer)."""
    bases = sorted({float(theta) for theta in getattr(config, key)[:config.num_hidden_layers] if theta})
    return bases or [float(rope_parameters(config)["rope_theta"])]


def layer_rope_table(config, key, layer_idx):
    """The index of the layer's table among layer_rope_bases (0 for a layer without rotary: never applied)."""
    theta = getattr(config, key)[layer_idx]
    return layer_rope_bases(config, key).index(float(theta)) if theta else 0


def with_rope_theta(config, theta):
    """A copy of `config` whose rope settings have base `theta` (the rest of its rope type kept)."""
    changed = copy.copy(config)
    changed.rope_parameters = {**rope_parameters(config), "rope_theta": theta}
    return changed


def length_dependent_freqs(config, params, rope_type, layer_type):
    """(position x frequency angles, attention scaling) of dynamic / longrope: position p rotated by the
    frequencies transformers uses for a sequence p + 1 long (past the original context: dynamic's NTK base
    of that length, longrope's long factors)."""
    init = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, scaling = init(config, None, layer_type=layer_type)
    if rope_type == "dynamic":
        original = config.max_position_embeddings
        total = int(original * float(params.get("factor", 1.0)))
        per_position = [inv_freq.float()] * original
        per_position += [init(config, None, seq_len=p + 1, layer_type=layer_type)[0].float() for p in range(original, total)]
    else:
        original = int(params["original_max_position_embeddings"])
        total = config.max_position_embeddings
        long_freq = init(config, None, seq_len=original + 1, layer_type=layer_type)[0].float()
        per_position = [inv_freq.float()] * min(original, total) + [long_freq] * max(total - original, 0)
    positions = torch.arange(total, dtype=torch.float32)
    return positions[:, None] * torch.stack(per_position), scaling


def rotary_width(config, head_dim):
    """The rotary dims of a head: the width of ModelRotaryEmbedding's tables."""
    if ROTARY_DIM:
        return getattr(config, ROTARY_DIM) or head_dim
    params = dict(getattr(config, "rope_parameters", None) or {})
    dim = int(head_dim * float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0))
    return 2 * ((dim + 1) // 2)


def half_from_interleaved(rows, head_dim, rotary_dim):
    """Rows [heads * head_dim, ...] with each head's rotary dims reordered from pairs (2i, 2i + 1) to (i, rotary_dim / 2
    + i): rotate-half of the reordered q / k is the interleaved rotary of the original, and q . k is unchanged."""
    heads = rows.reshape(-1, head_dim, *rows.shape[1:])
    rotary = heads[:, :rotary_dim]
    reordered = torch.cat((rotary[:, 0::2], rotary[:, 1::2], heads[:, rotary_dim:]), dim=1)
    return reordered.reshape(rows.shape)
