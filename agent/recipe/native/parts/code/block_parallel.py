"""The parallel decoder layer (cohere, cohere2): attention and MLP side by side on one norm's output, both joining
the residual at once."""

from .layer import NORM_EPS, ModelDecoderLayerBase
from .norm_rms import ModelRMSNorm as Norm


class ModelParallelDecoderLayer(ModelDecoderLayerBase):
    """Returns (residual, attn(norm(h)) + mlp(norm(h))): the next norm adds them, as models/qwen's layers chain."""

    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__(config, infer_config, comm_manager, layer_idx, prefix)
        self.input_layernorm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS))

    def forward(self, hidden_states, cos_sin, past_residual, forward_metadata):
        hidden_states, residual = self.input_layernorm(hidden_states, past_residual)
        attended = self.self_attn(hidden_states, cos_sin, forward_metadata)
        return residual, attended + self.mlp(hidden_states)
