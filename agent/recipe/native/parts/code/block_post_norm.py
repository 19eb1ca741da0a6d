"""The post-norm decoder layer (olmo2): attention and MLP each on the residual stream as it is, their outputs normed
before they join it."""

from torch import nn

from .attention_fused import ModelAttention as Attention
from .mlp_gated import ModelMLP as MLP
from .moe import ModelSparseMoeBlock as SparseMoeBlock
from .moe import is_moe_layer
from .norm_rms import ModelRMSNorm as Norm

# which layers' MLP is a sparse-MoE block: None, none; "all", every one; a config key, the layers is_moe_layer picks
MOE_LAYERS = None
NORM_EPS = "rms_norm_eps"   # the config key of the norms' epsilon


class ModelPostNormDecoderLayer(nn.Module):
    """Returns (residual, hidden) as the pre-norm layer does: the next layer (or the final norm) adds them."""

    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__()
        self.self_attn = Attention(config, infer_config, comm_manager, layer_idx, prefix=f"{prefix}.self_attn")
        if MOE_LAYERS == "all":
            self.mlp = SparseMoeBlock(config, infer_config, comm_manager, prefix=f"{prefix}.mlp")
        elif MOE_LAYERS is not None:
            mlp = SparseMoeBlock if is_moe_layer(config, layer_idx) else MLP
            self.mlp = mlp(config, infer_config, comm_manager, prefix=f"{prefix}.mlp")
        else:
            self.mlp = MLP(config, infer_config, comm_manager, prefix=f"{prefix}.mlp")
        self.post_attention_layernorm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS))
        self.post_feedforward_layernorm = Norm(config.hidden_size, eps=getattr(config, NORM_EPS))

    def forward(self, hidden_states, cos_sin, past_residual, forward_metadata):
        if past_residual is not None:
            hidden_states = past_residual + hidden_states
        hidden_states = hidden_states + self.post_attention_layernorm(
            self.self_attn(hidden_states, cos_sin, forward_metadata))
        return hidden_states, self.post_feedforward_layernorm(self.mlp(hidden_states))
