"""LayerNorm without a weight or bias (olmo's), with the interface of the RMSNorm parts: called with a residual, the
residual joins first and (normed, sum) comes back."""

import torch.nn.functional as F
from torch import nn


class ModelWeightlessLayerNorm(nn.Module):
    """F.layer_norm in float32 with no weight or bias, cast back to the input's dtype, as transformers computes it
    (plain torch: npu_rms_norm / npu_add_rms_norm are RMS only); the residual add in torch."""

    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.variance_epsilon = eps

    def _norm(self, hidden_states):
        normed = F.layer_norm(hidden_states.float(), self.normalized_shape, None, None, self.variance_epsilon)
        return normed.to(hidden_states.dtype)

    def forward(self, hidden_states, *args):
        if not args:
            return self._norm(hidden_states)
        if args[0] is not None:
            hidden_states = args[0] + hidden_states
        return self._norm(hidden_states), hidden_states
