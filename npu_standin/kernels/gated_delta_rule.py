"""The gated delta rule of linear attention (Qwen3-Next / Qwen3.5's Gated DeltaNet): the chunked prefill op
(npu_chunk_gated_delta_rule) and the token-by-token decode op (npu_recurrent_gated_delta_rule).

Sources (Ascend/op-plugin@517f2e7d):

* docs/zh/custom_APIs/torch_npu/torch_npu-npu_chunk_gated_delta_rule.md and
  torch_npu-npu_recurrent_gated_delta_rule.md: at each step t, with alpha_t = exp(g_t) (g None: all 0),
  S_t = alpha_t S_{t-1} + beta_t (v_t - alpha_t S_{t-1} k_t) k_t^T and o_t = S_t (q_t * scale), where the state
  S is (D_v, D_k) — the transpose of transformers' (k_head_dim, v_head_dim) state. TND layout: query / key
  (T, N_k, D_k), value (T, N_v, D_v), beta and g (T, N_v), T = the sum of actual_seq_lengths (per-sequence
  lengths, the sequences laid end to end); N_v a multiple of N_k, value head h reading key head
  h // (N_v / N_k) (the op-plugin tests' goldens). The ops do not normalise q or k: the caller does (the
  pages' examples, upstream's models/qwen3_5). Output o is bfloat16 whatever the inputs
  (op_plugin/ops/opapi/{Chunk,Recurrent}GatedDeltaRuleKernelNpuOpApi.cpp allocate it so).
* chunk: initial_state (B, N_v, D_v, D_k); final_state has its dtype. beta, initial_state, actual_seq_lengths
  and scale are required (ChunkGatedDeltaRuleKernelNpuOpApi.cpp: "cannot be empty"; the page: "当前TND场景，
  beta、initial_state、actual_seq_lengths必传", though it calls scale None 1.0). Limits: 0 < N_v, N_k <= 64,
  0 < D_v, D_k <= 128. The reference computes the chunked form (chunks of 64 as the op's golden in
  test/test_custom_ops/test_npu_chunk_gated_delta_rule.py: the UT transform of the delta rule within a chunk,
  arXiv 2412.06464) in float32, each sequence from its own initial state.
* recurrent: state (BlockNum, N_v, D_v, D_k) is read and written in place: sequence i starts from
  state[ssm_state_indices[start_i]] (or, with num_accepted_tokens, state[ssm_state_indices[start_i +
  num_accepted_tokens[i] - 1]]) and the state after each of its tokens t is written to
  state[ssm_state_indices[t]] (test/test_custom_ops/test_npu_recurrent_gated_delta_rule.py's golden, the state
  carried in float32 within a sequence). beta None is all 1 (the golden); scale is required
  (RecurrentGatedDeltaRuleKernelNpuOpApi.cpp). Limits: 1 <= L_i <= 8, N_k, N_v <= 256, D_k, D_v <= 512,
  BlockNum >= T. The page gives no default for actual_seq_lengths or ssm_state_indices, and gk's formula
  (a per-key-channel decay) is written two ways: each is refused with one line.

Both forms agree with each other and with transformers' torch_chunk_gated_delta_rule /
torch_recurrent_gated_delta_rule (models/qwen3_next) and flash-linear-attention's semantics they follow
(tests/unit/npu_standin/kernels/test_gated_delta_rule.py).
"""

from __future__ import annotations

import torch

from npu_standin.kernels import refuse, reference

TEST = "tests/unit/npu_standin/kernels/test_gated_delta_rule.py"
CHUNK = 64


# ---- the two forms, in float32, heads first ----------------------------------------------------------
def chunked(q, k, v, beta, g, scale: float, state, chunk: int = CHUNK):
    """One sequence, chunk by chunk. q, k (H, L, D_k); v (H, L, D_v); beta, g (H, L); state (H, D_v, D_k), all
    float32 with q / k already one per value head. Returns o (H, L, D_v) and the state after the last token.

    Within a chunk starting from state S, with G the cumulative sum of g from the chunk's start and the
    per-token updates d_i = beta_i (v_i - exp(G_i) S k_i - sum_{j<i} exp(G_i - G_j) (k_i.k_j) d_j):
    (I + A) D = beta V - (beta exp(G) K) S^T, A_ij = beta_i exp(G_i - G_j) k_i.k_j for j < i, solved as a
    unit lower-triangular system; o_i = scale (exp(G_i) S q_i + sum_{j<=i} exp(G_i - G_j) (q_i.k_j) d_j) and
    the chunk's last state is exp(G_last) S + sum_j exp(G_last - G_j) d_j k_j^T."""
    heads, length, _ = k.shape
    pad = (-length) % chunk
    if pad:   # padded tokens have k = v = beta = 0 and g = 0: they write nothing and decay nothing
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, g = (torch.nn.functional.pad(x, (0, pad)) for x in (beta, g))
    n = (length + pad) // chunk
    q, k, v = (x.reshape(heads, n, chunk, x.shape[-1]) for x in (q * scale, k, v))
    beta, g = beta.reshape(heads, n, chunk), g.reshape(heads, n, chunk)
    cum = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()   # 0 above the diagonal
    system = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    system = system + torch.eye(chunk, dtype=k.dtype, device=k.device)
    written = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    read = torch.linalg.solve_triangular(system, (beta * cum.exp())[..., None] * k, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    out = v.new_empty(heads, n, chunk, v.shape[-1])
    for c in range(n):
        updates = written[:, c] - read[:, c] @ state.transpose(-1, -2)                  # D: (H, C, D_v)
        out[:, c] = (q[:, c] * cum[:, c, :, None].exp()) @ state.transpose(-1, -2) + scores[:, c] @ updates
        to_end = (cum[:, c, -1:] - cum[:, c]).exp()                                      # (H, C)
        state = state * cum[:, c, -1, None, None].exp() + updates.transpose(-1, -2) @ (k[:, c] * to_end[..., None])
    return out.reshape(heads, n * chunk, -1)[:, :length], state


def recurrent_step(state, q, k, v, beta, g, scale: float):
    """One token of N sequences: state (N, H, D_v, D_k); q, k (N, H, D_k); v (N, H, D_v); beta, g (N, H), all
    float32. Returns the state after the token and o (N, H, D_v)."""
    state = state * g.exp()[..., None, None]
    predicted = (state @ k[..., None]).squeeze(-1)
    state = state + (beta[..., None] * (v - predicted))[..., :, None] * k[..., None, :]
    return state, (state @ (q * scale)[..., None]).squeeze(-1)


# ---- checks ---------------------------------------------------------------------------------------
def _check(op: str, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"npu stand-in: {op}: {what}")


def _lengths(op: str, actual_seq_lengths: torch.Tensor, tokens: int) -> list[int]:
    lengths = [int(n) for n in actual_seq_lengths.reshape(-1).tolist()]
    _check(op, all(n >= 0 for n in lengths) and sum(lengths) == tokens,
           f"actual_seq_lengths {lengths} (per-sequence lengths) must sum to T = {tokens}, the tokens of query")
    return lengths


def _heads(op: str, query, key, value, max_heads: int, max_dim: int) -> int:
    _check(op, query.dim() == key.dim() == value.dim() == 3 and query.shape == key.shape
           and value.shape[0] == query.shape[0],
           f"query / key (T, N_k, D_k) and value (T, N_v, D_v) expected, got {tuple(query.shape)}, "
           f"{tuple(key.shape)}, {tuple(value.shape)}")
    (_, nk, dk), (_, nv, dv) = key.shape, value.shape
    _check(op, 0 < nk <= max_heads and 0 < nv <= max_heads and nv % nk == 0,
           f"N_k={nk}, N_v={nv}: 0 < N_k, N_v <= {max_heads} and N_v % N_k == 0 (the op's constraints)")
    _check(op, 0 < dk <= max_dim and 0 < dv <= max_dim, f"D_k={dk}, D_v={dv}: each in (0, {max_dim}] (the op's constraints)")
    return nv // nk


def _per_value_head(x: torch.Tensor, group: int) -> torch.Tensor:
    """(T, N_k, D) -> (T, N_v, D) float32: value head h reads key head h // group."""
    return x.float().repeat_interleave(group, dim=1) if group > 1 else x.float()


# ---- npu_chunk_gated_delta_rule -------------------------------------------------------------------
def _chunk_fake(query, key, value, *, beta=None, initial_state=None, actual_seq_lengths=None, scale=None, g=None):
    return value.new_empty(value.shape, dtype=torch.bfloat16), torch.empty_like(initial_state)


@reference("npu_chunk_gated_delta_rule(Tensor query, Tensor key, Tensor value, *, Tensor? beta=None, "
           "Tensor? initial_state=None, Tensor? actual_seq_lengths=None, float? scale=None, Tensor? g=None) "
           "-> (Tensor, Tensor)",
           formulation="per sequence of actual_seq_lengths (TND): S_t = e^g_t S + beta_t (v_t - e^g_t S k_t) k_t^T, "
                       "o_t = S_t q_t scale (S (D_v, D_k), value head h reads key head h // (N_v/N_k)), computed in "
                       "64-token chunks (UT transform) in fp32; o bf16, final_state in initial_state's dtype",
           test=f"{TEST}::test_chunked_and_recurrent_forms_agree_with_transformers",
           fake=_chunk_fake)
def npu_chunk_gated_delta_rule(query, key, value, *, beta=None, initial_state=None, actual_seq_lengths=None,
                               scale=None, g=None):
    op = "npu_chunk_gated_delta_rule"
    for name, given in (("beta", beta), ("initial_state", initial_state),
                        ("actual_seq_lengths", actual_seq_lengths), ("scale", scale)):
        _check(op, given is not None, f"{name} cannot be empty (op-plugin's ChunkGatedDeltaRule requires it)")
    group = _heads(op, query, key, value, max_heads=64, max_dim=128)
    tokens, nv, dv = value.shape
    dk = key.shape[-1]
    lengths = _lengths(op, actual_seq_lengths, tokens)
    _check(op, tuple(initial_state.shape) == (len(lengths), nv, dv, dk),
           f"initial_state {tuple(initial_state.shape)} must be (B, N_v, D_v, D_k) = {(len(lengths), nv, dv, dk)}")
    _check(op, tuple(beta.shape) == (tokens, nv) and (g is None or tuple(g.shape) == (tokens, nv)),
           f"beta and g must be (T, N_v) = {(tokens, nv)}")
    q, k = (_per_value_head(x, group).transpose(0, 1) for x in (query, key))       # (N_v, T, D_k)
    v, b = value.float().transpose(0, 1), beta.float().transpose(0, 1)
    decay = g.float().transpose(0, 1) if g is not None else torch.zeros_like(b)
    out = value.new_empty((nv, tokens, dv), dtype=torch.float32)
    final = torch.empty(initial_state.shape, dtype=initial_state.dtype, device=initial_state.device)
    start = 0
    for seq, length in enumerate(lengths):
        end = start + length
        o, state = chunked(q[:, start:end], k[:, start:end], v[:, start:end], b[:, start:end], decay[:, start:end],
                           float(scale), initial_state[seq].float())
        out[:, start:end] = o
        final[seq] = state.to(final.dtype)
        start = end
    # fresh contiguous outputs, as op-plugin allocates them (upstream .view()s o)
    return out.transpose(0, 1).to(torch.bfloat16, memory_format=torch.contiguous_format), final


# ---- npu_recurrent_gated_delta_rule ---------------------------------------------------------------
def _recurrent_fake(query, key, value, state, *, beta=None, scale=None, actual_seq_lengths=None,
                    ssm_state_indices=None, num_accepted_tokens=None, g=None, gk=None):
    return value.new_empty(value.shape, dtype=torch.bfloat16)


@reference("npu_recurrent_gated_delta_rule(Tensor query, Tensor key, Tensor value, Tensor(a!) state, *, "
           "Tensor? beta=None, float? scale=None, Tensor? actual_seq_lengths=None, Tensor? ssm_state_indices=None, "
           "Tensor? num_accepted_tokens=None, Tensor? g=None, Tensor? gk=None) -> Tensor",
           formulation="token by token, the same rule: sequence i starts from state[ssm_state_indices[first token "
                       "(+ num_accepted_tokens[i] - 1)]], the state after each token t is written to "
                       "state[ssm_state_indices[t]] (in place); fp32 within a sequence, o bf16; gk refused",
           test=f"{TEST}::test_recurrent_reads_and_writes_the_states_its_indices_name",
           fake=_recurrent_fake)
def npu_recurrent_gated_delta_rule(query, key, value, state, *, beta=None, scale=None, actual_seq_lengths=None,
                                   ssm_state_indices=None, num_accepted_tokens=None, g=None, gk=None):
    op = "npu_recurrent_gated_delta_rule"
    _check(op, scale is not None, "scale cannot be empty (op-plugin's RecurrentGatedDeltaRule requires it)")
    if gk is not None:
        refuse(op, "gk (a per-key-channel decay, whose formula the op-plugin page writes two ways)")
    if actual_seq_lengths is None or ssm_state_indices is None:
        refuse(op, "actual_seq_lengths or ssm_state_indices None (the op-plugin page gives no default)")
    group = _heads(op, query, key, value, max_heads=256, max_dim=512)
    tokens, nv, dv = value.shape
    dk = key.shape[-1]
    lengths = _lengths(op, actual_seq_lengths, tokens)
    _check(op, all(1 <= n <= 8 for n in lengths), f"actual_seq_lengths {lengths}: each in [1, 8] (the op's constraint)")
    _check(op, state.dim() == 4 and tuple(state.shape[1:]) == (nv, dv, dk) and state.shape[0] >= tokens,
           f"state {tuple(state.shape)} must be (BlockNum >= T = {tokens}, N_v, D_v, D_k) = (*, {nv}, {dv}, {dk})")
    slots = ssm_state_indices.reshape(-1).long()
    _check(op, slots.numel() == tokens and bool(((slots >= 0) & (slots < state.shape[0])).all()),
           f"ssm_state_indices must be (T,) = ({tokens},) with each in [0, BlockNum = {state.shape[0]})")
    _check(op, beta is None or tuple(beta.shape) == (tokens, nv), f"beta must be (T, N_v) = {(tokens, nv)}")
    _check(op, g is None or tuple(g.shape) == (tokens, nv), f"g must be (T, N_v) = {(tokens, nv)}")
    lengths_t = torch.tensor(lengths, device=value.device)
    starts = lengths_t.cumsum(0) - lengths_t
    first = starts.clone()
    if num_accepted_tokens is not None:
        accepted = num_accepted_tokens.reshape(-1).to(device=value.device, dtype=torch.long)
        _check(op, accepted.numel() == len(lengths) and bool(((accepted >= 1) & (accepted <= lengths_t)).all()),
               f"num_accepted_tokens {accepted.tolist()}: one per sequence, each in [1, L_i] (L = {lengths})")
        first = starts + accepted - 1
    q, k = _per_value_head(query, group), _per_value_head(key, group)
    v = value.float()
    b = beta.float() if beta is not None else torch.ones(tokens, nv, device=value.device)
    decay = g.float() if g is not None else torch.zeros(tokens, nv, device=value.device)
    current = state[slots[first]].float()                                  # (B, N_v, D_v, D_k)
    out = torch.empty(tokens, nv, dv, dtype=torch.float32, device=value.device)
    for position in range(max(lengths, default=0)):
        active = lengths_t > position
        token = starts[active] + position
        new, o = recurrent_step(current[active], q[token], k[token], v[token], b[token], decay[token], float(scale))
        current[active] = new
        out[token] = o
        state[slots[token]] = new.to(state.dtype)
    return out.to(torch.bfloat16)
