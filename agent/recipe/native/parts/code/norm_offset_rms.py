"""RMSNorm x * (1 + w) (gemma's): the kernels of x * w on a weight that holds 1 + w."""

from .norm_rms import ModelRMSNorm


class ModelOffsetRMSNorm(ModelRMSNorm):
    """RMSNorm scaled by (1 + weight), as the architecture writes it: the checkpoint's weight loads as 1 + w
    (load_offset_weight), so npu_rms_norm / npu_add_rms_norm compute it exactly; returns (normed, residual)
    when called with a residual, as models/qwen's norm does."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = load_offset_weight


def load_offset_weight(param, weight):
    """The checkpoint's w into the parameter as 1 + w (from the checkpoint's tensor at every load: never twice)."""
    param.data.copy_(weight.float() + 1.0)
