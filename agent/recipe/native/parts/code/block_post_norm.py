"""The post-norm decoder layer (olmo2): attention and MLP each on the residual stream as it is, their outputs normed
before they join it."""

from .layer import LINEAR_ATTENTION, NORM_EPS, ModelDecoderLayerBase
from .norm_rms import ModelRMSNorm as Norm


class ModelPostNormDecoderLayer(ModelDecoderLayerBase):
    """Returns (residual, hidden) as the pre-norm layer does: the next layer (or the final norm) adds them."""

    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__(config, infer_config, comm_manager, layer_idx, prefix)
        if LINEAR_ATTENTION and self.is_linear:
            # a linear-attention layer norms its inputs (olmo_hybrid): pre-norm, its norms in the checkpoint's names
            self.input_layernorm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS))
            self.post_attention_layernorm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS))
            return
        self.post_attention_layernorm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS))
        self.post_feedforward_layernorm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS))

    def forward(self, hidden_states, cos_sin, past_residual, forward_metadata):
        if past_residual is not None:
            hidden_states = past_residual + hidden_states
        if LINEAR_ATTENTION and self.is_linear:
            hidden_states = hidden_states + self.linear_attn(self.input_layernorm(hidden_states), forward_metadata)
            return hidden_states, self.mlp(self.post_attention_layernorm(hidden_states))
        hidden_states = hidden_states + self.post_attention_layernorm(
            self.self_attn(hidden_states, cos_sin, forward_metadata))
        return hidden_states, self.post_feedforward_layernorm(self.mlp(hidden_states))
