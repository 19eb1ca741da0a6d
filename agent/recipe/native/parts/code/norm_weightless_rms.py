"""RMSNorm without a weight (nanochat's): npu_rms_norm on a weight of ones, a buffer the checkpoint does not hold;
called with a residual, the residual joins first (npu_add_rms_norm) and (normed, sum) comes back."""

import torch
import torch_npu
from torch import nn


class ModelWeightlessRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.register_buffer("ones", torch.ones(hidden_size), persistent=False)
        self.variance_epsilon = eps

    def forward(self, hidden_states, *args):
        weight = self.ones.to(hidden_states.dtype)
        if not args:
            return torch_npu.npu_rms_norm(hidden_states, weight, self.variance_epsilon)[0]
        if args[0] is None:
            return torch_npu.npu_rms_norm(hidden_states, weight, self.variance_epsilon)[0], hidden_states
        normed, _, residual = torch_npu.npu_add_rms_norm(args[0], hidden_states, weight, self.variance_epsilon)
        return normed, residual
