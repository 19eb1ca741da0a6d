"""The parallel decoder layer (cohere, cohere2): attention and MLP side by side on one norm's output, both joining
the residual at once."""

from .layer import NORM_EPS, ModelDecoderLayerBase
from .norm_rms import ModelRMSNorm as Norm

MLP_NORM = False            # the MLP on a norm of its own (post_attention_layernorm: gpt_neox)
PARALLEL_KEY = None         # the config key that makes the layer parallel, else sequential (use_parallel_residual)


class ModelParallelDecoderLayer(ModelDecoderLayerBase):
    """Returns (residual, attn(norm(h)) + mlp(norm(h))): the next norm adds them, as models/qwen's layers chain."""

    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__(config, infer_config, comm_manager, layer_idx, prefix)
        self.input_layernorm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS))
        if MLP_NORM:
            self.post_attention_layernorm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS))
        if PARALLEL_KEY is not None:
            self.parallel = getattr(config, PARALLEL_KEY)

    def forward(self, hidden_states, cos_sin, past_residual, forward_metadata):
        hidden_states, residual = self.input_layernorm(hidden_states, past_residual)
        attended = self.self_attn(hidden_states, cos_sin, forward_metadata)
        if PARALLEL_KEY is not None and not self.parallel:
            # sequential: h + attn(norm(h)), then that + mlp(norm2(that))
            hidden_states, residual = self.post_attention_layernorm(attended, residual)
            return residual, self.mlp(hidden_states)
        if MLP_NORM:
            hidden_states = self.post_attention_layernorm(residual)
        return residual, attended + self.mlp(hidden_states)
