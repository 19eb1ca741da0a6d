"""DeepSeek Sparse Attention's lightning indexer (deepseek_v32, glm_moe_dsa), read so that the fall-back names it.

Not written natively yet: `indexer_facts` reads an MLA layer's `indexer` child and holds it to one plain-torch
formula, so the fall-back reason says what the layer is and what its native form needs. The formula, per query
token s and cached token t (transformers' DeepseekV32Indexer / GlmMoeDsaIndexer):

    q = wq_b(q_resid)  [H, D], q_resid = q_a_layernorm(q_a_proj(x)) (the MLA's q LoRA latent)
    k = LayerNorm(wk(x))  [D], one head, kept in the indexer's own per-layer key cache
    rope on the first qk_rope_head_dim dims of q and k (rotate-half in deepseek_v32, interleaved in glm_moe_dsa)
    w = weights_proj(x) * H ** -0.5  [H]
    score[s, t] = sum_h w[h] * ReLU(q[h] . k[t] * D ** -0.5), causal; the attention keeps top index_topk t

npu_lightning_indexer computes Top-k{sum_g W_g * ReLU(Q_g . K)} (CANN ops-transformer's LightningIndexer page: head
dim 128, one key head, key in PA_BSND / BSND / TND; MindSpore's lightning_indexer page: 64 query heads): the
D ** -0.5 and H ** -0.5 fold into W, as ReLU is positively homogeneous.
npu_sparse_flash_attention then attends over the selected tokens of a PA_BSND latent cache. The MLA part's
cache is PA_NZ and its prefill expands keys per head (npu_fused_infer_attention_score), so neither kernel has a
place in it: that is the blocker `dsa_reason` names.
"""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative

INDEXER_CHILDREN = {"wq_b", "wk", "k_norm", "weights_proj"}
ROPE_FORMS = ("half", "interleave")
PROBE_TOKENS = 9


def is_dsa_indexer(module) -> bool:
    """`module` has the lightning indexer's projections (wq_b, wk, k_norm, weights_proj)."""
    return INDEXER_CHILDREN <= {name for name, _ in module.named_children()}


def _rope(x, cos, sin, form: str):
    """x [T, N, R] rotated: rotate-half on x as it is, or interleaved pairs (x[2i], x[2i+1])."""
    import torch

    if form == "interleave":
        half = x.shape[-1] // 2
        c, s = cos[:, None, :half], sin[:, None, :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def index_scores(indexer, x, q_resid, cos, sin, form: str, config, relu: bool = True):
    """The indexer's causal scores [T, T] of x [T, hidden] in plain torch (the module docstring's formula)."""
    import torch

    tokens = x.shape[0]
    heads, dim, rope = config.index_n_heads, config.index_head_dim, config.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(tokens, heads, dim)
    k = indexer.k_norm(indexer.wk(x))[:, None]
    q = torch.cat((_rope(q[..., :rope], cos, sin, form), q[..., rope:]), dim=-1)
    k = torch.cat((_rope(k[..., :rope], cos, sin, form), k[..., rope:]), dim=-1)[:, 0]
    scores = torch.einsum("shd,td->sht", q.float(), k.float()) * dim ** -0.5
    if relu:
        scores = scores.relu()
    weights = indexer.weights_proj(x).float() * heads ** -0.5
    total = torch.einsum("sh,sht->st", weights, scores)
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    return total.masked_fill(~causal, float("-inf"))


def _ranks_by(scores, ranking, tolerance: float = 1e-4) -> bool:
    """`ranking` (per query s, tokens 0..s) is an order top-k could return under `scores`: non-increasing,
    ties (ReLU's zeros) in any order."""
    import torch

    for s, tokens in enumerate(ranking):
        row = scores[s, torch.tensor(tokens)]
        if bool((row[1:] - row[:-1] > tolerance * float(row.abs().max().clamp_min(1e-9))).any()):
            return False
    return True


def indexer_facts(attention, model, config, relu: bool = True) -> dict:
    """The lightning indexer of MLA `attention`: its rope form ("half" | "interleave"), heads, head dim and
    top-k. The module's own top-k over every prompt token
    (index_topk >= the probe's tokens: its ranking) must be the formula's ranking for one rope form."""
    import torch

    indexer = attention.indexer
    if not is_dsa_indexer(indexer):
        raise NotNative("attention", f"{type(attention).__name__}'s indexer lacks "
                                     f"{sorted(INDEXER_CHILDREN - {n for n, _ in indexer.named_children()})}")
    if not isinstance(indexer.k_norm, torch.nn.LayerNorm):
        raise NotNative("attention", f"the indexer's k_norm is {type(indexer.k_norm).__name__}, not a LayerNorm")
    missing = [key for key in ("index_n_heads", "index_head_dim", "index_topk")
               if not isinstance(getattr(config, key, None), int)]
    if missing:
        raise NotNative("attention", f"a DSA indexer without {', '.join(missing)} in the config")
    x = torch.randn(PROBE_TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(13))
    positions = torch.arange(PROBE_TOKENS)[None]
    cos, sin = model.model.rotary_emb(x[None], positions)
    cos, sin = cos[0], sin[0]
    mask = torch.full((PROBE_TOKENS, PROBE_TOKENS), float("-inf")).triu(1)[None]
    with torch.no_grad():
        q_resid = attention.q_a_layernorm(attention.q_a_proj(x))
        saved = indexer.index_topk
        indexer.index_topk = PROBE_TOKENS       # the whole ranking, not only its top index_topk
        try:
            got = indexer(x[None], q_resid[None], (cos[None], sin[None]), mask, positions)[0]
        except Exception as exc:  # noqa: BLE001 - another signature: not the indexer we know
            raise NotNative("attention", f"{type(indexer).__name__} cannot be called as DSA's lightning indexer "
                                         f"({type(exc).__name__}: {str(exc)[:120]})") from exc
        finally:
            indexer.index_topk = saved
        got = [got[s, : s + 1].tolist() for s in range(PROBE_TOKENS)]
        for form in ROPE_FORMS:
            if _ranks_by(index_scores(indexer, x, q_resid, cos, sin, form, config, relu), got):
                return {"rope": form, "heads": config.index_n_heads, "head_dim": config.index_head_dim,
                        "topk": config.index_topk}
    raise NotNative("attention", f"{type(indexer).__name__} ranks tokens by none of the lightning indexer's "
                                 f"formulas ({', '.join(ROPE_FORMS)} rope)")


def dsa_reason(index: int, attention, model, config) -> str:
    """The one-line fall-back reason of an MLA layer with a lightning indexer."""
    f = indexer_facts(attention, model, config)
    return (f"layer {index}: {type(attention).__name__} is DeepSeek Sparse Attention (a lightning indexer, "
            f"{f['heads']} heads x {f['head_dim']}, {f['rope']} rope, top {f['topk']} cached tokens per "
            "query, its own key cache): not written natively (npu_lightning_indexer + npu_sparse_flash_attention "
            "over a PA_BSND latent cache; the MLA part's cache is PA_NZ)")
