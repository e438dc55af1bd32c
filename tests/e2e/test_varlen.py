"""Packed variable-length batches (cu_seqlens_q/cu_seqlens_kv) against per-sequence references,
forward and backward, with empty and length-1 sequences (Note [Packed batches as mods])."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import flexfa
from flexfa.blockmask import packed
from tests.blockmask.strategies import examples
from tests.sequences import per_sequence_reference

LENS_Q = [5, 0, 1, 9, 3]
LENS_KV = [7, 3, 1, 9, 0]


def _offsets(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(dtype, seed=0, heads_q=4, heads_kv=2, e=16):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()

    tq, tk = sum(LENS_Q), sum(LENS_KV)
    return randn(1, heads_q, tq, e), randn(1, heads_kv, tk, e), randn(1, heads_kv, tk, e)


def _reference(q, k, v, score_mod, mask_mod, lens_q=LENS_Q, lens_kv=LENS_KV):
    """Each sequence on its own (mods see b = its index), concatenated; differentiable."""
    return per_sequence_reference(q, k, v, score_mod, mask_mod, lens_q, lens_kv)


SEQ_BIAS = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5], dtype=torch.float64)
KEEP = torch.tensor([4, 1, 1, 6, 0])


def biased(score, b, h, q_idx, kv_idx):
    """Reads b (the sequence) and relative positions."""
    return score + SEQ_BIAS[b] - 0.1 * (q_idx - kv_idx).abs()


def key_padding(b, h, q_idx, kv_idx):
    return kv_idx < KEEP[b]


@pytest.mark.parametrize(
    "backend, score_mod, mask_mod",
    [
        ("tiled", None, None),
        ("tiled", biased, flexfa.masks.causal),
        ("tiled", flexfa.mods.alibi, key_padding),
        ("triton", biased, key_padding),
    ],
    ids=["tiled-plain", "tiled-biased-causal", "tiled-alibi-padding", "triton-biased-padding"],
)
def test_packed_forward_and_backward(backend, score_mod, mask_mod):
    dtype = torch.float64 if backend == "tiled" else torch.float32
    q, k, v = _inputs(dtype)
    options = {
        "block_m": 16,
        "block_n": 16,
        **{f"bwd_block_{x}": 16 for x in ("m1", "n1", "m2", "n2")},
    }
    out, lse = flexfa.attention(
        q, k, v, score_mod, mask_mod, enable_gqa=True, return_lse=True, backend=backend,
        cu_seqlens_q=_offsets(LENS_Q), cu_seqlens_kv=_offsets(LENS_KV),
        kernel_options=options if backend == "triton" else None,
    )  # fmt: skip
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _reference(qr, kr, vr, score_mod, mask_mod)
    tol = dict(atol=1e-7, rtol=1e-6) if dtype == torch.float64 else dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, **tol)
    g = torch.Generator().manual_seed(9)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64)

    def loss(o, lse_):
        return (o.double() * dout).sum() + torch.where(
            torch.isneginf(lse_), 0.0, lse_.double() * dlse
        ).sum()

    grads = torch.autograd.grad(loss(out, lse), (q, k, v))
    expected = torch.autograd.grad(loss(ref, ref_lse), (qr, kr, vr), allow_unused=True)
    for got, want in zip(grads, expected):
        want = torch.zeros_like(got, dtype=torch.float64) if want is None else want
        torch.testing.assert_close(got.double(), want, **tol)


def test_packed_errors_are_clear():
    q, k, v = _inputs(torch.float64)
    cq, ck = _offsets(LENS_Q), _offsets(LENS_KV)
    call = dict(enable_gqa=True, backend="tiled")
    with pytest.raises(ValueError, match="both cu_seqlens_q and cu_seqlens_kv"):
        flexfa.attention(q, k, v, cu_seqlens_q=cq, **call)
    with pytest.raises(ValueError, match="end at the packed length"):
        flexfa.attention(q, k, v, cu_seqlens_q=cq + 1, cu_seqlens_kv=ck, **call)
    with pytest.raises(ValueError, match="int32"):
        flexfa.attention(q, k, v, cu_seqlens_q=cq.long(), cu_seqlens_kv=ck, **call)
    bm = flexfa.create_block_mask(flexfa.masks.causal, None, None, q.shape[2], k.shape[2])
    with pytest.raises(ValueError, match="mask_mod or None"):
        flexfa.attention(q, k, v, block_mask=bm, cu_seqlens_q=cq, cu_seqlens_kv=ck, **call)
    with pytest.raises(ValueError, match="cu_seqlens_kv is on meta, but q is on cpu"):
        flexfa.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_kv=ck.to("meta"), **call)
    with pytest.raises(ValueError, match=r"\(1, heads, total_len"):
        flexfa.attention(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                         cu_seqlens_q=cq, cu_seqlens_kv=ck, **call)  # fmt: skip


def test_strided_offsets_give_the_offsets_results():
    """Offsets as a strided view (every other element of a tensor) read as their values: the
    kernels take a contiguous copy."""
    q, k, v = _inputs(torch.float64)
    call = dict(enable_gqa=True, backend="tiled", return_lse=True)
    want = flexfa.attention(
        q, k, v, None, flexfa.masks.causal, cu_seqlens_q=_offsets(LENS_Q),
        cu_seqlens_kv=_offsets(LENS_KV), **call,
    )  # fmt: skip
    strided = [torch.stack([_offsets(lens), _offsets(lens)], 1)[:, 0] for lens in (LENS_Q, LENS_KV)]
    assert not strided[0].is_contiguous()
    got = flexfa.attention(
        q,
        k,
        v,
        None,
        flexfa.masks.causal,
        cu_seqlens_q=strided[0],
        cu_seqlens_kv=strided[1],
        **call,
    )
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_explain_backend_takes_a_packed_call():
    q = torch.randn(1, 2, 10, 8)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    text = flexfa.explain_backend(
        q, q, q, block_mask=flexfa.masks.causal, cu_seqlens_q=cu, cu_seqlens_kv=cu
    )
    assert text.splitlines()[-1] == "auto: tiled", text
    with pytest.raises(ValueError, match="both cu_seqlens_q and cu_seqlens_kv"):
        flexfa.explain_backend(q, q, q, cu_seqlens_q=cu)


_LENGTHS = st.one_of(st.just(0), st.just(1), st.integers(0, 300))
_MASKS = {
    "none": None,
    "causal": flexfa.masks.causal,
    "sliding_window(4)": flexfa.masks.sliding_window(4),
    "prefix_lm(3)": flexfa.masks.prefix_lm(3),
    "key_padding": key_padding,
}


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(_LENGTHS, _LENGTHS), min_size=1, max_size=5),
    st.booleans(),
    st.sampled_from(sorted(_MASKS)),
)
def test_packed_block_masks_from_offsets_give_the_reference(lens, same, name):
    """Random packings (empty and length-1 sequences, queries and keys of other lengths or not)
    whose BlockMask the packed builder makes (Note [Tiles of a packed mask]), on the tiled
    backend, against each sequence computed alone."""
    lens_q = [a for a, _ in lens]
    lens_kv = lens_q if same else [b for _, b in lens]
    assume(sum(lens_q) > 0 and sum(lens_kv) > 0)
    mask_mod = _MASKS[name]
    if mask_mod is key_padding:
        assume(len(lens_q) <= len(KEEP))
    g = torch.Generator().manual_seed(len(lens_q))
    q = torch.randn(1, 2, sum(lens_q), 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, sum(lens_kv), 8, generator=g, dtype=torch.float64) for _ in "kv")
    cu_q = _offsets(lens_q)
    cu_kv = cu_q if same else _offsets(lens_kv)
    before = packed.built["packed"]
    out, lse = flexfa.attention(
        q, k, v, block_mask=mask_mod, return_lse=True, backend="tiled",
        cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
    )  # fmt: skip
    assert packed.built["packed"] == before + 1  # built from the offsets, not by the analysis
    ref, ref_lse = _reference(q, k, v, None, mask_mod, lens_q, lens_kv)
    torch.testing.assert_close(out, ref, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-7, rtol=1e-6)
