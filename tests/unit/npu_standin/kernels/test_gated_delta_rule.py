"""The gated delta rule ops (npu_standin/kernels/gated_delta_rule.py): the chunked and the recurrent forms agree
with each other and with transformers' plain-torch Gated DeltaNet (models/qwen3_next: torch_chunk_gated_delta_rule,
torch_recurrent_gated_delta_rule), in the ops' TND layout with their (D_v, D_k) state; the recurrent op reads and
writes the state slots its indices name as op-plugin's golden does; prefill then decode is the same as one
prefill; what the ops cannot take is one line."""

from __future__ import annotations

import pytest
import torch

from npu_standin import kernels
from npu_standin.kernels.gated_delta_rule import chunked, recurrent_step


@pytest.fixture(scope="module", autouse=True)
def registered():
    kernels.install()


def ops():
    return torch.ops.npu


def inputs(lengths, nk=2, nv=4, dk=16, dv=8, seed=0, dtype=torch.float32):
    """TND inputs as upstream's qwen3_5 passes them: unit-norm q / k, g = -exp(A) softplus(.) <= 0, beta in
    (0, 1), a state per sequence."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    q = torch.nn.functional.normalize(torch.randn(tokens, nk, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(tokens, nk, dk, generator=gen), dim=-1)
    v = torch.randn(tokens, nv, dv, generator=gen)
    g = -torch.rand(tokens, nv, generator=gen) * 0.5
    beta = torch.rand(tokens, nv, generator=gen) * 0.9 + 0.05
    state = torch.randn(len(lengths), nv, dv, dk, generator=gen) * 0.3
    return [t.to(dtype) for t in (q, k, v, beta, g)] + [state.to(dtype)]


def transformers_per_sequence(fn, lengths, q, k, v, beta, g, state):
    """transformers' function on each sequence (batch 1, (B, S, H, D), state (B, H, D_k, D_v)), in TND."""
    outs, finals, start = [], [], 0
    for seq, length in enumerate(lengths):
        part = slice(start, start + length)
        o, final = fn(q[None, part], k[None, part], v[None, part], g[None, part], beta[None, part],
                      initial_state=state[seq:seq + 1].transpose(-1, -2), output_final_state=True)
        outs.append(o[0])
        finals.append(final[0].transpose(-1, -2))
        start += length
    return torch.cat(outs), torch.stack(finals)


def test_chunked_and_recurrent_forms_agree_with_transformers():
    """Sequences of 70 (two chunks, the second part padding), 64 (exactly one) and 5 tokens, grouped value
    heads (4 value heads on 2 key heads, D_v != D_k so a transposed state or a wrong head map cannot agree):
    the chunked form, the token-by-token form and transformers' two agree in fp32."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                    torch_recurrent_gated_delta_rule)

    lengths = [70, 64, 5]
    q, k, v, beta, g, state = inputs(lengths)
    scale = q.shape[-1] ** -0.5                              # transformers' scale
    want_o, want_state = transformers_per_sequence(torch_recurrent_gated_delta_rule, lengths, q, k, v, beta, g, state)
    hf_chunk_o, hf_chunk_state = transformers_per_sequence(torch_chunk_gated_delta_rule, lengths, q, k, v, beta, g,
                                                           state)
    torch.testing.assert_close(hf_chunk_o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hf_chunk_state, want_state, atol=1e-5, rtol=1e-5)

    qh, kh = (x.repeat_interleave(2, dim=1).transpose(0, 1) for x in (q, k))        # (H, T, D)
    vh, bh, gh = v.transpose(0, 1), beta.transpose(0, 1), g.transpose(0, 1)
    start = 0
    for seq, length in enumerate(lengths):
        part = slice(start, start + length)
        o, final = chunked(qh[:, part], kh[:, part], vh[:, part], bh[:, part], gh[:, part], scale, state[seq])
        torch.testing.assert_close(o.transpose(0, 1), want_o[part], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final, want_state[seq], atol=1e-5, rtol=1e-5)
        current = state[seq][None]
        for t in range(start, start + length):
            current, o_t = recurrent_step(current, qh[:, t][None], kh[:, t][None], vh[:, t][None], bh[:, t][None],
                                          gh[:, t][None], scale)
            torch.testing.assert_close(o_t[0], want_o[t], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(current[0], want_state[seq], atol=1e-5, rtol=1e-5)
        start += length

    # the op: TND in bf16 (as upstream calls it), o bf16, final_state in initial_state's dtype
    lowered = [x.bfloat16() for x in (q, k, v, beta)]
    o, final = ops().npu_chunk_gated_delta_rule(*lowered[:3], beta=lowered[3], initial_state=state.bfloat16(),
                                                actual_seq_lengths=torch.tensor(lengths, dtype=torch.int32),
                                                scale=scale, g=g)
    assert o.dtype == final.dtype == torch.bfloat16 and o.shape == v.shape and final.shape == state.shape
    assert o.is_contiguous() and final.is_contiguous()          # fresh outputs (upstream .view()s o)
    ref_o, ref_state = transformers_per_sequence(torch_recurrent_gated_delta_rule, lengths, *(x.float() for x in lowered[:3]),
                                                 lowered[3].float(), g, state.bfloat16().float())
    torch.testing.assert_close(o.float(), ref_o, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(final.float(), ref_state, atol=2e-2, rtol=2e-2)
    _, fp32_state = ops().npu_chunk_gated_delta_rule(q, k, v, beta=beta, initial_state=state,
                                                     actual_seq_lengths=torch.tensor(lengths), scale=scale, g=g)
    assert fp32_state.dtype == torch.float32
    torch.testing.assert_close(fp32_state, want_state, atol=1e-5, rtol=1e-5)


def test_scale_and_no_decay_follow_the_formula():
    """scale multiplies q (o_t = S_t q_t scale) and g None is no decay (alpha = 1): transformers' scale is
    D_k^-0.5, so scale s equals transformers on q * s * D_k^0.5, and g None equals g = 0."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    lengths = [9]
    q, k, v, beta, g, state = inputs(lengths, seed=3)
    lengths_t = torch.tensor(lengths, dtype=torch.int32)
    o, final = ops().npu_chunk_gated_delta_rule(q, k, v, beta=beta, initial_state=state, actual_seq_lengths=lengths_t,
                                                scale=0.5)
    want_o, want_state = transformers_per_sequence(torch_recurrent_gated_delta_rule, lengths, q * 0.5 * 16 ** 0.5, k, v,
                                                   beta, torch.zeros_like(g), state)
    torch.testing.assert_close(o.float(), want_o, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(final, want_state, atol=1e-5, rtol=1e-5)


def naive_recurrent(q, k, v, state, beta, scale, lengths, slots, accepted, g):
    """op-plugin's golden (test/test_custom_ops/test_npu_recurrent_gated_delta_rule.py), re-written: per sequence
    and head, from state[slots[start + accepted - 1]], the state after each token written to state[slots[t]]."""
    state = state.clone().float()
    out = torch.empty(v.shape)
    nv, nk = v.shape[1], q.shape[1]
    start = 0
    for i, length in enumerate(lengths):
        first = start + (accepted[i] - 1 if accepted is not None else 0)
        init = state[slots[first]].clone()
        for h in range(nv):
            s = init[h]
            for t in range(start, start + length):
                kt, qt = k[t, h // (nv // nk)].float(), q[t, h // (nv // nk)].float() * scale
                s = s * torch.exp(g[t, h].float())
                s = s + ((v[t, h].float() - (s * kt[None, :]).sum(-1)) * beta[t, h].float())[:, None] * kt[None, :]
                state[slots[t], h] = s
                out[t, h] = (s * qt[None, :]).sum(-1)
        start += length
    return out, state


@pytest.mark.parametrize("with_accepted", [False, True], ids=["no_mtp", "num_accepted_tokens"])
def test_recurrent_reads_and_writes_the_states_its_indices_name(with_accepted):
    """Three sequences of 2, 3 and 1 tokens (speculative decoding), their states in slots a permutation names
    among more slots than tokens: the op's output and every slot of the state match op-plugin's golden, the
    untouched slots keep their bytes, and the state is written in place (upstream reads it back)."""
    lengths = [2, 3, 1]
    q, k, v, beta, g, _ = inputs(lengths, seed=5)
    gen = torch.Generator().manual_seed(6)
    state = (torch.randn(9, 4, 8, 16, generator=gen) * 0.3).bfloat16()
    slots = torch.randperm(9, generator=gen)[:6].to(torch.int32)
    accepted = torch.tensor([2, 1, 1], dtype=torch.int32) if with_accepted else None
    want_o, want_state = naive_recurrent(q, k, v, state, beta, 0.25, lengths, slots.long(),
                                         accepted.tolist() if with_accepted else None, g)
    before = state.clone()
    o = ops().npu_recurrent_gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), state, beta=beta.bfloat16(),
                                             scale=0.25, actual_seq_lengths=torch.tensor(lengths, dtype=torch.int32),
                                             ssm_state_indices=slots, num_accepted_tokens=accepted, g=g)
    assert o.dtype == torch.bfloat16 and o.shape == v.shape
    # the golden in fp32 from the same bf16 inputs
    want_o, want_state = naive_recurrent(q.bfloat16(), k.bfloat16(), v.bfloat16(), before, beta.bfloat16(), 0.25,
                                         lengths, slots.long(), accepted.tolist() if with_accepted else None, g)
    torch.testing.assert_close(o.float(), want_o, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(state.float(), want_state.bfloat16().float(), atol=1e-2, rtol=1e-2)
    untouched = sorted(set(range(9)) - set(slots.tolist()))
    assert torch.equal(state[untouched], before[untouched])
    if with_accepted:   # sequence 0 starts from its second token's slot, not its first
        other = naive_recurrent(q.bfloat16(), k.bfloat16(), v.bfloat16(), before, beta.bfloat16(), 0.25, lengths,
                                slots.long(), None, g)[0]
        assert (other[:2] - want_o[:2]).abs().max() > 0.05


def test_prefill_then_decode_equals_one_prefill():
    """Upstream's qwen3_5: the chunked op over a prompt, its final_state copied into the recurrent state, then
    the recurrent op one token per step (actual_seq_lengths 1, ssm_state_indices arange(B)): the same outputs
    as the chunked op over prompt + the new tokens."""
    lengths = [6, 6]
    q, k, v, beta, g, state = inputs([8, 8], seed=9)
    prompt = torch.tensor([0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13])
    steps = [torch.tensor([6, 14]), torch.tensor([7, 15])]
    _, final = ops().npu_chunk_gated_delta_rule(q[prompt], k[prompt], v[prompt], beta=beta[prompt], initial_state=state,
                                                actual_seq_lengths=torch.tensor(lengths), scale=0.25, g=g[prompt])
    decoded = []
    for token in steps:
        decoded.append(ops().npu_recurrent_gated_delta_rule(
            q[token], k[token], v[token], final, beta=beta[token], scale=0.25,
            actual_seq_lengths=torch.ones(2, dtype=torch.int32), ssm_state_indices=torch.arange(2, dtype=torch.int32),
            g=g[token]))
    whole, whole_final = ops().npu_chunk_gated_delta_rule(q, k, v, beta=beta, initial_state=state,
                                                          actual_seq_lengths=torch.tensor([8, 8]), scale=0.25, g=g)
    torch.testing.assert_close(torch.stack(decoded).float(), whole[torch.stack(steps)].float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(final, whole_final, atol=1e-5, rtol=1e-5)


def test_what_the_ops_cannot_take_is_one_line():
    from npu_standin.errors import UnsupportedOp

    q, k, v, beta, g, state = inputs([3], seed=1)
    lengths = torch.tensor([3], dtype=torch.int32)
    chunk = ops().npu_chunk_gated_delta_rule
    with pytest.raises(ValueError, match=r"^npu stand-in: npu_chunk_gated_delta_rule: scale cannot be empty"):
        chunk(q, k, v, beta=beta, initial_state=state, actual_seq_lengths=lengths, g=g)
    with pytest.raises(ValueError, match=r"actual_seq_lengths \[2\] .* must sum to T = 3"):
        chunk(q, k, v, beta=beta, initial_state=state, actual_seq_lengths=torch.tensor([2]), scale=0.25, g=g)
    with pytest.raises(ValueError, match=r"initial_state \(1, 4, 16, 8\) must be \(B, N_v, D_v, D_k\)"):
        chunk(q, k, v, beta=beta, initial_state=state.transpose(-1, -2), actual_seq_lengths=lengths, scale=0.25)
    recurrent = ops().npu_recurrent_gated_delta_rule
    slots = torch.arange(3, dtype=torch.int32)
    with pytest.raises(UnsupportedOp, match=r"npu_recurrent_gated_delta_rule with gk .* has no reference kernel"):
        recurrent(q, k, v, state.expand(3, -1, -1, -1).clone(), beta=beta, scale=0.25, actual_seq_lengths=lengths,
                  ssm_state_indices=slots, gk=torch.zeros(3, 4, 16))
    with pytest.raises(UnsupportedOp, match=r"ssm_state_indices None"):
        recurrent(q, k, v, state.expand(3, -1, -1, -1).clone(), beta=beta, scale=0.25, actual_seq_lengths=lengths)
    q9, k9, v9, beta9, g9, _ = inputs([9], seed=2)
    with pytest.raises(ValueError, match=r"actual_seq_lengths \[9\]: each in \[1, 8\]"):
        recurrent(q9, k9, v9, torch.zeros(9, 4, 8, 16), beta=beta9, scale=0.25, actual_seq_lengths=torch.tensor([9]),
                  ssm_state_indices=torch.arange(9))


def test_the_ops_capture_whole_under_torch_compile():
    """Upstream's decode runs in graph mode: the recurrent op (writing its state in place) and the chunked one
    trace as single ops (fullgraph) and compute what they compute eagerly."""
    q, k, v, beta, g, state = inputs([1, 1], seed=4)

    def decode(q, k, v, state, beta, g):
        return ops().npu_recurrent_gated_delta_rule(q, k, v, state, beta=beta, scale=0.25,
                                                    actual_seq_lengths=torch.ones(2, dtype=torch.int32),
                                                    ssm_state_indices=torch.arange(2, dtype=torch.int32), g=g)

    eager_state, compiled_state = state.clone(), state.clone()
    want = decode(q, k, v, eager_state, beta, g)
    got = torch.compile(decode, fullgraph=True, backend="aot_eager")(q, k, v, compiled_state, beta, g)
    assert torch.equal(got, want) and torch.equal(compiled_state, eager_state) and not torch.equal(compiled_state, state)

    def prefill(q, k, v, beta, state, g):
        return ops().npu_chunk_gated_delta_rule(q, k, v, beta=beta, initial_state=state,
                                                actual_seq_lengths=torch.tensor([1, 1]), scale=0.25, g=g)

    got = torch.compile(prefill, fullgraph=True, backend="aot_eager")(q, k, v, beta, state, g)
    for a, b in zip(got, prefill(q, k, v, beta, state, g)):
        assert torch.equal(a, b)
