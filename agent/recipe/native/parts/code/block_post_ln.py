"""The post-LN decoder layer (openai-gpt): each branch's output joins the residual stream, then the sum is normed —
the stream itself leaves the layer normed."""

from .layer import FIXED_NORM_EPS, NORM_EPS, ModelDecoderLayerBase
from .norm_rms import ModelRMSNorm as Norm


class ModelPostLnDecoderLayer(ModelDecoderLayerBase):
    """h = norm(h + attn(h)), then norm(h + mlp(h)); returns (None, hidden): nothing is left for the next layer to
    add (every layer is post-LN, so `past_residual` is None)."""

    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__(config, infer_config, comm_manager, layer_idx, prefix)
        self.post_attention_layernorm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS) if NORM_EPS else FIXED_NORM_EPS)
        self.post_feedforward_layernorm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS) if NORM_EPS else FIXED_NORM_EPS)

    def forward(self, hidden_states, cos_sin, past_residual, forward_metadata):
        # the norm called with the residual adds it first: norm(h + attn(h))
        hidden_states, _ = self.post_attention_layernorm(self.self_attn(hidden_states, cos_sin, forward_metadata),
                                                         hidden_states)
        hidden_states, _ = self.post_feedforward_layernorm(self.mlp(hidden_states), hidden_states)
        return None, hidden_states
