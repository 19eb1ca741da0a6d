"""Attention over the paged KV cache with npu_fused_infer_attention_score_v2, as upstream's models/qwen runs it."""

import torch
import torch.distributed as dist
import torch_npu
import torchair
from torch import nn

from executor.core.kv_cache.cache_info import CacheEntry
from executor.utils.forward_metadata import ForwardMetaData
from module.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

from .context_parallel import cp_key_rows, gather_cp, prefill_cp
from .norm_qk_full import ModelFullWidthRMSNorm
from .norm_rms import ModelRMSNorm as Norm
from .norm_sub import ModelSubRMSNorm
from .norm_weightless_rms import ModelWeightlessRMSNorm
from .attention_chunked import chunk_bounds
from .attention_ssmax import ssmax_scale
from .attention_temperature import temperature_scale
from .rotary import half_from_interleaved, layer_rope_table, rotary_width

# upstream's cache kinds (executor/core/kv_cache)
FULL = "FullAttention"
SLIDING = "SlidingWindow"

QKV = "merged_qkv_proj"         # the q/k/v projection: "qkv_proj" where the checkpoint stores it fused (phi3)
QKV_BIAS = False                # q/k/v biases: a literal, or the config key that sets them
O_BIAS = False                  # o_proj's bias (module.linear adds it on row-parallel rank 0): a literal, the config
                                # key that sets it, or the last layer alone (gpt_neox_japanese's dense_bias)
QK_NORM = False                 # per-head RMSNorm of queries and keys before the rotary (qwen3, gemma3)
QK_NORM_FULL = False            # RMSNorm of queries and keys over all heads' width (olmo2)
QK_NORM_AFTER_ROPE = False      # the per-head q / k norms on the rotated queries and keys (hunyuan)
# llama4: one weightless per-head RMSNorm of the rotated queries and keys, on the layers that rotate, where
# config.use_qk_norm
QK_L2_NORM = False
Q_NORM = "q_norm"               # the q / k norms' module names (the checkpoint's)
K_NORM = "k_norm"
QUERY_PRE_ATTN_SCALAR = False   # softmax scale query_pre_attn_scalar ** -0.5 (else head_dim ** -0.5)
ATTENTION_MULTIPLIER = False    # softmax scale config.attention_multiplier (granite)
ROPE_BY_LAYER_TYPE = False      # cos / sin per layer type (gemma3's local and global bases)
ROPE_BY_LAYER_THETA = None      # the config key of each layer's rope base (granite_swa: layer_rope_theta; 0: NoPE)
WINDOWS = False                 # the architecture attends in a sliding window where its config says so
LAYER_TYPE_WINDOWS = False      # which layers: config.layer_types' sliding_attention ones (else every layer)
FULL_LAYERS_WINDOWED = False    # which layers: config.layer_types' full_attention ones (minimax: its mask windows them)
WINDOW_DECODE_ONLY = False      # the window binds decode steps alone, a prefill attends to the whole prompt (moshi:
                                # transformers' cache keeps the window, its mask is causal): the prefill's band the
                                # op's unbounded pre_tokens, 2 ** 31 - 1
LOCAL_LAYERS = False            # which layers: config.attention_layers' "local" ones, window config.window_size (gpt_neo)
UNSCALED = False                # softmax of q . k unscaled (gpt_neo)
SINKS = False                   # a learnable sink logit per head in the softmax (gpt_oss)
NORM_EPS = "rms_norm_eps"       # the config key of the norms' epsilon
MTP = False                     # decode steps of next_n + 1 tokens per sequence (an MTP draft verified)
NOPE_LAYERS = None              # layers without rotary: "no_rope_layers" (smollm3: the config's 0s), "global_nope"
                                # (exaone4: the full-attention layers of a config with a sliding window),
                                # "layer_rope_theta" (granite_swa: a rope base of 0), "sliding_or_dense_prefix"
                                # (cohere2_moe: the sliding layers, and the dense-MLP ones where
                                # prefix_dense_sliding_window_pattern is 1), "position_embedding_type"
                                # (granitemoehybrid: every layer, unless the config says "rope"), "typed_rope"
                                # (beam: the layer types rope_parameters gives settings; the others have no table)
ROPE_INTERLEAVED = False        # the architecture rotates pairs (2i, 2i + 1): q/k rows reordered at load (glm, ernie4_5)
QKV_GROUPS = ()                 # fused qkv_proj stored in groups (count, sections' order), reordered at load
ROTARY = True                   # q and k rotated (else the positions were added to the embedding: gpt2)
CONTEXT_PARALLEL = False        # prefill context parallel (parallel_config.cp_size): context_parallel.py's segments
OUTPUT_GATE = False             # q_proj holds each head's query and an output gate: out * sigmoid(gate) (qwen3_next)
MULTI_QUERY = False             # key/value heads as falcon's config gives them (num_kv_heads; 1 where multi_query)
GATE_PROJ = None                # the checkpoint's name of an output gate's own projection: out * act(gate(x)) (afmoe)
GATE_SOFTPLUS = False           # that gate's activation a softplus (laguna), else a sigmoid
GATE_PER_HEAD = False           # that gate one per head (over its head_dim), else one per channel
ATTN_SUB_NORM = False           # an RMSNorm of the attention's output over all heads' width before o_proj (bitnet)
GATE_BIAS = False               # a bias of that gate, one per head, added before its activation (beam's gate_bias)
HEADS_PER_LAYER = None          # the config key of each layer's query heads (laguna: num_attention_heads_per_layer)
QUERY_POSITION_SCALE = False    # rotated queries times 1 + beta log(1 + floor(position / original)) (llama-4, ministral3)
V_NORM = False                  # the values RMS-normalised per head without a weight, in float32 (gemma4's v_norm)
HEAD_DIM_PER_LAYER = False      # each layer's head_dim its own (transformers' per_layer_config: gemma4's global layers)
SINK_LAYER_TYPES = ()           # with SINKS: the layer kinds alone with sinks (mimo_v2_flash: sliding); () every layer
V_HEAD_DIM = False              # value heads of config.v_head_dim, zero-padded to head_dim in qkv (mimo_v2_flash)
VALUE_SCALE = None              # the config key of a multiplier of the values (mimo_v2_flash: attention_value_scale)
KEY_SCALE = None                # the config key of a multiplier of the keys (falcon_h1: key_multiplier): the scale times it
KV_HEADS_BY_LAYER_TYPE = ()     # (layer kind, multiple of num_key_value_heads) pairs (mimo_v2_flash: sliding, 2)
KV_HEADS_PER_LAYER = False      # each layer's key/value heads its own (transformers' per_layer_config: gemma4's full layers)
K_EQ_V = None                   # (config key, layer kinds): those layers' values are k_proj's output (gemma4's attention_k_eq_v)
QUERY_TEMPERATURE = False       # NoPE layers' queries times temperature_scale(position) (llama4's attn_temperature_tuning)
QUERY_SSMAX = False             # NoPE layers' queries times ssmax_scale(position) (beam's; with NOPE_LAYERS "typed_rope")
CHUNKED = False                 # config.layer_types' chunked_attention layers attend within attention_chunk_size (llama4)


def key_value_heads(config):
    """falcon's key/value heads: one where multi_query outside the new decoder architecture, else num_kv_heads."""
    return 1 if config.multi_query and not config.new_decoder_architecture else config.num_kv_heads


def layer_windows(config):
    """Per layer: its sliding window, or None for full attention, as transformers decides it from the config."""
    if LOCAL_LAYERS:
        return [config.window_size if kind == "local" else None for kind in config.attention_layers[:config.num_hidden_layers]]
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * config.num_hidden_layers
    if FULL_LAYERS_WINDOWED:
        # the window on config.layer_types' full_attention layers (minimax's mask; its cache names none sliding)
        return [window if kind == "full_attention" else None for kind in config.layer_types[:config.num_hidden_layers]]
    if LAYER_TYPE_WINDOWS:
        return [window if kind == "sliding_attention" else None for kind in config.layer_types[:config.num_hidden_layers]]
    return [window] * config.num_hidden_layers


def layer_uses_rope(config, layer_idx):
    """Whether the layer rotates q and k, by the config rule transformers' attention follows."""
    if NOPE_LAYERS == "no_rope_layers":
        return bool(config.no_rope_layers[layer_idx])
    if NOPE_LAYERS == "global_nope":
        return not getattr(config, "sliding_window", None) or config.layer_types[layer_idx] == "sliding_attention"
    if NOPE_LAYERS == "sliding_or_dense_prefix":
        return (bool(config.sliding_window) and config.layer_types[layer_idx] == "sliding_attention"
                or config.mlp_layer_types[layer_idx] == "dense" and config.prefix_dense_sliding_window_pattern == 1)
    if NOPE_LAYERS == "layer_rope_theta":
        return bool(config.layer_rope_theta[layer_idx])
    if NOPE_LAYERS == "position_embedding_type":
        return config.position_embedding_type == "rope"
    if NOPE_LAYERS == "typed_rope":
        return isinstance(config.rope_parameters.get(config.layer_types[layer_idx]), dict)
    return True


def copy_weight(param, weight):
    param.data.copy_(weight)


def window_start(kv_len, window, block_size):
    """Where the blocks a sliding-window decode reads begin: the first position of the block holding the
    row's first key (kv_len - window). kv_len a device tensor or a host int (sym_max: no guard on it)."""
    if isinstance(kv_len, torch.Tensor):
        first_key = (kv_len - window).clamp_min(0)
    else:
        first_key = torch.sym_max(kv_len - window, 0)
    return first_key // block_size * block_size


class ModelAttention(nn.Module):
    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__()
        self.layer_idx = layer_idx
        self.comm_manager = comm_manager
        self.attn_tp_size = infer_config.parallel_config.attn_tp_size
        self.enable_npugraph_ex = infer_config.model_config.exe_mode == "npugraph_ex"
        self.enable_gegraph = infer_config.model_config.exe_mode == "ge_graph"
        self.block_size = infer_config.scheduler_config.block_size
        if HEAD_DIM_PER_LAYER:
            # its own width, and so its own cache entries' (the heterogeneous config refuses a global read of it)
            self.head_dim = config.per_layer_config[layer_idx].head_dim
        else:
            self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = getattr(config, HEADS_PER_LAYER)[layer_idx] if HEADS_PER_LAYER else config.num_attention_heads
        if KV_HEADS_PER_LAYER:
            # its own, and so its own cache entries' (the heterogeneous config refuses a global read of them)
            self.num_key_value_heads = config.per_layer_config[layer_idx].num_key_value_heads
        else:
            self.num_key_value_heads = key_value_heads(config) if MULTI_QUERY else (
                getattr(config, "num_key_value_heads", None) or self.num_heads)
        if KV_HEADS_BY_LAYER_TYPE:
            # the rule of the architecture's code (MiMoV2FlashAttention.__init__: a sliding layer's key/value heads
            # are twice num_key_value_heads), no config key: read from the layer's kind at run time
            self.num_key_value_heads *= dict(KV_HEADS_BY_LAYER_TYPE).get(config.layer_types[layer_idx], 1)
        self.num_heads_per_rank = self.num_heads // self.attn_tp_size
        if V_HEAD_DIM:
            self.v_head_dim = config.v_head_dim
        if VALUE_SCALE:
            # MiMoV2FlashAttention: values times the key, 1 where it is None
            scale = getattr(config, VALUE_SCALE, None)
            self.value_scale = 1.0 if scale is None else scale
        self.num_key_value_heads_per_rank = max(self.num_key_value_heads // self.attn_tp_size, 1)
        if WINDOWS:
            self.sliding_window = layer_windows(config)[layer_idx]
            self.attn_type = SLIDING if self.sliding_window else FULL
        else:
            self.attn_type = FULL
        if ROPE_BY_LAYER_TYPE:
            self.layer_type = config.layer_types[layer_idx]
        if ROPE_BY_LAYER_THETA:
            self.rope_table = layer_rope_table(config, ROPE_BY_LAYER_THETA, layer_idx)
        if QUERY_PRE_ATTN_SCALAR:
            self.scaling = config.query_pre_attn_scalar ** -0.5
        elif ATTENTION_MULTIPLIER:
            self.scaling = config.attention_multiplier
        elif UNSCALED:
            self.scaling = 1.0
        else:
            self.scaling = self.head_dim ** -0.5
        if KEY_SCALE:
            # FalconH1Attention scales its keys: q . k, and so the softmax scale, times the key
            self.scaling = self.scaling * getattr(config, KEY_SCALE)
        tp_rank = comm_manager.get_rank("attn_tp_group") if self.attn_tp_size > 1 else 0
        quant_config = getattr(config, "quant_config", None)
        setattr(self, QKV, QKVParallelLinear(
            hidden_size=config.hidden_size, head_size=self.head_dim, total_num_heads=self.num_heads if not OUTPUT_GATE
            else 2 * self.num_heads,
            total_num_kv_heads=self.num_key_value_heads, bias=QKV_BIAS, tp_size=self.attn_tp_size,
            tp_rank=tp_rank, quant_config=quant_config, prefix=f"{prefix}.{QKV}", return_bias=False))
        self.o_proj = RowParallelLinear(
            self.num_heads * (self.v_head_dim if V_HEAD_DIM else self.head_dim), config.hidden_size, bias=O_BIAS, tp_size=self.attn_tp_size,
            tp_rank=tp_rank, input_is_parallel=True, quant_config=quant_config, prefix=f"{prefix}.o_proj")
        if GATE_PROJ:
            # split by heads like the queries: each rank gates its own heads' output
            self.output_gate = ColumnParallelLinear(
                config.hidden_size, self.num_heads * (1 if GATE_PER_HEAD else self.head_dim), bias=False,
                tp_size=self.attn_tp_size, tp_rank=tp_rank, quant_config=quant_config, prefix=f"{prefix}.{GATE_PROJ}",
                return_bias=False)
            if GATE_BIAS:
                # this rank's heads' biases (the checkpoint's gate_bias holds every head's)
                self.output_gate_bias = nn.Parameter(torch.empty(self.num_heads_per_rank), requires_grad=False)
                self.output_gate_bias.weight_loader = self._load_gate_bias
                self.tp_rank = tp_rank
        if ATTN_SUB_NORM:
            self.attn_sub_norm = ModelSubRMSNorm(self.num_heads * self.head_dim, config.rms_norm_eps, comm_manager,
                                                 self.attn_tp_size)
        if SINKS:
            # one learnable sink logit per head of this rank (fused attention's learnable_sink)
            self.sinks = nn.Parameter(torch.empty(self.num_heads_per_rank), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
            self.tp_rank = tp_rank
        if SINK_LAYER_TYPES and config.layer_types[layer_idx] not in SINK_LAYER_TYPES:
            # MiMoV2FlashAttention: sinks on its sliding layers alone (learnable_sink None: a plain softmax)
            self.sinks = None
        if QK_NORM:
            setattr(self, Q_NORM, Norm(self.head_dim, eps=getattr(config, NORM_EPS)))
            setattr(self, K_NORM, Norm(self.head_dim, eps=getattr(config, NORM_EPS)))
        if V_NORM:
            self.v_norm_eps = config.rms_norm_eps
        if QK_NORM_FULL:
            if self.num_key_value_heads < self.attn_tp_size:
                raise ValueError(f"a k norm over all {self.num_key_value_heads} key heads with attn_tp_size "
                                 f"{self.attn_tp_size} (key heads replicated): set attn_tp_size to at most "
                                 f"{self.num_key_value_heads}")
            self.q_norm = ModelFullWidthRMSNorm(self.num_heads, self.head_dim, config.rms_norm_eps, comm_manager,
                                                self.attn_tp_size)
            self.k_norm = ModelFullWidthRMSNorm(self.num_key_value_heads, self.head_dim, config.rms_norm_eps,
                                                comm_manager, self.attn_tp_size)
        if ROPE_INTERLEAVED:
            self._load_rotary_rows_reordered(config)
        if QKV_GROUPS:
            self._load_qkv_grouped()
        if V_HEAD_DIM:
            self._load_values_padded()
        if K_EQ_V and getattr(config, K_EQ_V[0], False) and config.layer_types[layer_idx] in K_EQ_V[1]:
            # Gemma4TextAttention: no v_proj on these layers; the values are k_proj's output (then the value norm)
            self._load_keys_as_values()
        if QUERY_POSITION_SCALE:
            # read at run time: a checkpoint without the beta scales nothing
            rope = getattr(config, "rope_parameters", None) or {}
            self.query_scale_beta = rope.get("llama_4_scaling_beta")
            self.query_scale_original = rope.get("original_max_position_embeddings")
        if NOPE_LAYERS:
            self.use_rope = layer_uses_rope(config, layer_idx)
        if QUERY_TEMPERATURE:
            # read at run time: the NoPE layers of a config with attn_temperature_tuning
            self.query_temperature = bool(config.attn_temperature_tuning) and not self.use_rope
            self.floor_scale, self.attn_scale = config.floor_scale, config.attn_scale
        if CHUNKED:
            self.attention_chunk = (config.attention_chunk_size if config.layer_types[layer_idx] == "chunked_attention"
                                    else None)
            if self.attention_chunk and self.attention_chunk % self.block_size:
                raise ValueError(f"attention_chunk_size {self.attention_chunk} is not a multiple of the block size "
                                 f"{self.block_size}: a chunk must start on a block (set block_size to a divisor)")
        if QK_L2_NORM:
            self.qk_l2_norm = bool(config.use_qk_norm) and (not NOPE_LAYERS or self.use_rope)
            if self.qk_l2_norm:
                self.qk_norm = ModelWeightlessRMSNorm(self.head_dim, eps=getattr(config, NORM_EPS))
        self.k_cache = torch.Tensor([])
        self.v_cache = torch.Tensor([])
        cache_dtype = torch.get_default_dtype()
        self.cache_entries = [
            CacheEntry(cache_name=name, attn_type=self.attn_type, dim=self.head_dim,
                       num_head=self.num_key_value_heads_per_rank, dtype=cache_dtype, block_size=self.block_size,
                       needs_block=True, **({"sliding_window": self.sliding_window} if WINDOWS else {}),
                       tensor_setter=lambda tensor, layer=self, name=name: setattr(layer, name, tensor))
            for name in ("k_cache", "v_cache")
        ]
        if V_HEAD_DIM:
            self.cache_entries[1].dim = self.v_head_dim         # the value cache holds v_head_dim per head

    def forward(self, hidden_states, cos_sin, forward_metadata: ForwardMetaData):
        is_prefill = forward_metadata.is_prefill
        padded_q_len = hidden_states.size(0)
        q_len = padded_q_len
        if is_prefill and 0 < forward_metadata.prompt_tokens < padded_q_len and not (
                CONTEXT_PARALLEL and prefill_cp(forward_metadata)):
            hidden_states = hidden_states[:forward_metadata.prompt_tokens]
            q_len = forward_metadata.prompt_tokens
        qkv = getattr(self, QKV)(hidden_states)
        if OUTPUT_GATE:
            # each head's query and its output gate side by side: the gates split off, the queries kept in front
            width = 2 * self.num_heads_per_rank * self.head_dim
            query_gate = qkv[:, :width].view(q_len, self.num_heads_per_rank, 2 * self.head_dim)
            gate = query_gate[..., self.head_dim:].reshape(q_len, -1)
            qkv = torch.cat([query_gate[..., :self.head_dim].reshape(q_len, -1), qkv[:, width:]], dim=-1)
        query, key, value = qkv.split((self.num_heads_per_rank * self.head_dim,
                                       self.num_key_value_heads_per_rank * self.head_dim,
                                       self.num_key_value_heads_per_rank * self.head_dim), dim=-1)
        if QK_NORM_FULL:
            query, key = self.q_norm(query), self.k_norm(key)
        query = query.reshape(q_len, self.num_heads_per_rank, self.head_dim)
        key = key.reshape(q_len, self.num_key_value_heads_per_rank, self.head_dim)
        value = value.reshape(q_len, self.num_key_value_heads_per_rank, self.head_dim)
        if V_HEAD_DIM:
            # each value head's rows past v_head_dim are the load's zero padding
            value = value[..., :self.v_head_dim]
        if VALUE_SCALE:
            value = value * self.value_scale
        if QK_NORM and not QK_NORM_AFTER_ROPE:
            query, key = getattr(self, Q_NORM)(query), getattr(self, K_NORM)(key)
        if V_NORM:
            # plain torch: npu_rms_norm takes a weight (a ones weight would round in the run dtype first)
            value = value.float()
            value = (value * torch.rsqrt(value.pow(2).mean(-1, keepdim=True) + self.v_norm_eps)).to(key.dtype)
        if QUERY_POSITION_SCALE or QUERY_TEMPERATURE:
            cos_sin, positions = cos_sin[:2], cos_sin[2]
        if QUERY_SSMAX:
            positions = cos_sin["positions"]          # beside the per-type tables (the model's)
        if ROTARY and NOPE_LAYERS != "typed_rope" or ROTARY and self.use_rope:
            cos, sin = (cos_sin[self.layer_type] if ROPE_BY_LAYER_TYPE
                        else cos_sin[self.rope_table] if ROPE_BY_LAYER_THETA else cos_sin)
            cos, sin = cos[:q_len], sin[:q_len]
            if not NOPE_LAYERS or NOPE_LAYERS == "typed_rope" or self.use_rope:
                query, key = torch_npu.npu_apply_rotary_pos_emb(query.contiguous(), key.contiguous(), cos, sin, layout="TND")
        if QK_L2_NORM and self.qk_l2_norm:
            query, key = self.qk_norm(query), self.qk_norm(key)
        if QUERY_POSITION_SCALE and self.query_scale_beta is not None:
            # float32 (not the default dtype), as transformers computes it, then the queries' dtype
            scale = 1 + self.query_scale_beta * torch.log(
                1 + torch.floor(positions[:q_len].float() / self.query_scale_original))
            query = query * scale.to(query.dtype)[:, None, None]
        if QUERY_TEMPERATURE and self.query_temperature:
            # float32 times the queries, then their dtype, as transformers
            scale = temperature_scale(positions[:q_len], self.floor_scale, self.attn_scale)
            query = (query * scale[:, None, None]).to(query.dtype)
        if QUERY_SSMAX and not self.use_rope:
            # float32 times the normed queries, then their dtype, as transformers
            query = (query.float() * ssmax_scale(positions[:q_len])[:, None, None]).to(query.dtype)
        if QK_NORM and QK_NORM_AFTER_ROPE:
            query, key = getattr(self, Q_NORM)(query), getattr(self, K_NORM)(key)
        if not self.k_cache.numel() or not self.v_cache.numel():
            raise RuntimeError("KV cache not allocated: the executor binds it through get_cache_info()")
        if CONTEXT_PARALLEL and prefill_cp(forward_metadata):
            out = self._attention_cp(query, key, value, forward_metadata)
        else:
            slots = forward_metadata.slot_mapping[self.attn_type].view(-1)[:q_len].view(-1, 1)
            torch_npu.npu_scatter_nd_update_(self.k_cache.view(-1, self.num_key_value_heads_per_rank, self.head_dim), slots, key)
            torch_npu.npu_scatter_nd_update_(self.v_cache.view(-1, self.num_key_value_heads_per_rank, value.size(-1)
                                                               if V_HEAD_DIM else self.head_dim), slots, value)
            out = self._attention(query, key, value, forward_metadata)
        if OUTPUT_GATE:
            out = out.reshape(q_len, -1) * torch.sigmoid(gate)
        if GATE_PROJ:
            gate = self.output_gate(hidden_states)
            if GATE_BIAS:
                gate = (gate.view(q_len, self.num_heads_per_rank, -1) + self.output_gate_bias[:, None]).view(q_len, -1)
            gate = torch.nn.functional.softplus(gate.float()).to(out.dtype) if GATE_SOFTPLUS else torch.sigmoid(gate)
            out = out.reshape(q_len, self.num_heads_per_rank, -1) * gate.view(q_len, self.num_heads_per_rank, -1)
        if ATTN_SUB_NORM:
            out = self.attn_sub_norm(out.reshape(q_len, -1))
        out = self.o_proj(out.reshape(q_len, self.num_heads_per_rank * (self.v_head_dim if V_HEAD_DIM else self.head_dim)))
        if q_len < padded_q_len:
            out = torch.cat([out, out.new_zeros((padded_q_len - q_len, out.size(-1)))], dim=0)
        if self.attn_tp_size > 1:
            dist.all_reduce(out, group=self.comm_manager.get_group("attn_tp_group"))
        return out

    def _attention(self, query, key, value, forward_metadata):
        """npu_fused_infer_attention_score_v2 in TND: the prompt's own keys at prefill, the paged cache
        through block_table at decode; [tokens, heads, head_dim]."""
        is_prefill = forward_metadata.is_prefill
        block_table = forward_metadata.block_table[self.attn_type]
        if CHUNKED and is_prefill and self.attention_chunk:
            # the prompt's own keys, each prompt cut at its chunk boundaries: every piece causal on its own
            pieces = chunk_bounds(forward_metadata.actual_seq_lengths_cu_q, self.attention_chunk)
            out, _ = torch.ops.npu.npu_fused_infer_attention_score_v2(
                query, key, value, num_query_heads=self.num_heads_per_rank,
                num_key_value_heads=self.num_key_value_heads_per_rank, input_layout="TND",
                softmax_scale=self.scaling, sparse_mode=3, atten_mask=forward_metadata.attention_mask,
                actual_seq_qlen=pieces, actual_seq_kvlen=pieces)
            return out
        if WINDOWS and is_prefill and self.sliding_window:
            # the prompt's own keys: a sliding-window table holds only the window's blocks (the
            # earlier ones are the null block); band from the bottom right, transformers' window
            # (key j > query i - window) is pre_tokens = window - 1
            out, _ = torch.ops.npu.npu_fused_infer_attention_score_v2(
                query, key, value, num_query_heads=self.num_heads_per_rank,
                num_key_value_heads=self.num_key_value_heads_per_rank, input_layout="TND",
                softmax_scale=self.scaling, sparse_mode=4, pre_tokens=2147483647 if WINDOW_DECODE_ONLY
                else self.sliding_window - 1, next_tokens=0,
                atten_mask=forward_metadata.attention_mask, actual_seq_qlen=forward_metadata.actual_seq_lengths_cu_q,
                actual_seq_kvlen=forward_metadata.actual_seq_lengths_cu_q,
                **({"learnable_sink": self.sinks} if SINKS else {}))
            return out
        if not is_prefill and self.enable_npugraph_ex:
            actual_seq_kvlen = forward_metadata.actual_seq_lengths_list_kv
            actual_seq_qlen = forward_metadata.actual_seq_lengths_cu_list_q
        else:
            actual_seq_kvlen = forward_metadata.actual_seq_lengths_kv
            actual_seq_qlen = forward_metadata.actual_seq_lengths_cu_q
        # prefill: causal from the bottom right (sparse_mode 3, the 2048 x 2048 mask); decode: one query per
        # sequence, no mask
        mask, sparse_mode = (forward_metadata.attention_mask, 3) if is_prefill else (None, 0)
        if CHUNKED and not is_prefill and self.attention_chunk:
            # the blocks of the query's own chunk alone (it starts on a block): no mask
            block_table, actual_seq_kvlen = self._decode_chunk(block_table, actual_seq_kvlen, forward_metadata)
        if MTP and not is_prefill and query.size(0) > forward_metadata.actual_seq_lengths_cu_q.shape[0]:
            # an MTP step verifies next_n + 1 tokens per sequence: causal among them, from the bottom right
            mask, sparse_mode = forward_metadata.attention_mask, 3
        if WINDOWS:
            band = {}
            if not is_prefill and self.sliding_window:
                # a sliding window reads its own blocks alone, under the prefill's band (a one-token TND
                # query keeps sparse_mode 4, as upstream's gpt_oss decodes)
                block_table, actual_seq_kvlen = self._decode_window(block_table, actual_seq_kvlen, forward_metadata)
                mask, sparse_mode = forward_metadata.attention_mask, 4
                band = {"pre_tokens": self.sliding_window - 1, "next_tokens": 0}
        # a GE graph (static, the lengths device tensors) decodes through torchair's op, as upstream's models/qwen:
        # torch_npu's takes the lengths as host ints (SymInt[]), which a static graph cannot read off a tensor
        fa_ops = torchair.ops if self.enable_gegraph and not is_prefill else torch.ops.npu
        k_cache, v_cache = self.k_cache, self.v_cache
        out, _ = fa_ops.npu_fused_infer_attention_score_v2(
            query, k_cache.view(*k_cache.shape[:2], -1), v_cache.view(*v_cache.shape[:2], -1),
            num_query_heads=self.num_heads_per_rank, num_key_value_heads=self.num_key_value_heads_per_rank,
            softmax_scale=self.scaling, input_layout="TND", sparse_mode=sparse_mode, atten_mask=mask,
            actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, block_table=block_table,
            block_size=self.block_size, **({"learnable_sink": self.sinks} if SINKS else {}),
            **(band if WINDOWS else {}))
        return out

    def _attention_cp(self, query, key, value, forward_metadata):
        """A prefill split over the CP ranks (context_parallel.py): this rank's two segments per request attend
        over the keys and values gathered from every rank; the cache takes the rows of the requests this rank
        decodes."""
        cp = forward_metadata.cp_metadata
        group = self.comm_manager.get_group("cp_group")
        keys, values = gather_cp(key, cp, group), gather_cp(value, cp, group)
        kept = cp.persistent_valid_indices.to(keys.device)
        if kept.numel():
            slots = cp.persistent_slot_mapping[self.attn_type].view(-1, 1)
            shape = (-1, self.num_key_value_heads_per_rank, self.head_dim)
            torch_npu.npu_scatter_nd_update_(self.k_cache.view(shape), slots, keys.index_select(0, kept))
            torch_npu.npu_scatter_nd_update_(self.v_cache.view(shape), slots, values.index_select(0, kept))
        # causal from the bottom right (a sliding window: the band, pre_tokens = window - 1)
        mask, band = forward_metadata.attention_mask, {"sparse_mode": 3}
        if not WINDOW_DECODE_ONLY and WINDOWS and self.sliding_window:
            band = {"sparse_mode": 4, "pre_tokens": self.sliding_window - 1, "next_tokens": 0}
        outs = []
        halves = ((query[:cp.local_prev_token_num], cp.actual_seq_q_prev, cp.kv_len_prev),
                  (query[cp.local_prev_token_num:], cp.actual_seq_q_next, cp.kv_len_next))
        for queries, seq_qlen, kv_lens in halves:
            rows, seq_kvlen = cp_key_rows(cp, kv_lens)
            out, _ = torch.ops.npu.npu_fused_infer_attention_score_v2(
                queries.contiguous(), keys.index_select(0, rows), values.index_select(0, rows),
                num_query_heads=self.num_heads_per_rank, num_key_value_heads=self.num_key_value_heads_per_rank,
                input_layout="TND", softmax_scale=self.scaling, atten_mask=mask, actual_seq_qlen=seq_qlen,
                actual_seq_kvlen=seq_kvlen, **band, **({"learnable_sink": self.sinks} if SINKS else {}))
            outs.append(out)
        return torch.cat(outs)

    def _load_rotary_rows_reordered(self, config):
        """The checkpoint's q and k rows (weights, biases, a W8A8 weight's per-row scales; q_proj / k_proj or the
        q and k sections of a fused qkv_proj) and per-head q/k norm weights loaded with each head's rotary dims
        reordered from interleaved pairs to rotate-half (half_from_interleaved)."""
        rotary_dim = rotary_width(config, self.head_dim)
        rows = {"q": self.num_heads * self.head_dim, "k": self.num_key_value_heads * self.head_dim}

        def reordered(loader, norm=False):
            def load(param, weight, *args, **kwargs):
                shard = args[0] if args else kwargs.get("loaded_shard_id")
                if norm:
                    weight = half_from_interleaved(weight, self.head_dim, rotary_dim)
                elif shard in rows and weight.dim() and weight.shape[0] == rows[shard]:
                    weight = half_from_interleaved(weight, self.head_dim, rotary_dim)
                elif shard is None and weight.dim() and weight.shape[0] == rows["q"] + 2 * rows["k"]:
                    q, k, v = weight.split((rows["q"], rows["k"], rows["k"]))
                    weight = torch.cat((half_from_interleaved(q, self.head_dim, rotary_dim),
                                        half_from_interleaved(k, self.head_dim, rotary_dim), v))
                elif weight.numel() > 1 and (shard in rows or shard is None):
                    raise ValueError(f"{tuple(weight.shape)} q/k tensor of a layer with interleaved rotary: its rows "
                                     "are not the heads' dims (block-quantized?), so they cannot be reordered")
                return loader(param, weight, *args, **kwargs)
            return load

        for param in getattr(self, QKV).parameters():
            param.weight_loader = reordered(getattr(param, "weight_loader", copy_weight))
        if QK_NORM or QK_NORM_FULL:
            for param in (getattr(self, Q_NORM).weight, getattr(self, K_NORM).weight):
                param.weight_loader = reordered(getattr(param, "weight_loader", copy_weight), norm=True)

    def _load_qkv_grouped(self):
        """The checkpoint's fused q/k/v rows (weight, bias, a W8A8 weight's per-row scales), stored in groups
        (`count`: "kv_heads", one per key/value head, gpt_neox; or a number, codegen's 4 shards), each group its
        share of the queries, keys and values in `order`; loaded as [q; k; v] (the rotary's reordering, if any,
        after)."""
        count, order = QKV_GROUPS
        groups = self.num_key_value_heads if count == "kv_heads" else count
        sizes = {"q": self.num_heads * self.head_dim // groups, "k": self.num_key_value_heads * self.head_dim // groups}
        sizes["v"] = sizes["k"]
        total = groups * sum(sizes.values())

        def regrouped(loader):
            def load(param, weight, *args, **kwargs):
                if not weight.dim() or weight.shape[0] != total:
                    raise ValueError(f"{tuple(weight.shape)} fused q/k/v tensor: not {total} rows of the heads' dims "
                                     "(block-quantized?), so its grouped layout cannot be reordered")
                rows = weight.reshape(groups, -1, *weight.shape[1:])
                sections = dict(zip(order, rows.split([sizes[name] for name in order], dim=1)))
                weight = torch.cat([sections[name].reshape(-1, *weight.shape[1:]) for name in "qkv"])
                return loader(param, weight, *args, **kwargs)
            return load

        for param in getattr(self, QKV).parameters():
            param.weight_loader = regrouped(getattr(param, "weight_loader", copy_weight))

    def _load_values_padded(self):
        """The checkpoint's v_proj rows (weight, bias) of v_head_dim per head loaded zero-padded to head_dim per
        head: the fused projection's heads are one width (module.linear's QKVParallelLinear); the padding's
        outputs are sliced off before the cache."""
        rows = self.num_key_value_heads * self.v_head_dim

        def padded(loader):
            def load(param, weight, *args, **kwargs):
                shard = args[0] if args else kwargs.get("loaded_shard_id")
                if shard == "v":
                    if not weight.dim() or weight.shape[0] != rows:
                        raise ValueError(f"{tuple(weight.shape)} v_proj tensor: not {rows} rows of {self.v_head_dim} "
                                         "per head (block-quantized?), so its heads cannot be padded")
                    heads = weight.reshape(self.num_key_value_heads, self.v_head_dim, *weight.shape[1:])
                    pad = heads.new_zeros(self.num_key_value_heads, self.head_dim - self.v_head_dim, *weight.shape[1:])
                    weight = torch.cat((heads, pad), dim=1).reshape(-1, *weight.shape[1:])
                return loader(param, weight, *args, **kwargs)
            return load

        for param in getattr(self, QKV).parameters():
            param.weight_loader = padded(getattr(param, "weight_loader", copy_weight))

    def _load_keys_as_values(self):
        """The checkpoint's k_proj rows (weight, bias) loaded into the fused projection's value rows too: the layer
        has no v_proj, its values are the keys' projection before the key's norm and rotary (upstream's models/gemma_4
        clones them from its k_proj's output; here the one q/k/v matmul computes them)."""

        def twice(loader):
            def load(param, weight, *args, **kwargs):
                shard = args[0] if args else kwargs.get("loaded_shard_id")
                if shard == "k":
                    loader(param, weight, "v")
                return loader(param, weight, *args, **kwargs)
            return load

        for param in getattr(self, QKV).parameters():
            param.weight_loader = twice(getattr(param, "weight_loader", copy_weight))

    def _load_sinks(self, param, weight):
        """The checkpoint's sinks of every head: this rank's heads."""
        start = self.tp_rank * self.num_heads_per_rank
        param.data.copy_(weight[start:start + self.num_heads_per_rank])

    def _load_gate_bias(self, param, weight):
        """The checkpoint's gate biases of every head: this rank's heads."""
        start = self.tp_rank * self.num_heads_per_rank
        param.data.copy_(weight[start:start + self.num_heads_per_rank])

    def _decode_window(self, block_table, actual_seq_kvlen, forward_metadata):
        """The window's blocks of each row (_window_blocks) and the row lengths counted from the first of
        them (host ints stay host ints): the band from the bottom right (pre_tokens = window - 1) then
        keeps keys p - window + 1 .. p of a query at position p."""
        kv_lens = forward_metadata.actual_seq_lengths_kv.view(-1, 1).long()
        table, start = self._window_blocks(block_table, kv_lens)
        if isinstance(actual_seq_kvlen, torch.Tensor):
            return table, actual_seq_kvlen - start.view(-1).to(actual_seq_kvlen.dtype)
        return table, [n - window_start(n, self.sliding_window, self.block_size) for n in actual_seq_kvlen]

    def _decode_chunk(self, block_table, actual_seq_kvlen, forward_metadata):
        """Per row, the blocks of its last position's chunk (first position floor((kv_len - 1) / chunk) x chunk, on a
        block), a fixed count (chunk / block_size: one shape for a compiled decode), and the row lengths counted from
        there (host ints stay host ints)."""
        kv_lens = forward_metadata.actual_seq_lengths_kv.view(-1, 1).long()
        start = (kv_lens - 1) // self.attention_chunk * self.attention_chunk
        width = block_table.shape[1]
        count = min(self.attention_chunk // self.block_size, width)
        columns = (start // self.block_size + torch.arange(count, device=block_table.device)).clamp_max(width - 1)
        table = block_table.gather(1, columns)
        if isinstance(actual_seq_kvlen, torch.Tensor):
            return table, actual_seq_kvlen - start.view(-1).to(actual_seq_kvlen.dtype)
        return table, [n - (n - 1) // self.attention_chunk * self.attention_chunk for n in actual_seq_kvlen]

    def _window_blocks(self, block_table, kv_lens):
        """A sliding-window decode reads what it attends to, not the whole table: per row, the blocks from
        the one holding its first key on, a fixed count (the window's keys start anywhere in a block:
        window + block_size - 1 positions; one shape for a compiled decode), chosen on the device from
        kv_lens [rows, 1]. Returns (those blocks [rows, n], their first position [rows, 1])."""
        width = block_table.shape[1]
        count = min(-(-(self.sliding_window + self.block_size - 1) // self.block_size), width)
        start = window_start(kv_lens, self.sliding_window, self.block_size)
        columns = (start // self.block_size + torch.arange(count, device=block_table.device)).clamp_max(width - 1)
        return block_table.gather(1, columns), start
