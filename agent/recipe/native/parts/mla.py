"""Multi-head latent attention (DeepSeek-V2/V3's `kv_lora_rank`; code/attention_mla.py), as upstream's
models/deepseek_r1 runs it, read from the architecture's attention modules.

Every decoder layer's attention module is read: its children must be MLA's (q_a_proj / q_a_layernorm / q_b_proj
or one q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; anything more, DSA's `indexer` say, is not
native), its two norms are probed as RMSNorm x*w, and the module itself is called on random hidden states with
the model's own position embeddings and a causal mask; its output must equal one candidate of plain-torch MLA
computed from its weights — q (through the q LoRA and its RMSNorm, or one projection) split per head into nope /
rope, the latent c_kv = RMSNorm(kv_a(x)[:kv_lora_rank]) and the shared rope key, keys / values per head from
kv_b_proj's [nope | v] rows, the softmax scale — for the rope form (interleave-half as npu_interleave_rope /
npu_kv_rmsnorm_rope_cache_v2 compute it, or rotate-half on the rope dims) and the scale rule (qk_head_dim ** -0.5,
times yarn's mscale(factor, mscale_all_dim) ** 2). The rotary table of the candidate is the generated file's
(transformers' ROPE_INIT_FUNCTIONS over qk_rope_head_dim), so a match also holds our rope table to theirs. No
candidate: `NotNative("attention", ...)`. A model without a rotary table (kimi_linear) calls its module without
position embeddings and holds it to the one candidate whose rope dims pass unrotated (MLA_NOPE); an output gate of
the module's own (bailing_hybrid's g_proj) is measured by parts/attention_gate.py and held in the candidate too.
"""

from __future__ import annotations

import math

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.attention_gate import GATE_NAMES, gate_kernel, output_gate
from agent.recipe.native.parts.dsa import dsa_reason, is_dsa_indexer
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children, layer_config, probe_norm, sets_mla_shapes_per_layer

Q_LORA_CHILDREN = {"q_a_proj", "q_a_layernorm", "q_b_proj"}
KV_CHILDREN = {"kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"}
MLA_CONFIG_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
ROPE_FORMS = ("interleave", "half")
# the rope dims unrotated: an MLA whose model builds no rotary (kimi_linear's NoPE MLA), the only form tried there
NOPE_FORM = "none"
SCALE_RULES = ("yarn_mscale", "qk_head_dim")     # the first that matches: equal when the config has no yarn mscale
PROBE_TOKENS = 7
# npu_transpose_batchmatmul's batch x M bound, upstream deepseek_r1's condition (65535: max of uint16)
TBMM_LIMIT = 65535
# the rope width npu_interleave_rope (D 64: torch_npu 7.0.0 API reference, ptaoplist_002369) and
# npu_kv_rmsnorm_rope_cache (rope_size 64 only, rms_size 512: ptaoplist_002368) take; npu_mla_prolog_v3 rotates
# in the same kernels. Another width: the rope and the latent cache write in plain torch.
FUSED_ROPE_DIM = 64


def is_mla(attention_children: set[str]) -> bool:
    """A decoder layer's attention is MLA (its latent down-projection and up-projection)."""
    return {"kv_a_proj_with_mqa", "kv_b_proj"} <= attention_children


def is_mla_model(probe) -> bool:
    """Every layer's attention is MLA (False: none is; a mix is not native)."""
    if "mla" not in probe.memo:
        kinds = {is_mla(set(children(layer.self_attn))) for layer in probe.layers if hasattr(layer, "self_attn")}
        if len(kinds) > 1:
            raise NotNative("attention", "latent (MLA) and other attention layers in one model")
        probe.memo["mla"] = kinds == {True}
    return probe.memo["mla"]


def yarn_mscale(scale: float, mscale: float) -> float:
    """YaRN's attention-temperature factor (DeepSeek-V3's yarn_get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config, rule: str) -> float:
    """The attention's softmax scale of `config` by `rule`; the generated file computes the same."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rule == "yarn_mscale" and params.get("rope_type", params.get("type", "default")) != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            scale *= yarn_mscale(float(params["factor"]), mscale_all_dim) ** 2
    return scale


def rope_table(config, positions):
    """cos / sin [T, qk_rope_head_dim] as the generated file builds them (transformers' rope initialisation)."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    dim = config.qk_rope_head_dim
    if rope_type == "default":
        base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    if inv_freq.numel() * 2 != dim:
        raise NotNative("attention", f"the rope initialisation gives {inv_freq.numel() * 2} dims, not "
                                     f"qk_rope_head_dim {dim} (config.head_dim {getattr(config, 'head_dim', None)})")
    freqs = torch.outer(positions.float(), inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def _rope(x, cos, sin, form: str):
    """x [T, N, D] rotated: interleave-half (the kernels': pairs de-interleaved, then rotate-half) or
    rotate-half on x as it is; x itself for NOPE_FORM."""
    import torch

    if form == NOPE_FORM:
        return x
    if form == "interleave":
        x = torch.cat((x[..., ::2], x[..., 1::2]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def norm_eps(norm) -> float | None:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _rms(x, norm):
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm_eps(norm)) * norm.weight


def candidate(attention, config, x, cos, sin, form: str, scale: float, gate: dict | None = None):
    """Plain-torch MLA of `attention`'s weights on x [T, hidden], causal; with `gate` (parts/attention_gate.py's
    options) each head's output times act(gate(x)) before o_proj."""
    import torch

    heads = config.num_attention_heads
    dn, dr, dv, rank = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.kv_lora_rank
    tokens = x.shape[0]
    if getattr(attention, "q_a_proj", None) is not None:
        q = attention.q_b_proj(_rms(attention.q_a_proj(x), attention.q_a_layernorm))
    else:
        q = attention.q_proj(x)
    q = q.view(tokens, heads, dn + dr)
    kv = attention.kv_a_proj_with_mqa(x)
    latent, k_rope = _rms(kv[:, :rank], attention.kv_a_layernorm), kv[:, None, rank:]
    q_rope, k_rope = _rope(q[..., dn:], cos, sin, form), _rope(k_rope, cos, sin, form)
    kv_heads = attention.kv_b_proj(latent).view(tokens, heads, dn + dv)
    k_nope, value = kv_heads[..., :dn], kv_heads[..., dn:]
    scores = (torch.einsum("qnd,knd->nqk", q[..., :dn], k_nope)
              + torch.einsum("qnd,kd->nqk", q_rope, k_rope[:, 0])) * scale
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("nqk,knd->qnd", probs, value)
    if gate:
        act = torch.nn.functional.softplus if gate["GATE_SOFTPLUS"] else torch.sigmoid
        out = out * act(getattr(attention, gate["GATE_PROJ"])(x)).view(tokens, heads, -1)
    return attention.o_proj(out.reshape(tokens, heads * dv))


def _module_output(attention, model, x):
    """transformers' attention module on x [T, hidden] (batch 1), its own position embeddings, causal."""
    import torch

    tokens = x.shape[0]
    positions = torch.arange(tokens)[None]
    # a model without a rotary table (kimi_linear) hands its attention no position embeddings: called without
    positional = {"position_embeddings": model.model.rotary_emb(x[None], positions)} if has_rotary(model) else {}
    mask = torch.full((tokens, tokens), torch.finfo(torch.float32).min).triu(1)[None, None]
    try:
        out = attention(hidden_states=x[None], attention_mask=mask, position_ids=positions, **positional)
    except Exception as exc:  # noqa: BLE001 - another signature: not the MLA we know
        raise NotNative("attention", f"{type(attention).__name__} cannot be called as MLA "
                                     f"({type(exc).__name__}: {str(exc)[:120]})") from exc
    return (out[0] if isinstance(out, tuple) else out)[0]


def has_rotary(model) -> bool:
    """The base model builds a rotary table (kimi_linear's builds none: its MLA's rope dims pass unrotated)."""
    return getattr(model.model, "rotary_emb", None) is not None


def _probe_formula(attention, model, config, gate: dict | None = None) -> tuple[str, str]:
    """The (rope form, scale rule) whose candidate `attention`'s output equals; a model without a rotary table:
    the rope dims unrotated (NOPE_FORM) and qk_head_dim's scale (the module reads no rope settings)."""
    import torch

    x = torch.randn(PROBE_TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(11))
    if has_rotary(model):
        forms, rules = ROPE_FORMS, SCALE_RULES
        cos, sin = rope_table(config, torch.arange(PROBE_TOKENS))
    else:
        forms, rules, cos, sin = (NOPE_FORM,), ("qk_head_dim",), None, None
    with torch.no_grad():
        got = _module_output(attention, model, x)
        tried = []
        for form in forms:
            for rule in rules:
                want = candidate(attention, config, x, cos, sin, form, softmax_scale(config, rule), gate)
                err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-9))
                if err < 1e-4:
                    return form, rule
                tried.append(f"{form}/{rule}: {err:.1e}")
    raise NotNative("attention", f"{type(attention).__name__} is none of the MLA formulas the kernels compute "
                                 f"({'; '.join(tried)})")


def derive_mla(model_config, layers, model, probe=None) -> dict:
    """The MLA facts of `model_config` (transformers' shrunk config; each layer read through its own view where the
    config sets widths per layer) from the built `model`'s `layers`: q_lora, rope
    ("interleave" | "half" | NOPE_FORM: unrotated), scale ("yarn_mscale" | "qk_head_dim"), q_a_bias, kv_a_bias, o_bias, the norms'
    epsilons, prolog (npu_mla_prolog_v3 can compute the decode step's projections: the q LoRA, no biases), gate
    (an output gate of its own, bailing_hybrid's g_proj: parts/attention_gate.py's options measured on the module
    through `probe`, or None)."""
    import torch

    found = set()
    eps = {}
    rope_widths = set()
    for index, layer in enumerate(layers):
        if not hasattr(layer, "self_attn"):
            continue          # a linear-attention layer (kimi_linear's Kimi Delta Attention)
        # a heterogeneous config's layer reads its own widths (parts/mla_layer_shapes.py)
        config = layer_config(model_config, index)
        missing = [key for key in MLA_CONFIG_KEYS if not isinstance(getattr(config, key, None), int)]
        if missing:
            raise NotNative("attention", f"MLA without {', '.join(missing)} in the config")
        rank, dr = config.kv_lora_rank, config.qk_rope_head_dim
        if dr % 2:
            raise NotNative("attention", f"qk_rope_head_dim {dr} is odd: no rope pairs")
        rope_widths.add(dr)
        attention = layer.self_attn
        children = {name for name, _ in attention.named_children()}
        q_lora = Q_LORA_CHILDREN <= children
        expected = KV_CHILDREN | (Q_LORA_CHILDREN if q_lora else {"q_proj"}) | (children & set(GATE_NAMES))
        if children - expected == {"indexer"} and expected <= children and is_dsa_indexer(attention.indexer):
            raise NotNative("attention", dsa_reason(index, attention, model, config))
        if children != expected:
            raise NotNative("attention", f"layer {index}: {type(attention).__name__} has "
                                         f"{sorted(children - expected) or 'no ' + str(sorted(expected - children))} "
                                         "beyond MLA's projections")
        linears = [getattr(attention, n) for n in expected if n.endswith("_proj") or n == "kv_a_proj_with_mqa"]
        if not all(isinstance(m, torch.nn.Linear) for m in linears):
            raise NotNative("attention", f"layer {index}: MLA projections that are not plain linears")
        for name, width in (("kv_a_layernorm", rank), ("q_a_layernorm", getattr(config, "q_lora_rank", None))):
            norm = getattr(attention, name, None)
            if norm is None:
                continue
            if probe_norm(norm, width) != 0.0:
                raise NotNative("attention", f"{name} scales by 1 + w: the fused MLA kernels' RMSNorm is x * w")
            if norm_eps(norm) is None or eps.setdefault(name, norm_eps(norm)) != norm_eps(norm):
                raise NotNative("attention", f"{name}'s epsilon {norm_eps(norm)}: none, or unequal across layers")
        if getattr(attention, "kv_b_proj").bias is not None:
            raise NotNative("attention", "kv_b_proj has a bias: absorbed into the query and output it has no place")
        gate = _output_gate(attention, probe, config) if children & set(GATE_NAMES) else None
        form, rule = _probe_formula(attention, model, config, gate)
        q_first = attention.q_a_proj if q_lora else attention.q_proj
        found.add((q_lora, form, rule, q_first.bias is not None, attention.kv_a_proj_with_mqa.bias is not None,
                   attention.o_proj.bias is not None, tuple(sorted(gate.items())) if gate else None))
    if len(found) != 1:
        raise NotNative("attention", f"MLA layers of unequal structure: {sorted(found)}")
    q_lora, form, rule, q_bias, kv_bias, o_bias, gate = next(iter(found))
    if q_bias and not q_lora:
        raise NotNative("attention", "q_proj with a bias (MLA without the q LoRA): not written natively")
    nope = form == NOPE_FORM
    # no rope: the latent's norm and cache writes in plain torch (npu_kv_rmsnorm_rope_cache_v2 always rotates)
    rope_plain = rope_widths != {FUSED_ROPE_DIM} and not nope
    return {"q_lora": q_lora, "rope": form, "scale": rule, "q_a_bias": q_bias and q_lora, "kv_a_bias": kv_bias,
            "o_bias": o_bias, "kv_norm_eps": eps["kv_a_layernorm"],
            "q_norm_eps": eps.get("q_a_layernorm", eps["kv_a_layernorm"]), "rope_plain": rope_plain,
            "prolog": q_lora and not (q_bias and q_lora) and not kv_bias and not rope_plain and not nope,
            "gate": dict(gate) if gate else None}


def _output_gate(attention, probe, config) -> dict:
    """The MLA attention's own output gate (parts/attention_gate.py's measure: act(gate(x)) per head or per channel
    of the value heads' width), without a bias."""
    if probe is None:
        raise NotNative("attention", f"{type(attention).__name__}'s output gate is measured through the probe")
    gate = output_gate(attention, probe, config.num_attention_heads, config.v_head_dim)
    if gate.get("GATE_BIAS"):
        raise NotNative("attention", f"{type(attention).__name__}'s output gate with a bias of its own: the MLA file "
                                     "adds none")
    return gate


def mla_kernels(match) -> tuple[tuple[str, ...], tuple[str, ...]]:
    f = match.facts
    rope = "interleave-half RoPE" + (" (the architecture's rotate-half: the rope rows of q and kv_a_proj_with_mqa "
                                     "interleaved once after loading)" if f["rope"] == "half" else "")
    nope = f["rope"] == NOPE_FORM
    if f.get("rope_plain") or nope:
        fused = ["npu_rms_norm (kv_a_layernorm)",
                 "npu_scatter_nd_update_ (the latent and the shared rope key into the FRACTAL_NZ nope / rope caches "
                 "at slot_mapping)"]
    else:
        fused = [f"npu_kv_rmsnorm_rope_cache_v2 (RMSNorm of the compressed kv, {rope} of the shared key, scattered "
                 "into the nope / rope caches in PA_NZ at slot_mapping)",
                 "npu_interleave_rope (the query's rope dims)"]
    fused += ["npu_fused_infer_attention_score (prefill: un-absorbed keys / values of the prompt, NTD_TND, query_rope / "
             "key_rope, sparse_mode 3)",
             "npu_fused_infer_attention_score_v2 (decode: absorbed, TND_NTD over the NZ nope / rope caches through "
             "block_table, one key head, mask None)",
             "npu_transpose_batchmatmul (MLA absorb: kv_b_proj's W_uk into the query, W_uv on the latent output)"]
    if f["q_lora"]:
        fused.append("npu_rms_norm (q_a_layernorm)")
    if f["prolog"]:
        fused.append("npu_mla_prolog_v3 (decode, when the YAML sets custom_params.enable_mla_prolog and weights are NZ, "
                     "as upstream's deepseek_r1)")
    unfused = [f"MLA absorb beyond npu_transpose_batchmatmul's bound (heads x qk_nope_head_dim > {TBMM_LIMIT}): "
               "torch.matmul, as upstream's deepseek_r1"]
    if f.get("rope_plain"):
        unfused.append(f"{rope} of the query and of the shared key: plain torch (npu_interleave_rope and "
                       f"npu_kv_rmsnorm_rope_cache take a rope width of {FUSED_ROPE_DIM} only, the checkpoint's "
                       "qk_rope_head_dim is another)")
        unfused.append("npu_mla_prolog_v3: not used (its rope is the same kernels')")
    if nope:
        unfused.append("no rope: the model builds no rotary, the rope dims of the query and the shared key pass "
                       "unrotated (npu_kv_rmsnorm_rope_cache_v2 and npu_mla_prolog_v3 always rotate: not used)")
    if not f["q_lora"] and not nope:
        unfused.append("npu_mla_prolog_v3: not used (no q LoRA: the op computes the q down-projection and its norm)")
    elif not f["prolog"] and not f.get("rope_plain") and not nope:
        unfused.append("npu_mla_prolog_v3: not used (the op has no bias for q_a_proj / kv_a_proj_with_mqa)")
    if f["o_bias"]:
        unfused.append("o_proj's bias: added after the tensor-parallel reduction")
    if f.get("gate"):
        unfused.append(gate_kernel(f["gate"]))
    return tuple(fused), tuple(unfused)


def _probe(probe, chosen):
    if not is_mla_model(probe) or sets_mla_shapes_per_layer(probe.config):
        return None                 # MLA widths per layer: parts/mla_layer_shapes.py's
    return mla_match(MLA, probe)


def mla_match(part, probe, **options) -> Match:
    """`part`'s match of the probe's MLA layers (the MLA part's options, and `options`)."""
    f = derive_mla(probe.config, probe.layers, probe.model, probe)
    return Match(part, facts=f, options={**options, 
        "MLA": True, "Q_LORA": f["q_lora"], "ROPE_HALF": f["rope"] == "half", "YARN_MSCALE": f["scale"] == "yarn_mscale",
        "Q_A_BIAS": f["q_a_bias"], "KV_A_BIAS": f["kv_a_bias"], "MLA_O_BIAS": f["o_bias"],
        "Q_NORM_EPS": f["q_norm_eps"], "KV_NORM_EPS": f["kv_norm_eps"], "PROLOG": f["prolog"],
        "ROPE_PLAIN": f["rope_plain"], "MLA_NOPE": f["rope"] == NOPE_FORM, **(f["gate"] or {})})


MLA = Part(
    slot="attention", name="mla", code="attention_mla.py", provides="ModelMlaAttention",
    reads=("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_attention_heads",
           "rope_parameters"),
    probe=_probe, kernels=mla_kernels,
    options=("MLA", "Q_LORA", "ROPE_HALF", "YARN_MSCALE", "Q_A_BIAS", "KV_A_BIAS", "MLA_O_BIAS", "Q_NORM_EPS",
             "KV_NORM_EPS", "PROLOG", "ROPE_PLAIN", "MLA_NOPE", "GATE_PROJ", "GATE_SOFTPLUS", "GATE_PER_HEAD"))
