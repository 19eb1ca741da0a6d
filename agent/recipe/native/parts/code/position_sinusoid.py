"""Fixed sinusoid positions (CTRL's pos_encoding): computed here, looked up per token (TND) and added to the
embedding."""

import torch
import torch.nn.functional as F
from torch import nn


def ctrl_sinusoid_table(rows, width):
    """transformers' CTRL positional_encoding: angle(pos, i) = pos / 10000^(2 (i // 2) / width), sin of the even
    columns then cos of the odd ones, computed in float32 as there, then the default dtype."""
    columns = torch.arange(width, dtype=torch.int64).float().unsqueeze(0)
    angles = torch.arange(rows, dtype=torch.int64).float().unsqueeze(1) * (1 / torch.pow(10000, (2 * (columns // 2))
                                                                                         / width))
    table = torch.cat([torch.sin(angles[:, 0::2]), torch.cos(angles[:, 1::2])], dim=-1)
    return table.to(torch.get_default_dtype())


class ModelSinusoidPositionEmbedding(nn.Module):
    """The position table (every rank holds it whole; no checkpoint tensor); forward gives the rows of
    `position_ids` [tokens, hidden]."""

    def __init__(self, config):
        super().__init__()
        self.register_buffer("weight", ctrl_sinusoid_table(config.max_position_embeddings, config.hidden_size),
                             persistent=False)

    def forward(self, position_ids):
        return F.embedding(position_ids, self.weight)
