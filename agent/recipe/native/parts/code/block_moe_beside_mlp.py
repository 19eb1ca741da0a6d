"""The sandwich decoder layer with a sparse-MoE branch beside its dense MLP (gemma4's enable_moe_block): on the
residual stream after the attention, the dense MLP behind its input norm and the sparse-MoE block (its router on the
stream itself, its experts behind their own norm), each branch's output normed, the two summed and normed again
before they join the stream."""

from .block import ATTENTION_NORM, ATTENTION_OUT_NORM, LAYER_SCALAR, MLP_NORM, MLP_OUT_NORM, ModelDecoderLayer
from .layer import NORM_EPS
from .moe import ModelSparseMoeBlock as SparseMoeBlock
from .norm_rms import ModelRMSNorm as Norm

MOE_OUT_NORM = "post_feedforward_layernorm_2"   # the norm of the sparse-MoE branch's output (the checkpoint's name)
BRANCHES_NORM = "post_feedforward_layernorm"    # the norm of the two branches' sum


class ModelMoeBesideMlpDecoderLayer(ModelDecoderLayer):
    """Returns (residual, hidden) as the sandwich layer does: the next norm adds them."""

    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__(config, infer_config, comm_manager, layer_idx, prefix)
        # the checkpoint's router, experts and their norm renamed into it (parts/moe_scaled_router.py's MOE_NAME)
        self.moe_block = SparseMoeBlock(config, infer_config, comm_manager, prefix=f"{prefix}.moe_block")
        setattr(self, MOE_OUT_NORM, Norm(config.hidden_size, eps=getattr(config, NORM_EPS)))
        setattr(self, BRANCHES_NORM, Norm(config.hidden_size, eps=getattr(config, NORM_EPS)))

    def forward(self, hidden_states, cos_sin, past_residual, forward_metadata):
        hidden_states, residual = getattr(self, ATTENTION_NORM)(hidden_states, past_residual)
        hidden_states = getattr(self, ATTENTION_OUT_NORM)(self.self_attn(hidden_states, cos_sin, forward_metadata))
        hidden_states, residual = getattr(self, MLP_NORM)(hidden_states, residual)
        dense = getattr(self, MLP_OUT_NORM)(self.mlp(hidden_states))
        # the sparse-MoE branch reads the residual stream itself (its router; its experts through their norm)
        routed = getattr(self, MOE_OUT_NORM)(self.moe_block(residual))
        hidden_states = getattr(self, BRANCHES_NORM)(dense + routed)
        if LAYER_SCALAR:
            # (residual + hidden) * s as the next norm adds them: plain torch multiplies
            scalar = self.layer_scalar.to(hidden_states.dtype)
            residual, hidden_states = residual * scalar, hidden_states * scalar
        return residual, hidden_states
