"""Multi-head latent attention (DeepSeek-V2/V3's kv_lora_rank) as upstream's models/deepseek_r1 runs it."""

import math

import torch
import torch.distributed as dist
import torch_npu
import torchair
from torch import nn

from executor.core.kv_cache.cache_info import CacheEntry
from executor.utils.forward_metadata import ForwardMetaData
from module.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

from .attention_fused import FULL, GATE_PER_HEAD, GATE_PROJ, GATE_SOFTPLUS
from .norm_rms import ModelRMSNorm
from .rotary import rope_parameters

Q_LORA = True           # q through q_a_proj -> q_a_layernorm -> q_b_proj (else one q_proj)
ROPE_HALF = False       # the architecture rotates the rope dims rotate-half (else the kernels' interleave-half)
YARN_MSCALE = True      # the softmax scale times yarn's mscale(factor, mscale_all_dim) ** 2 when the rope is scaled
Q_A_BIAS = False        # q_a_proj's bias
KV_A_BIAS = False       # kv_a_proj_with_mqa's bias (added before the fused norm / rope / cache kernel)
MLA_O_BIAS = False      # o_proj's bias
Q_NORM_EPS = 1e-6       # q_a_layernorm's and kv_a_layernorm's epsilons as the architecture builds them
KV_NORM_EPS = 1e-6
MTP = False             # decode steps of next_n + 1 tokens per sequence (an MTP draft verified)
PROLOG = True           # npu_mla_prolog_v3 can compute the decode step's projections (q LoRA, no biases)
ROPE_PLAIN = False      # qk_rope_head_dim is not the fused rope kernels' 64: rope and cache write in plain torch
MLA_NOPE = False        # no rotary in the model (kimi_linear): the rope dims pass unrotated, the cache write plain torch
MLA_PER_LAYER = False   # each layer's MLA widths from config.per_layer_config[layer_idx] (dots3_note's sliding layers)
# npu_transpose_batchmatmul's batch x M bound, upstream deepseek_r1's condition (65535: max of uint16)
TBMM_LIMIT = 65535


def mla_softmax_scale(config):
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2 when the rope is scaled."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    if YARN_MSCALE:
        params = rope_parameters(config)
        factor, mscale_all_dim = float(params.get("factor", 1.0)), params.get("mscale_all_dim", 0)
        if params.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale = scale * mscale * mscale
    return scale


def interleave_half_rope(x, cos, sin):
    """x [T, N, rope] with its pairs de-interleaved, then rotate-half (npu_interleave_rope's formula), in fp32."""
    x1, x2 = x.float()[..., ::2], x.float()[..., 1::2]
    return (torch.cat((x1, x2), dim=-1) * cos.float() + torch.cat((-x2, x1), dim=-1) * sin.float()).to(x.dtype)


class ModelMlaAttention(nn.Module):
    """Multi-head latent attention as upstream's models/deepseek_r1 runs it. The cache holds, per token, the
    RMS-normed latent (kv_lora_rank wide, `nope_cache`) and the rotated shared rope key (`rope_cache`), one head
    each, in FRACTAL_NZ (npu_kv_rmsnorm_rope_cache_v2's PA_NZ). Prefill: keys and values of the prompt expanded
    by kv_b_proj, npu_fused_infer_attention_score in NTD_TND. Decode: MLA absorb (kv_b_proj's W_uk folded into
    the query, W_uv applied to the latent output, npu_transpose_batchmatmul), the attention over the latent cache
    itself, npu_fused_infer_attention_score_v2 in TND_NTD through block_table, mask None."""

    def __init__(self, config, infer_config, comm_manager, layer_idx, prefix=""):
        super().__init__()
        if MLA_PER_LAYER:
            # this layer's widths and heads (and so its own latent / rope cache entries' widths)
            config = config.per_layer_config[layer_idx]
        self.layer_idx = layer_idx
        self.comm_manager = comm_manager
        self.attn_tp_size = infer_config.parallel_config.attn_tp_size
        model_config = infer_config.model_config
        self.enable_npugraph_ex = model_config.exe_mode == "npugraph_ex"
        self.enable_gegraph = model_config.exe_mode == "ge_graph"
        self.block_size = infer_config.scheduler_config.block_size
        self.attn_type = FULL
        self.num_heads = config.num_attention_heads
        self.num_heads_per_rank = self.num_heads // self.attn_tp_size
        self.num_key_value_heads_per_rank = 1      # one latent key / value head, shared by every query head
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.q_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.softmax_scale = mla_softmax_scale(config)
        tp_rank = comm_manager.get_rank("attn_tp_group") if self.attn_tp_size > 1 else 0
        quant_config = getattr(config, "quant_config", None)
        if Q_LORA:
            self.q_a_proj = ReplicatedLinear(config.hidden_size, config.q_lora_rank, bias=Q_A_BIAS,
                                             quant_config=quant_config, prefix=f"{prefix}.q_a_proj")
            self.q_a_layernorm = ModelRMSNorm(config.q_lora_rank, eps=Q_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, self.num_heads * self.q_head_dim, bias=False,
                                                 tp_size=self.attn_tp_size, tp_rank=tp_rank, quant_config=quant_config,
                                                 prefix=f"{prefix}.q_b_proj")
        else:
            self.q_proj = ColumnParallelLinear(config.hidden_size, self.num_heads * self.q_head_dim, bias=False,
                                               tp_size=self.attn_tp_size, tp_rank=tp_rank, quant_config=quant_config,
                                               prefix=f"{prefix}.q_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(config.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim,
                                                   bias=KV_A_BIAS, quant_config=quant_config,
                                                   prefix=f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = ModelRMSNorm(self.kv_lora_rank, eps=KV_NORM_EPS)
        # loaded by heads per rank, then split into the absorb weights (split_kv_b_weight) and dropped
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
                                              bias=False, tp_size=self.attn_tp_size, tp_rank=tp_rank,
                                              quant_config=quant_config, prefix=f"{prefix}.kv_b_proj")
        self.o_proj = RowParallelLinear(self.num_heads * self.v_head_dim, config.hidden_size, bias=MLA_O_BIAS,
                                        tp_size=self.attn_tp_size, tp_rank=tp_rank, input_is_parallel=True,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        if GATE_PROJ:
            # an output gate of its own (bailing_hybrid's g_proj), split by heads like the queries; the checkpoint's
            # name kept (the Kimi Delta Attention layers beside it hold a g_proj of their own under self_attn)
            setattr(self, GATE_PROJ, ColumnParallelLinear(
                config.hidden_size, self.num_heads * (1 if GATE_PER_HEAD else self.v_head_dim), bias=False,
                tp_size=self.attn_tp_size, tp_rank=tp_rank, quant_config=quant_config, prefix=f"{prefix}.{GATE_PROJ}"))
        if self.kv_b_proj.weight.dtype == torch.int8:
            # the absorb weights multiply in float (npu_transpose_batchmatmul); upstream's converters keep it so
            raise ValueError(f"{prefix}.kv_b_proj is int8 in this checkpoint: MLA's absorb weights are float; "
                             "quantize it with kv_b_proj in the quantization_config's ignore list, as upstream's "
                             "deepseek converter does")
        if PROLOG:
            # custom_params.enable_mla_prolog (with NZ weights, upstream's condition): the decode step's
            # projections, norms, rope and cache writes in one npu_mla_prolog_v3
            custom_params = getattr(model_config, "custom_params", None) or {}
            self.enable_mla_prolog = bool(custom_params.get("enable_mla_prolog", False)
                                          and getattr(model_config, "enable_weight_nz", False))
            if self.enable_mla_prolog and self.kv_a_proj_with_mqa.weight.dtype == torch.int8:
                raise ValueError("custom_params.enable_mla_prolog with W8A8 weights: npu_mla_prolog_v3's quantized "
                                 "form (dequant scales, weight_quant_mode) is not written for this model; set "
                                 "enable_mla_prolog to False")
        self.nope_cache = torch.Tensor([])
        self.rope_cache = torch.Tensor([])
        cache_dtype = torch.get_default_dtype()
        if ROPE_PLAIN or MLA_NOPE:
            # the decode attention reads both caches as FRACTAL_NZ, whose inner block is 32 bytes wide
            c0 = 32 // torch.empty((), dtype=cache_dtype).element_size()
            if self.kv_lora_rank % c0 or self.qk_rope_head_dim % c0:
                raise ValueError(f"kv_lora_rank {self.kv_lora_rank} / qk_rope_head_dim {self.qk_rope_head_dim}: the "
                                 f"FRACTAL_NZ latent caches take widths in multiples of {c0} in {cache_dtype}")
        self.cache_entries = [
            CacheEntry(cache_name=name, attn_type=self.attn_type, dim=dim, num_head=1, dtype=cache_dtype,
                       block_size=self.block_size, needs_block=True,
                       tensor_setter=lambda tensor, layer=self, name=name: setattr(layer, name, tensor))
            for name, dim in (("nope_cache", self.kv_lora_rank), ("rope_cache", self.qk_rope_head_dim))
        ]

    def split_kv_b_weight(self):
        """kv_b_proj [heads * (nope + v), kv_lora_rank] (this rank's heads) into W_uk [heads, nope, kv_lora_rank]
        and W_uv [heads, kv_lora_rank, v], before module.linear transposes the linears."""
        weight = self.kv_b_proj.weight.data.view(self.num_heads_per_rank, self.qk_nope_head_dim + self.v_head_dim,
                                                 self.kv_lora_rank)
        self.kv_b_proj_w_k = nn.Parameter(weight[:, :self.qk_nope_head_dim].contiguous(), requires_grad=False)
        self.kv_b_proj_w_v = nn.Parameter(weight[:, self.qk_nope_head_dim:].transpose(1, 2).contiguous(),
                                          requires_grad=False)
        del self.kv_b_proj
        if ROPE_HALF:
            # the architecture rotates the rope dims rotate-half: their rows of the query projection and of
            # kv_a_proj_with_mqa interleaved once, so the kernels' interleave-half rope computes it exactly
            half = self.qk_rope_head_dim // 2

            def interleaved(rows):          # [..., rope, *] -> pairs (i, half + i): x'[2i] = x[i], x'[2i + 1] = x[half + i]
                return torch.stack((rows[:, :half], rows[:, half:]), dim=2).reshape(rows.shape)

            with torch.no_grad():
                q_proj = self.q_b_proj if Q_LORA else self.q_proj
                # a W8A8 weight's per-row scales move with its rows
                for param in (q_proj.weight, getattr(q_proj, "weight_scale", None)):
                    if param is not None:
                        q_heads = param.data.view(self.num_heads_per_rank, self.q_head_dim, -1)
                        q_heads[:, self.qk_nope_head_dim:] = interleaved(q_heads[:, self.qk_nope_head_dim:].clone())
                for param in (self.kv_a_proj_with_mqa.weight, self.kv_a_proj_with_mqa.bias,
                              getattr(self.kv_a_proj_with_mqa, "weight_scale", None)):
                    if param is not None:
                        rope = param.data[self.kv_lora_rank:]
                        rope.copy_(interleaved(rope.clone().view(1, self.qk_rope_head_dim, -1)).view(rope.shape))

    def forward(self, hidden_states, cos_sin, forward_metadata: ForwardMetaData):
        is_prefill = forward_metadata.is_prefill
        padded_q_len = hidden_states.size(0)
        q_len = padded_q_len
        if is_prefill and 0 < forward_metadata.prompt_tokens < padded_q_len:
            hidden_states = hidden_states[:forward_metadata.prompt_tokens]
            q_len = forward_metadata.prompt_tokens
        if not self.nope_cache.numel() or not self.rope_cache.numel():
            raise RuntimeError("MLA cache not allocated: the executor binds it through get_cache_info()")
        if MLA_NOPE:
            cos = sin = None                                  # the model builds no rotary: cos_sin is None
        else:
            cos, sin = cos_sin
            cos, sin = cos[:q_len], sin[:q_len]                  # [T, 1, rope]
        slots = forward_metadata.slot_mapping[self.attn_type].view(-1)[:q_len]
        if PROLOG and not is_prefill and self.enable_mla_prolog:
            out = self._decode_attention(*self._prolog(hidden_states, cos, sin, slots), forward_metadata)
        else:
            out = self._attention(hidden_states, cos, sin, slots, is_prefill, forward_metadata)
        if GATE_PROJ:
            # this rank's heads' output times act(gate(x)), per head or per channel: plain torch (elementwise)
            gate = getattr(self, GATE_PROJ)(hidden_states)
            gate = torch.nn.functional.softplus(gate.float()).to(out.dtype) if GATE_SOFTPLUS else torch.sigmoid(gate)
            out = out.reshape(q_len, self.num_heads_per_rank, -1) * gate.view(q_len, self.num_heads_per_rank, -1)
        out = self.o_proj(out.reshape(q_len, self.num_heads_per_rank * self.v_head_dim))
        if q_len < padded_q_len:
            out = torch.cat([out, out.new_zeros((padded_q_len - q_len, out.size(-1)))], dim=0)
        if self.attn_tp_size > 1:
            dist.all_reduce(out, group=self.comm_manager.get_group("attn_tp_group"))
        return out

    def _attention(self, hidden_states, cos, sin, slots, is_prefill, forward_metadata):
        q_len = hidden_states.size(0)
        if Q_LORA:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        else:
            q = self.q_proj(hidden_states)
        q_nope, q_pe = q.view(q_len, self.num_heads_per_rank, self.q_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        if MLA_NOPE:
            # no rotary: the rope dims of the query and the shared key as they are; the latent's RMSNorm and the
            # PA_NZ cache writes in plain torch (npu_kv_rmsnorm_rope_cache_v2 always rotates)
            q_rope = q_pe
            latent = self.kv_a_proj_with_mqa(hidden_states)
            c_kv = self.kv_a_layernorm(latent[:, :self.kv_lora_rank].contiguous())
            k_rope = latent[:, None, self.kv_lora_rank:].contiguous()
            self._write_nz(self.nope_cache, c_kv, slots)
            self._write_nz(self.rope_cache, k_rope.view(q_len, -1), slots)
        elif ROPE_PLAIN:
            # npu_interleave_rope and npu_kv_rmsnorm_rope_cache take a rope width of 64 only (torch_npu's API
            # reference): the same interleave-half rope, RMSNorm and PA_NZ cache write in plain torch
            q_rope = interleave_half_rope(q_pe, cos, sin)                    # [T, N, rope]
            latent = self.kv_a_proj_with_mqa(hidden_states)
            c_kv = self.kv_a_layernorm(latent[:, :self.kv_lora_rank].contiguous())
            k_rope = interleave_half_rope(latent[:, None, self.kv_lora_rank:], cos, sin)
            self._write_nz(self.nope_cache, c_kv, slots)
            self._write_nz(self.rope_cache, k_rope.view(q_len, -1), slots)
        else:
            # rope on the query's rope dims: (1, N, T, rope) as npu_interleave_rope takes it
            q_rope = torch_npu.npu_interleave_rope(q_pe.transpose(0, 1).unsqueeze(0), cos.view(1, 1, q_len, -1),
                                                   sin.view(1, 1, q_len, -1))
            q_rope = q_rope.squeeze(0).transpose(0, 1)                          # [T, N, rope]
            # the latent and the shared rope key: RMSNorm, rope, written to the caches at slot_mapping
            latent = self.kv_a_proj_with_mqa(hidden_states).view(q_len, 1, 1, self.kv_lora_rank + self.qk_rope_head_dim)
            k_rope, c_kv = torch_npu.npu_kv_rmsnorm_rope_cache_v2(
                latent, self.kv_a_layernorm.weight, cos.view(q_len, 1, 1, -1), sin.view(q_len, 1, 1, -1), slots,
                self.rope_cache, self.nope_cache, epsilon=self.kv_a_layernorm.variance_epsilon, cache_mode="PA_NZ",
                is_output_kv=is_prefill)
        if is_prefill:
            return self._prefill_attention(q_nope, q_rope, c_kv, k_rope, forward_metadata)
        return self._decode_attention(self._absorb_query(q_nope), q_rope, forward_metadata)

    def _write_nz(self, cache, rows, slots):
        """rows [T, D] into the paged FRACTAL_NZ cache at slots, as the decode attention reads it (blocks, D / c0,
        block_size, c0): each row's c0-wide pieces, block_size * c0 apart, through npu_scatter_nd_update_."""
        c0 = 32 // cache.element_size()
        pieces = rows.size(-1) // c0
        first = (slots // self.block_size) * (pieces * self.block_size) + slots % self.block_size
        index = first[:, None] + torch.arange(pieces, device=slots.device) * self.block_size
        torch_npu.npu_scatter_nd_update_(cache.view(-1, c0), index.view(-1, 1), rows.reshape(-1, c0).to(cache.dtype))

    def _absorb_query(self, q_nope):
        """q_nope [T, N, nope] times W_uk: the query in the latent space, [T, N, kv_lora_rank]."""
        if self.num_heads_per_rank * self.qk_nope_head_dim <= TBMM_LIMIT:
            return torch_npu.npu_transpose_batchmatmul(q_nope, self.kv_b_proj_w_k, bias=None, scale=None,
                                                       perm_x1=(1, 0, 2), perm_x2=(0, 1, 2), perm_y=(1, 0, 2))
        # plain torch beyond the op's bound, as upstream's deepseek_r1
        return torch.matmul(q_nope.transpose(0, 1), self.kv_b_proj_w_k).transpose(0, 1)

    def _prefill_attention(self, q_nope, q_rope, c_kv, k_rope, forward_metadata):
        """The prompt's own keys and values, expanded per head by kv_b_proj (compute-bound: not absorbed),
        causal from the bottom right (sparse_mode 3); [T, N, v]."""
        q_len = q_nope.size(0)
        latent = c_kv.view(1, q_len, self.kv_lora_rank)
        k_nope = torch.matmul(latent, self.kv_b_proj_w_k.transpose(1, 2))        # [N, T, nope]
        value = torch.matmul(latent, self.kv_b_proj_w_v)                         # [N, T, v]
        key_rope = k_rope.view(1, q_len, self.qk_rope_head_dim).repeat(self.num_heads_per_rank, 1, 1)
        seq_lengths = forward_metadata.actual_seq_lengths_cu_q
        out, _ = torch.ops.npu.npu_fused_infer_attention_score(
            q_nope.permute(1, 0, 2), k_nope, value, query_rope=q_rope.permute(1, 0, 2), key_rope=key_rope,
            num_heads=self.num_heads_per_rank, num_key_value_heads=self.num_heads_per_rank, input_layout="NTD_TND",
            atten_mask=forward_metadata.attention_mask, sparse_mode=3, actual_seq_lengths=seq_lengths,
            actual_seq_lengths_kv=seq_lengths, scale=self.softmax_scale, next_tokens=0)
        return out

    def _decode_attention(self, q_latent, q_rope, forward_metadata):
        """Absorbed: the latent query against the latent cache (key and value both), the rope parts added
        by query_rope / key_rope; one query per sequence, mask None; W_uv on the output. [T, N, v]."""
        blocks = self.nope_cache.shape[0]
        c0 = 32 // self.nope_cache.element_size()          # FRACTAL_NZ's 32-byte inner block (16 in bf16)
        k_nope = self.nope_cache.view(blocks, 1, self.kv_lora_rank // c0, self.block_size, c0)
        k_rope = self.rope_cache.view(blocks, 1, self.qk_rope_head_dim // c0, self.block_size, c0)
        if self.enable_npugraph_ex:
            actual_seq_kvlen = forward_metadata.actual_seq_lengths_list_kv
            actual_seq_qlen = forward_metadata.actual_seq_lengths_cu_list_q
        else:
            actual_seq_kvlen = forward_metadata.actual_seq_lengths_kv
            actual_seq_qlen = forward_metadata.actual_seq_lengths_cu_q
        if MTP:
            # an MTP step verifies next_n + 1 tokens per sequence: causal among them, from the bottom right
            window = q_latent.size(0) > forward_metadata.actual_seq_lengths_cu_q.shape[0]
        # a GE graph (static, the lengths device tensors) decodes through torchair's op, as upstream's deepseek_r1
        fa_ops = torchair.ops if self.enable_gegraph else torch.ops.npu
        out, _ = fa_ops.npu_fused_infer_attention_score_v2(
            q_latent, k_nope, k_nope, query_rope=q_rope, key_rope=k_rope,
            atten_mask=forward_metadata.attention_mask if MTP and window else None,
            actual_seq_kvlen=actual_seq_kvlen, actual_seq_qlen=actual_seq_qlen,
            block_table=forward_metadata.block_table[self.attn_type], num_query_heads=self.num_heads_per_rank,
            num_key_value_heads=self.num_key_value_heads_per_rank, softmax_scale=self.softmax_scale,
            input_layout="TND_NTD", sparse_mode=3 if MTP and window else 0, block_size=self.block_size)  # [N, T, kv_lora_rank]
        return torch_npu.npu_transpose_batchmatmul(out, self.kv_b_proj_w_v, bias=None, scale=None,
                                                   perm_x1=(0, 1, 2), perm_x2=(0, 1, 2), perm_y=(1, 0, 2))

    def _prolog(self, hidden_states, cos, sin, slots):
        """npu_mla_prolog_v3: q down-projection + RMSNorm + up-projection, W_uk absorb, query rope, and the
        latent / rope key into the caches, for one decode step. Returns (latent query, query rope)."""
        rope = self.qk_rope_head_dim
        q_latent, q_rope, _, _, _ = torch.ops.npu.npu_mla_prolog_v3(
            token_x=hidden_states, weight_dq=self.q_a_proj.weight, weight_uq_qr=self.q_b_proj.weight,
            weight_uk=self.kv_b_proj_w_k, weight_dkv_kr=self.kv_a_proj_with_mqa.weight,
            rmsnorm_gamma_cq=self.q_a_layernorm.weight, rmsnorm_gamma_ckv=self.kv_a_layernorm.weight,
            rope_sin=sin.view(-1, rope), rope_cos=cos.view(-1, rope), cache_index=slots, kv_cache=self.nope_cache,
            kr_cache=self.rope_cache, rmsnorm_epsilon_cq=self.q_a_layernorm.variance_epsilon,
            rmsnorm_epsilon_ckv=self.kv_a_layernorm.variance_epsilon, cache_mode="PA_NZ")
        return q_latent, q_rope
