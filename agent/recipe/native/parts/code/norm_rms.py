"""RMSNorm x * w as upstream's models/qwen runs it."""

import torch
import torch_npu
from torch import nn


class ModelRMSNorm(nn.Module):
    """npu_rms_norm; called with a residual, npu_add_rms_norm (the residual add fused): returns
    (normed, residual) as models/qwen's norm does."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states, *args):
        if not args:
            return torch_npu.npu_rms_norm(hidden_states, self.weight, self.variance_epsilon)[0]
        if args[0] is None:
            return torch_npu.npu_rms_norm(hidden_states, self.weight, self.variance_epsilon)[0], hidden_states
        normed, _, residual = torch_npu.npu_add_rms_norm(args[0], hidden_states, self.weight, self.variance_epsilon)
        return normed, residual
