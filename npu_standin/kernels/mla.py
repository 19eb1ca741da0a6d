"""Multi-head latent attention (DeepSeek-V2/V3) fused ops: the KV branch's RMSNorm + RoPE + cache
scatter (npu_kv_rmsnorm_rope_cache_v2) and the whole prolog, query and KV branches
(npu_mla_prolog_v3). Non-quantized paths; each quantized mode is refused with one line.

The RoPE inside both is the documented "interleave-half" one (op-plugin pages, aclnnKvRmsNormRopeCache
and npu_mla_prolog_v3's formulas): x1 = x[..., ::2], x2 = x[..., 1::2], y = cat(x1, x2) * cos +
cat(-x2, x1) * sin, the output in the de-interleaved order (as npu_interleave_rope's).

Caches, as documented for cache_mode:
* Norm:       (B, N, S_cache, D), index (B, S): per-batch offsets;
* PA / PA_BNSD / PA_BSND: (block_num, block_size, N, D), index (T,) or (B, S): global slots;
* PA_NZ:      the same shape, its memory laid out FRACTAL_NZ, (block_num, D // c0, block_size, N, c0)
              with c0 = 16 (bf16 / fp16; 32 for int8) — what the attention ops read back as
              (block_num, N, D // c0, block_size, c0) when N is 1.
A negative index (kv_rmsnorm_rope_cache: "[-1, S_cache)") writes nothing.
"""

from __future__ import annotations

import torch

from npu_standin.kernels import refuse, reference


def interleave_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The documented interleave-half RoPE in float32 (cos / sin broadcast against x)."""
    x32 = x.float()
    x1, x2 = x32[..., ::2], x32[..., 1::2]
    return torch.cat((x1, x2), dim=-1) * cos.float() + torch.cat((-x2, x1), dim=-1) * sin.float()


def _rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps) * gamma.float()


def nz_c0(dtype: torch.dtype) -> int:
    """FRACTAL_NZ's inner block: 32 bytes, 16 two-byte or 32 one-byte elements."""
    return 32 // torch.empty((), dtype=dtype).element_size()


def write_cache(op: str, cache: torch.Tensor, index: torch.Tensor, values: torch.Tensor, cache_mode: str) -> None:
    """Scatter `values` (..., N, D) — one row per entry of `index` — into `cache` in place."""
    if cache_mode in ("PA_BLK_BNSD", "PA_BLK_BSND", "PA_BLK_NZ", "BSND", "TND"):
        refuse(op, f"cache_mode={cache_mode!r}")
    if cache_mode == "Norm":
        batch, heads, _, dim = cache.shape
        rows = values.reshape(batch, -1, heads, dim)             # (B, S, N, D)
        idx = index.reshape(batch, -1).long()
        for b in range(batch):
            keep = idx[b] >= 0
            cache[b][:, idx[b][keep]] = rows[b][keep].transpose(0, 1).to(cache.dtype)
        return
    if cache_mode not in ("PA", "PA_BNSD", "PA_BSND", "PA_NZ"):
        refuse(op, f"cache_mode={cache_mode!r}")
    blocks, block_size, heads, dim = cache.shape
    slots = index.reshape(-1).long()
    rows = values.reshape(slots.numel(), heads, dim).to(cache.dtype)
    keep = slots >= 0
    slots, rows = slots[keep], rows[keep]
    if cache_mode != "PA_NZ":
        cache.view(blocks * block_size, heads, dim)[slots] = rows
        return
    c0 = nz_c0(cache.dtype)
    if dim % c0 or not cache.is_contiguous():
        raise ValueError(f"{op}: cache_mode PA_NZ needs a contiguous cache whose last dim is a multiple of {c0} "
                         f"(got shape {tuple(cache.shape)}, contiguous={cache.is_contiguous()})")
    nz = cache.view(blocks, dim // c0, block_size, heads, c0)
    block, offset = slots // block_size, slots % block_size
    nz[block, :, offset] = rows.reshape(-1, heads, dim // c0, c0).transpose(1, 2)


# ---- npu_kv_rmsnorm_rope_cache_v2 ---------------------------------------------------------------
def _kv_cache_v2_fake(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, k_rope_scale=None, c_kv_scale=None,
                      k_rope_offset=None, c_kv_offset=None, v=None, epsilon=1e-5, cache_mode="Norm",
                      is_output_kv=False, k_cache_dtype=None, ckv_cache_dtype=None):
    shape = list(kv.shape)
    return kv.new_empty(shape[:-1] + [cos.shape[-1]]), kv.new_empty(shape[:-1] + [gamma.shape[0]])


@reference("npu_kv_rmsnorm_rope_cache_v2(Tensor kv, Tensor gamma, Tensor cos, Tensor sin, Tensor index, "
           "Tensor(a!) k_cache, Tensor(b!) ckv_cache, *, Tensor? k_rope_scale=None, Tensor? c_kv_scale=None, "
           "Tensor? k_rope_offset=None, Tensor? c_kv_offset=None, Tensor? v=None, float epsilon=1e-5, "
           "str cache_mode='Norm', bool is_output_kv=False, int? k_cache_dtype=None, "
           "int? ckv_cache_dtype=None) -> (Tensor, Tensor)",
           formulation="kv (..., Dv + Dk) split; y = RMSNorm(kv[..., :Dv]) * gamma, k = interleave-half "
                       "RoPE(kv[..., Dv:]) in fp32; scattered into ckv_cache / k_cache at index (Norm, PA, "
                       "PA_BNSD, PA_NZ layouts) in place; returns (k, y) in kv's dtype",
           test="tests/unit/npu_standin/kernels/test_mla.py"
                "::test_kv_rmsnorm_rope_cache_v2_matches_rmsnorm_rope_and_scatter",
           fake=_kv_cache_v2_fake)
def npu_kv_rmsnorm_rope_cache_v2(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, k_rope_scale=None,
                                 c_kv_scale=None, k_rope_offset=None, c_kv_offset=None, v=None, epsilon=1e-5,
                                 cache_mode="Norm", is_output_kv=False, k_cache_dtype=None, ckv_cache_dtype=None):
    op = "npu_kv_rmsnorm_rope_cache_v2"
    if any(t is not None for t in (k_rope_scale, c_kv_scale, k_rope_offset, c_kv_offset)):
        refuse(op, "k_rope_scale/c_kv_scale/offsets (an int8 cache)")
    if v is not None or k_cache_dtype is not None or ckv_cache_dtype is not None:
        refuse(op, "v / k_cache_dtype / ckv_cache_dtype")
    if kv.dim() != 4:
        raise ValueError(f"{op}: kv must be 4-d (B, N, S, Dv + Dk), got {tuple(kv.shape)}")
    dv, dk = gamma.shape[0], cos.shape[-1]
    if kv.shape[-1] != dv + dk:
        raise ValueError(f"{op}: kv's last dim {kv.shape[-1]} != gamma's {dv} + cos's {dk}")
    y = _rms_norm(kv[..., :dv], gamma, epsilon)
    k = interleave_half_rope(kv[..., dv:], cos, sin)
    # rows in (B, S, N) order, as index enumerates tokens (B*S) and N is the cache's head axis
    write_cache(op, ckv_cache, index, y.transpose(1, 2), cache_mode)
    write_cache(op, k_cache, index, k.transpose(1, 2), cache_mode)
    return k.to(kv.dtype), y.to(kv.dtype)


# ---- npu_mla_prolog_v3 -------------------------------------------------------------------------
MLA_PROLOG_V3_SCHEMA = (
    "npu_mla_prolog_v3(Tensor token_x, Tensor weight_dq, Tensor weight_uq_qr, Tensor weight_uk, "
    "Tensor weight_dkv_kr, Tensor rmsnorm_gamma_cq, Tensor rmsnorm_gamma_ckv, Tensor rope_sin, Tensor rope_cos, "
    "Tensor(a!) kv_cache, Tensor(b!) kr_cache, *, Tensor? cache_index=None, Tensor? dequant_scale_x=None, "
    "Tensor? dequant_scale_w_dq=None, Tensor? dequant_scale_w_uq_qr=None, Tensor? dequant_scale_w_dkv_kr=None, "
    "Tensor? quant_scale_ckv=None, Tensor? quant_scale_ckr=None, Tensor? smooth_scales_cq=None, "
    "Tensor? actual_seq_len=None, Tensor? k_nope_clip_alpha=None, float rmsnorm_epsilon_cq=1e-05, "
    "float rmsnorm_epsilon_ckv=1e-05, str cache_mode=\"PA_BSND\", bool query_norm_flag=False, "
    "int weight_quant_mode=0, int kv_cache_quant_mode=0, int query_quant_mode=0, int ckvkr_repo_mode=0, "
    "int quant_scale_repo_mode=0, int tile_size=128, float qc_qr_scale=1.0, float kc_scale=1.0, "
    "int? token_x_dtype=None, int? weight_dq_dtype=None, int? weight_uq_qr_dtype=None, "
    "int? weight_dkv_kr_dtype=None, int? kv_cache_dtype=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


def _prolog_shapes(token_x, weight_dq, weight_uk, rope_sin):
    lead = list(token_x.shape[:-1])                      # [T] or [B, S]
    heads, _, hckv = weight_uk.shape
    return lead, heads, hckv, rope_sin.shape[-1], weight_dq.shape[1]


def _mla_prolog_v3_fake(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
                        rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache, kr_cache, *, query_norm_flag=False,
                        **kwargs):
    lead, heads, hckv, dr, hcq = _prolog_shapes(token_x, weight_dq, weight_uk, rope_sin)
    bf16 = torch.bfloat16
    norm = token_x.new_empty(lead + [hcq], dtype=weight_uq_qr.dtype) if query_norm_flag else token_x.new_empty(0)
    return (token_x.new_empty(lead + [heads, hckv], dtype=bf16), token_x.new_empty(lead + [heads, dr], dtype=bf16),
            token_x.new_empty(0, dtype=torch.float32), norm, token_x.new_empty(0, dtype=torch.float32))


@reference(MLA_PROLOG_V3_SCHEMA,
           formulation="c_q = RMSNorm(x @ W_dq); q = c_q @ W_uq_qr -> (T, N, D + Dr); q_nope = q[..., :D] @ W_uk[n]; "
                       "q_rope = RoPE(q[..., D:]); kv = x @ W_dkv_kr: RMSNorm(kv[:Hckv]) -> kv_cache, "
                       "RoPE(kv[Hckv:]) -> kr_cache at cache_index (interleave-half RoPE, fp32, bf16 between "
                       "the matmuls); non-quantized modes only",
           test="tests/unit/npu_standin/kernels/test_mla.py"
                "::test_mla_prolog_v3_is_the_composition_of_its_matmuls_norms_and_rope",
           fake=_mla_prolog_v3_fake)
def npu_mla_prolog_v3(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
                      rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache, kr_cache, *, cache_index=None,
                      dequant_scale_x=None, dequant_scale_w_dq=None, dequant_scale_w_uq_qr=None,
                      dequant_scale_w_dkv_kr=None, quant_scale_ckv=None, quant_scale_ckr=None, smooth_scales_cq=None,
                      actual_seq_len=None, k_nope_clip_alpha=None, rmsnorm_epsilon_cq=1e-05, rmsnorm_epsilon_ckv=1e-05,
                      cache_mode="PA_BSND", query_norm_flag=False, weight_quant_mode=0, kv_cache_quant_mode=0,
                      query_quant_mode=0, ckvkr_repo_mode=0, quant_scale_repo_mode=0, tile_size=128,
                      qc_qr_scale=1.0, kc_scale=1.0, token_x_dtype=None, weight_dq_dtype=None,
                      weight_uq_qr_dtype=None, weight_dkv_kr_dtype=None, kv_cache_dtype=None):
    op = "npu_mla_prolog_v3"
    if weight_quant_mode or kv_cache_quant_mode or query_quant_mode:
        refuse(op, f"weight_quant_mode={weight_quant_mode}, kv_cache_quant_mode={kv_cache_quant_mode}, "
                   f"query_quant_mode={query_quant_mode} (a quantized path)")
    quant = {"dequant_scale_x": dequant_scale_x, "dequant_scale_w_dq": dequant_scale_w_dq,
             "dequant_scale_w_uq_qr": dequant_scale_w_uq_qr, "dequant_scale_w_dkv_kr": dequant_scale_w_dkv_kr,
             "quant_scale_ckv": quant_scale_ckv, "quant_scale_ckr": quant_scale_ckr,
             "smooth_scales_cq": smooth_scales_cq, "k_nope_clip_alpha": k_nope_clip_alpha}
    given = [name for name, value in quant.items() if value is not None]
    if given or token_x.dtype in (torch.int8, torch.uint8):
        refuse(op, f"{', '.join(given) or 'int8 token_x'} (a quantized path)")
    if ckvkr_repo_mode or quant_scale_repo_mode:
        refuse(op, f"ckvkr_repo_mode={ckvkr_repo_mode}, quant_scale_repo_mode={quant_scale_repo_mode}")
    if cache_index is None:
        refuse(op, "no cache_index (cache_mode BSND / TND)")
    lead, heads, hckv, dr, hcq = _prolog_shapes(token_x, weight_dq, weight_uk, rope_sin)
    dtype = token_x.dtype
    x = token_x.reshape(-1, token_x.shape[-1]).float()
    cos = rope_cos.reshape(-1, 1, dr)
    sin = rope_sin.reshape(-1, 1, dr)
    # query: down-projection, RMSNorm, up-projection (per head D + Dr), absorbed W_uk on the nope part
    c_q = (_rms_norm(x @ weight_dq.float(), rmsnorm_gamma_cq, rmsnorm_epsilon_cq) * qc_qr_scale).to(dtype)
    q = (c_q.float() @ weight_uq_qr.float()).to(dtype).reshape(x.shape[0], heads, -1)
    d = q.shape[-1] - dr
    q_nope = torch.einsum("tnd,ndc->tnc", q[..., :d].float(), weight_uk.float())
    q_rope = interleave_half_rope(q[..., d:], cos, sin)
    # key: down-projection to the latent (RMSNorm, cached) and the shared rope key (RoPE, cached)
    kv = (x @ weight_dkv_kr.float()).to(dtype)
    c_kv = _rms_norm(kv[:, :hckv], rmsnorm_gamma_ckv, rmsnorm_epsilon_ckv) * kc_scale
    k_rope = interleave_half_rope(kv[:, None, hckv:], cos, sin)
    nkv = kv_cache.shape[-2]
    write_cache(op, kv_cache, cache_index, c_kv[:, None].expand(-1, nkv, -1), cache_mode)
    write_cache(op, kr_cache, cache_index, k_rope.expand(-1, nkv, -1), cache_mode)
    bf16 = torch.bfloat16
    norm = c_q.reshape(lead + [hcq]).to(weight_uq_qr.dtype) if query_norm_flag else token_x.new_empty(0)
    return (q_nope.reshape(lead + [heads, hckv]).to(bf16), q_rope.reshape(lead + [heads, dr]).to(bf16),
            token_x.new_empty(0, dtype=torch.float32), norm, token_x.new_empty(0, dtype=torch.float32))
