"""llama4's attention temperature of its NoPE layers (attn_temperature_tuning): each token's query times a scale that
grows with its position, computed in float32 as transformers computes it."""

import torch


def temperature_scale(positions, floor_scale, attn_scale):
    """1 + attn_scale log(1 + floor((position + 1) / floor_scale)), float32, one per token."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
