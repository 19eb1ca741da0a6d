"""beam's query scale of its NoPE layers (scalable softmax): each token's query times a power of its position,
computed in float32 as transformers computes it."""

import torch

# the architecture's constants (BeamModel's compute_attention_scaling; no config key holds them)
SSMAX_LENGTH = 2048
SSMAX_EXPONENT = 0.1


def ssmax_scale(positions):
    """(1 + (position + 1) / SSMAX_LENGTH) ** SSMAX_EXPONENT, float32, one per token."""
    return torch.exp(SSMAX_EXPONENT * torch.log1p((positions.float() + 1) / SSMAX_LENGTH))
