"""Absolute positions: a table of position rows (learned, or fixed sinusoids), looked up per token (TND) and added to
the embedding."""

import math

import torch
import torch.nn.functional as F
from torch import nn

POSITION_OFFSET = 0     # the table's row of position 0 (opt, biogpt, xglm: 2, fairseq's padding rows first)
SINUSOIDAL = False      # fixed sin | cos rows (xglm): computed here, no checkpoint tensor


def sinusoid_table(rows, width):
    """fairseq's sinusoidal rows, as transformers' XGLMSinusoidalPositionalEmbedding computes them: [sin | cos] of
    position x 10000^(-i / (width/2 - 1)), in the default dtype."""
    half = width // 2
    freqs = torch.exp(torch.arange(half, dtype=torch.int64).float() * -(math.log(10000) / (half - 1)))
    angles = torch.arange(rows, dtype=torch.int64).float().unsqueeze(1) * freqs.unsqueeze(0)
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if width % 2:
        table = torch.cat([table, torch.zeros(rows, 1)], dim=1)
    return table.to(torch.get_default_dtype())


class ModelAbsolutePositionEmbedding(nn.Module):
    """The position table (every rank holds it whole: it is small); forward gives the rows of `position_ids`
    [tokens, hidden]."""

    def __init__(self, config):
        super().__init__()
        rows = config.max_position_embeddings
        if POSITION_OFFSET:
            rows += POSITION_OFFSET         # the rows before position 0
        if SINUSOIDAL:
            self.register_buffer("weight", sinusoid_table(rows, config.hidden_size), persistent=False)
        else:
            self.weight = nn.Parameter(torch.empty(rows, config.hidden_size), requires_grad=False)

    def forward(self, position_ids):
        if POSITION_OFFSET:
            position_ids = position_ids + POSITION_OFFSET
        return F.embedding(position_ids, self.weight)
