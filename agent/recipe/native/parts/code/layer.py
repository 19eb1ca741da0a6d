"""What every decoder layer shape shares (block.py, block_post_norm.py, block_parallel.py): the attention, the
layer's MLP — the dense MLP or the sparse-MoE block, chosen per layer — and the config key of its norms' epsilon. A
layer shape subclasses ModelDecoderLayerBase and calls its __init__ first; the assembler merges the base into that
one subclass, so the generated file has the layer class alone."""

from torch import nn

from .attention_fused import ModelAttention as Attention
from .linear_attention_gdn import ModelGatedDeltaNet as LinearAttention
from .mlp_gated import ModelMLP as MLP
from .moe import ModelSparseMoeBlock as SparseMoeBlock
from .moe import is_moe_layer

# which layers' MLP is a sparse-MoE block: None, none; "all", every one; a config key (first_k_dense_replace,
# decoder_sparse_step, ...), the layers is_moe_layer picks by it
MOE_LAYERS = None
NORM_EPS = "rms_norm_eps"   # the config key of the layer norms' epsilon (the shapes import it)
FIXED_NORM_EPS = 1e-5       # their epsilon where no config key holds it (NORM_EPS None: opt's LayerNorms)
# config.layer_types' linear_attention layers hold a linear attention in place of self_attn (qwen3_next's Gated DeltaNet)
LINEAR_ATTENTION = False
LINEAR_LAYER_TYPE = "linear_attention"   # config.layer_types' name of those layers (lfm2's short convolution: conv)
NO_ATTENTION = False    # every layer a linear-attention layer (granitemoehybrid's Mamba2 layers only): no attention built
# the layer's name of its linear attention (kimi_linear's Kimi Delta Attention is stored under self_attn)
LINEAR_ATTN_NAME = "linear_attn"


class ModelDecoderLayerBase(nn.Module):
    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__()
        if LINEAR_ATTENTION:
            self.is_linear = config.layer_types[layer_idx] == LINEAR_LAYER_TYPE
        if LINEAR_ATTENTION and self.is_linear:
            setattr(self, LINEAR_ATTN_NAME, LinearAttention(config, infer_config, comm_manager, layer_idx, prefix=f"{prefix}.{LINEAR_ATTN_NAME}"))
        elif NO_ATTENTION:
            # a checkpoint of the family with attention layers needs the file derived with them
            raise ValueError(f"layer {layer_idx} is a {config.layer_types[layer_idx]!r} layer: this file writes no "
                             "attention; derive the recipe from a checkpoint that has attention layers")
        else:
            self.self_attn = Attention(config, infer_config, comm_manager, layer_idx, prefix=f"{prefix}.self_attn")
        if MOE_LAYERS == "all":
            self.mlp = SparseMoeBlock(config, infer_config, comm_manager, prefix=f"{prefix}.mlp")
        elif MOE_LAYERS is not None:
            mlp = SparseMoeBlock if is_moe_layer(config, layer_idx) else MLP
            self.mlp = mlp(config, infer_config, comm_manager, prefix=f"{prefix}.mlp")
        else:
            self.mlp = MLP(config, infer_config, comm_manager, prefix=f"{prefix}.mlp")
