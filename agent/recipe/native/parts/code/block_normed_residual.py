"""The decoder layer whose residual is its norm's output, each branch joining it weighted (minimax's): h = norm(x),
s = alpha_a h + beta_a attn(h), n = norm2(s), then alpha_m n + beta_m mlp(n) — the attention's weights the config's
linear_attn_* or full_attn_* factors by the layer's type, the MLP's mlp_alpha_factor / mlp_beta_factor."""

from .layer import LINEAR_ATTENTION, NORM_EPS, ModelDecoderLayerBase
from .norm_rms import ModelRMSNorm as Norm

# config.layer_types' name of a layer -> the prefix of its attention's alpha / beta factor keys
ATTENTION_FACTOR_KEYS = (("linear_attention", "linear_attn"), ("full_attention", "full_attn"))


class ModelNormedResidualDecoderLayer(ModelDecoderLayerBase):
    """Returns (None, hidden): the stream leaves the layer whole, nothing left for the next norm to add."""

    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__(config, infer_config, comm_manager, layer_idx, prefix)
        self.input_layernorm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS))
        self.post_attention_layernorm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS))
        key = dict(ATTENTION_FACTOR_KEYS)[config.layer_types[layer_idx]]
        self.attn_alpha = getattr(config, f"{key}_alpha_factor")
        self.attn_beta = getattr(config, f"{key}_beta_factor")
        self.mlp_alpha = config.mlp_alpha_factor
        self.mlp_beta = config.mlp_beta_factor

    def forward(self, hidden_states, cos_sin, past_residual, forward_metadata):
        # the norm's output is the residual (past_residual is None: every layer leaves its stream whole)
        hidden_states = self.input_layernorm(hidden_states)
        if LINEAR_ATTENTION and self.is_linear:
            out = self.linear_attn(hidden_states, forward_metadata)
        else:
            out = self.self_attn(hidden_states, cos_sin, forward_metadata)
        hidden_states = self.post_attention_layernorm(hidden_states * self.attn_alpha + out * self.attn_beta)
        return None, hidden_states * self.mlp_alpha + self.mlp(hidden_states) * self.mlp_beta
