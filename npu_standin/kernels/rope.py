"""Rotary position embedding ops."""

from __future__ import annotations

import torch

from npu_standin.kernels import refuse, reference


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_interleave(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _rotate(x, mode: str, op: str):
    if mode == "half":
        return _rotate_half(x)
    if mode == "interleave":
        return _rotate_interleave(x)
    refuse(op, f"rotary_mode={mode!r}")


def _rotary_mul_fake(x, r1, r2, rotary_mode="half", rotate=None):
    return torch.empty_like(x)


@reference("npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> Tensor",
           formulation="out = r1 * x + r2 * x_new; x_new = cat(-x2, x1) (half) | interleaved pairs (interleave) "
                       "| x @ rotate; fp32",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py"
                "::test_rotary_mul_half_matches_transformers_rope",
           fake=_rotary_mul_fake)
def npu_rotary_mul(x, r1, r2, rotary_mode="half", rotate=None):
    x32 = x.float()
    x_new = x32 @ rotate.float() if rotate is not None else _rotate(x32, rotary_mode, "npu_rotary_mul")
    return (r1.float() * x32 + r2.float() * x_new).to(x.dtype)


def _apply_rope(x, cos, sin, mode, op):
    d = cos.shape[-1]
    x32 = x.float()
    rot, rest = x32[..., :d], x32[..., d:]
    out = rot * cos.float() + _rotate(rot, mode, op) * sin.float()
    if rest.shape[-1]:
        out = torch.cat((out, rest), dim=-1)
    return out.to(x.dtype)


def _apply_rotary_pos_emb_fake_new(query, key, cos, sin, layout="BSND", rotary_mode="half"):
    return torch.empty_like(query), torch.empty_like(key)


@reference("npu_apply_rotary_pos_emb(Tensor query, Tensor key, Tensor cos, Tensor sin, str layout='BSND', "
           "str rotary_mode='half') -> (Tensor, Tensor)",
           mutates=("query", "key"),
           capture_schema="_standin_npu_apply_rotary_pos_emb(Tensor(a!) query, Tensor(b!) key, Tensor cos, "
                          "Tensor sin, str layout='BSND', str rotary_mode='half') -> ()",
           formulation="q*cos + rotate_half(q)*sin (and k), written into query/key in place as documented and "
                       "returned; layouts BSND (=BSH)/SBND/BNSD/TND broadcast cos/sin (N=1); cos D < q D rotates the "
                       "first D only",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py"
                "::test_apply_rotary_pos_emb_matches_transformers_bsnd_and_tnd",
           fake=_apply_rotary_pos_emb_fake_new)
def npu_apply_rotary_pos_emb(query, key, cos, sin, layout="BSND", rotary_mode="half"):
    # "BSH" names the same 4-d (B, S, N, D) layout as "BSND" (op-plugin ApplyRotaryPosEmbNpuOpApi.cpp:
    # LAYOUT_BSND_BSH = 1); legacy recipes pass it.
    layout = "BSND" if layout == "BSH" else layout
    if layout not in ("BSND", "SBND", "BNSD", "TND"):
        refuse("npu_apply_rotary_pos_emb", f"layout={layout!r}")
    expected = 3 if layout == "TND" else 4
    if query.dim() != expected or key.dim() != expected:
        raise ValueError(f"npu_apply_rotary_pos_emb: layout {layout} needs {expected}-d query and key, got "
                         f"{tuple(query.shape)} and {tuple(key.shape)}")
    query.copy_(_apply_rope(query, cos, sin, rotary_mode, "npu_apply_rotary_pos_emb"))
    key.copy_(_apply_rope(key, cos, sin, rotary_mode, "npu_apply_rotary_pos_emb"))
    return query, key


def _interleave_rope_fake(x, cos, sin):
    return torch.empty_like(x)


@reference("npu_interleave_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor",
           formulation="q = x.reshape(B,N,S,D/2,2).transpose(-1,-2).reshape(B,N,S,D); q*cos + rotate_half(q)*sin",
           test="tests/unit/npu_standin/kernels/test_reference_kernels.py::test_interleave_rope_matches_naive_loop",
           fake=_interleave_rope_fake)
def npu_interleave_rope(x, cos, sin):
    b, n, s, d = x.shape
    # torch_npu's documented constraints (Ascend Extension for PyTorch 7.0.0 API reference,
    # torch_npu.npu_interleave_rope, ptaoplist_002369): D of x, cos and sin must equal 64; N of cos / sin is 1
    if (d, cos.shape[-1], sin.shape[-1]) != (64, 64, 64) or cos.shape[1] != 1 or sin.shape[1] != 1:
        raise ValueError(f"npu_interleave_rope: x, cos and sin need a last dim (D) of 64 and cos / sin one head (N 1) "
                         f"(got x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)})")
    q = x.float().reshape(b, n, s, d // 2, 2).transpose(-1, -2).reshape(b, n, s, d)
    return (q * cos.float() + _rotate_half(q) * sin.float()).to(x.dtype)
