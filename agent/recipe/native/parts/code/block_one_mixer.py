"""One mixer behind one norm (nemotron_h's blocks, mamba2's layers): each layer is an attention, a Mamba2 mixer or an
MLP — config.layer_types names which — applied to the norm of the residual stream, its output added to it. The
layer keeps the checkpoint's names for its norm and its mixer."""

from torch import nn

from .attention_fused import ModelAttention as Attention
from .layer import FIXED_NORM_EPS, LINEAR_LAYER_TYPE, NORM_EPS
from .linear_attention_mamba2 import ModelMamba2Mixer as LinearAttention
from .mlp_gated import ModelMLP as MLP
from .norm_rms import ModelRMSNorm as Norm

MIXER_NAME = "mixer"            # the checkpoint's names of the layer's mixer and its norm
MIXER_NORM = "norm"
MIXER_LAYER_TYPES = True        # config.layer_types names each layer's mixer; else every layer a Mamba2 mixer (mamba2)
ATTENTION_LAYER_TYPE = "full_attention"
MLP_LAYER_TYPE = "mlp"


class ModelOneMixerDecoderLayer(nn.Module):
    """Returns (residual, hidden) as the pre-norm layer does: the next norm adds them (npu_add_rms_norm)."""

    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__()
        if MIXER_LAYER_TYPES:
            kind = config.layer_types[layer_idx]
            self.is_attention = kind == ATTENTION_LAYER_TYPE
            self.is_linear = kind == LINEAR_LAYER_TYPE
            if self.is_linear:
                mixer = LinearAttention(config, infer_config, comm_manager, layer_idx, prefix=f"{prefix}.{MIXER_NAME}")
            elif self.is_attention:
                mixer = Attention(config, infer_config, comm_manager, layer_idx, prefix=f"{prefix}.{MIXER_NAME}")
            elif kind == MLP_LAYER_TYPE:
                mixer = MLP(config, infer_config, comm_manager, prefix=f"{prefix}.{MIXER_NAME}")
            else:
                raise ValueError(f"layer {layer_idx} is a {kind!r} layer, which the generated file does not write")
        else:
            mixer = LinearAttention(config, infer_config, comm_manager, layer_idx, prefix=f"{prefix}.{MIXER_NAME}")
        setattr(self, MIXER_NAME, mixer)
        setattr(self, MIXER_NORM, Norm(config.hidden_size, eps=getattr(config, NORM_EPS) if NORM_EPS else FIXED_NORM_EPS))

    @property
    def cache_entries(self):
        """The mixer's caches (the attention's KV cache, the Mamba2 mixer's states); an MLP layer has none."""
        if MIXER_LAYER_TYPES and not (self.is_attention or self.is_linear):
            return []
        return getattr(self, MIXER_NAME).cache_entries

    def forward(self, hidden_states, cos_sin, past_residual, forward_metadata):
        hidden_states, residual = getattr(self, MIXER_NORM)(hidden_states, past_residual)
        if not MIXER_LAYER_TYPES or self.is_linear:
            hidden_states = getattr(self, MIXER_NAME)(hidden_states, forward_metadata)
        elif self.is_attention:
            hidden_states = getattr(self, MIXER_NAME)(hidden_states, cos_sin, forward_metadata)
        else:
            hidden_states = getattr(self, MIXER_NAME)(hidden_states)
        return residual, hidden_states
