"""ALiBi: each head adds slope x (key position - query position) to its attention scores; no rotary, no position
table (Press et al., 2108.12409)."""

import math

import torch
from torch import nn

ALIBI_BIAS_MAX = 8      # the slopes' exponent range (mpt: config.attn_config.alibi_bias_max)


def alibi_slopes(heads, bias_max):
    """The heads' slopes, float32: 2 ** (-bias_max * k / n), k = 1 .. n, for n the largest power of two up to
    `heads`; the odd powers of the next one's, 2 ** (-bias_max * k / 2n), k = 1, 3, ..., for the rest (bloom's
    _get_alibi_slopes; mpt's build_mpt_alibi_tensor gives the same)."""
    power = 2 ** math.floor(math.log2(heads))
    exponents = [bias_max * k / power for k in range(1, power + 1)]
    exponents += [bias_max * k / (2 * power) for k in range(1, 2 * (heads - power), 2)]
    return torch.pow(2.0, -torch.tensor(exponents, dtype=torch.float32))


class ModelAlibiSlopes(nn.Module):
    """The slopes of one rank's heads (heads `first` .. `first + count - 1` of the model's), float32."""

    def __init__(self, config, first, count):
        super().__init__()
        slopes = alibi_slopes(config.num_attention_heads, ALIBI_BIAS_MAX)[first:first + count]
        self.register_buffer("slopes", slopes, persistent=False)

    def forward(self, key_offsets):
        """The bias [heads, ..., keys] of keys at `key_offsets` [..., keys] from their query (<= 0 before it)."""
        return self.slopes.view(-1, *([1] * key_offsets.dim())) * key_offsets.float()
