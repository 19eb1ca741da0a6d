"""The parallel decoder layer (cohere, cohere2): attention and MLP side by side on one norm's output, both joining
the residual at once."""

from torch import nn

from .attention_fused import ModelAttention as Attention
from .mlp_gated import ModelMLP as MLP
from .moe import ModelSparseMoeBlock as SparseMoeBlock
from .moe import is_moe_layer
from .norm_rms import ModelRMSNorm as Norm

# which layers' MLP is a sparse-MoE block: None, none; "all", every one; a config key, the layers is_moe_layer picks
MOE_LAYERS = None
NORM_EPS = "rms_norm_eps"   # the config key of the norms' epsilon
MLP_NORM = False            # the MLP on a norm of its own (post_attention_layernorm: gpt_neox)
PARALLEL_KEY = None         # the config key that makes the layer parallel, else sequential (use_parallel_residual)


class ModelParallelDecoderLayer(nn.Module):
    """Returns (residual, attn(norm(h)) + mlp(norm(h))): the next norm adds them, as models/qwen's layers chain."""

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
