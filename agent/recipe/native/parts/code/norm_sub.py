"""RMSNorm over a width tensor parallel splits over attn_tp_group (bitnet's sub-norms: attn_sub_norm of the attention's
output before o_proj, ffn_sub_norm of the MLP's act(gate) * up before down_proj): each rank holds its slice of the
weight and the mean of squares is taken over the whole width (the ranks' sums all-reduced)."""

import torch
import torch.distributed as dist
from torch import nn


class ModelSubRMSNorm(nn.Module):
    """w * (x / rms(x)) over `width` as bitnet's norm computes it (normalised in float32, weighted in the run dtype);
    plain torch (npu_rms_norm normalises one rank's slice, not the width split over the ranks)."""

    def __init__(self, width, eps, comm_manager, tp_size):
        super().__init__()
        if width % tp_size:
            raise ValueError(f"a norm over a width of {width} with tensor-parallel size {tp_size}: the width does not "
                             f"split evenly; choose attn_tp_size dividing {width}")
        self.width = width
        self.tp_size = tp_size
        self.comm_manager = comm_manager
        self.tp_rank = comm_manager.get_rank("attn_tp_group") if tp_size > 1 else 0
        self.weight = nn.Parameter(torch.ones(width // tp_size), requires_grad=False)
        self.weight.weight_loader = self._load
        self.variance_epsilon = eps

    def _load(self, param, weight):
        """The checkpoint's weight over the whole width: this rank's slice."""
        size = self.width // self.tp_size
        param.data.copy_(weight[self.tp_rank * size:(self.tp_rank + 1) * size])

    def forward(self, hidden_states):
        states = hidden_states.float()
        square_sum = states.pow(2).sum(-1, keepdim=True)
        if self.tp_size > 1:
            dist.all_reduce(square_sum, group=self.comm_manager.get_group("attn_tp_group"))
        states = states * torch.rsqrt(square_sum / self.width + self.variance_epsilon)
        return self.weight * states.to(hidden_states.dtype)
