"""LayerNorm (mean and variance over the hidden axis, a weight, with or without a bias), with the interface of the
RMSNorm parts: called with a residual, the residual joins first and (normed, sum) comes back."""

import torch
import torch.nn.functional as F
from torch import nn

NORM_BIAS = True        # the norms' bias: a literal
NORM_OFFSET = False     # the weight is stored as w - 1 and applied as 1 + w (nemotron's LayerNorm1P)


class ModelLayerNorm(nn.Module):
    """F.layer_norm in float32, cast back to the input's dtype, as transformers' LayerNorm variants compute it
    (plain torch: npu_rms_norm / npu_add_rms_norm are RMS only); the residual add in torch."""

    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if NORM_OFFSET else torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if NORM_BIAS else None
        self.variance_epsilon = eps

    def _norm(self, hidden_states):
        weight = self.weight.float() + 1.0 if NORM_OFFSET else self.weight.float()
        bias = self.bias.float() if NORM_BIAS else None
        normed = F.layer_norm(hidden_states.float(), hidden_states.shape[-1:], weight, bias, self.variance_epsilon)
        return normed.to(hidden_states.dtype)

    def forward(self, hidden_states, *args):
        if not args:
            return self._norm(hidden_states)
        if args[0] is not None:
            hidden_states = args[0] + hidden_states
        return self._norm(hidden_states), hidden_states
