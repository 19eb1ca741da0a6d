"""The decoder layer: attention and MLP (or sparse-MoE block), each behind its norm, as upstream's models/qwen
chains them."""

from .layer import FIXED_NORM_EPS, NORM_EPS, ModelDecoderLayerBase
from .norm_rms import ModelRMSNorm as Norm

SANDWICH = False        # post-attention and pre/post-feedforward norms around attention and MLP (gemma2, gemma3)
RESIDUAL_MULTIPLIER = False  # the attention's and the MLP's outputs times config.residual_multiplier (granite)


class ModelDecoderLayer(ModelDecoderLayerBase):
    """Returns (residual, hidden) as models/qwen's layer does: the next norm adds them (npu_add_rms_norm)."""

    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__(config, infer_config, comm_manager, layer_idx, prefix)
        if RESIDUAL_MULTIPLIER:
            self.residual_multiplier = config.residual_multiplier
        self.input_layernorm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS) if NORM_EPS else FIXED_NORM_EPS)
        self.post_attention_layernorm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS) if NORM_EPS else FIXED_NORM_EPS)
        if SANDWICH:
            self.pre_feedforward_layernorm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS) if NORM_EPS else FIXED_NORM_EPS)
            self.post_feedforward_layernorm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS) if NORM_EPS else FIXED_NORM_EPS)

    def forward(self, hidden_states, cos_sin, past_residual, forward_metadata):
        hidden_states, residual = self.input_layernorm(hidden_states, past_residual)
        hidden_states = self.self_attn(hidden_states, cos_sin, forward_metadata)
        if SANDWICH:
            # the attention's and the MLP's outputs are normed before they join the residual
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
            hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        else:
            if RESIDUAL_MULTIPLIER:
                hidden_states = hidden_states * self.residual_multiplier
            hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
            hidden_states = self.mlp(hidden_states)
            if RESIDUAL_MULTIPLIER:
                hidden_states = hidden_states * self.residual_multiplier
        return residual, hidden_states
