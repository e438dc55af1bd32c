"""Packed calls on the "fa4" backend on a real GPU (Note [Packed calls on FA4's varlen path]):
FA4's varlen kernels with the user's own mods where the inner mask is native, the concatenation
with a document mask elsewhere; forward, LSE and every gradient (captured tensors included)
against each sequence computed alone by the float64 reference, three-way rule
(tests/tolerance.py). The path each case must take is checked first, from `explain_backend`.

Skipped without CUDA (and without flash-attn-4). Run on an H200 with
`pytest -q -m gpu tests/codegen/cute/test_gpu_varlen.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

import flexfa
from flexfa import masks as fm
from flexfa import mods as fmods
from flexfa.backends.fa4 import missing_package
from flexfa.reference import reference_attention
from tests.tolerance import ThreeWay


@pytest.fixture(autouse=True)
def _fa4_varlen_on():
    """FA4's varlen path on, whatever FLEXFA_FA4_VARLEN says (Note [Packed calls on FA4's varlen
    path])."""
    with flexfa.config.override(fa4_varlen=True):
        yield


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing_package() is not None, reason=str(missing_package())),
]

VARLEN = "packed sequences on FA4's varlen kernels"
CONCATENATED = "packed sequences as one call on the concatenation"


@dataclasses.dataclass(frozen=True)
class PackedCase:
    """One packed call: sequence lengths, shapes, mods and the path fa4 must take."""

    name: str
    lens_q: tuple[int, ...]
    lens_kv: tuple[int, ...]
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: torch.dtype
    build: Callable  # (case, device) -> (score_mod | None, mask_mod | None, learnable params)
    path: str  # VARLEN or CONCATENATED
    fa4_mask: str = ""  # on the varlen path: "no mask", "its causal mask" or "its window"

    def __str__(self) -> str:
        return (
            f"{self.name}-H{self.heads_q}/{self.heads_kv}-D{self.head_dim}-"
            f"{str(self.dtype).removeprefix('torch.')}"
        )


def _offsets(lens, dev) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).to(dev)


def _causal(case, dev):
    return None, fm.causal, ()


def _learned_alibi(case, dev):
    # ALiBi's slopes, learnable (float32): their gradient sums ds * (kv_idx - q_idx) over every
    # pair of a head, in every sequence.
    slopes = (2.0 ** -torch.arange(1, case.heads_q + 1, dtype=torch.float32)).to(dev)
    slopes.requires_grad_()

    def learned_alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return learned_alibi, fm.causal, (slopes,)


def _softcap_causal(case, dev):
    return fmods.softcap(20.0), fm.causal, ()


def _key_bias(case, dev):
    # A learnable bias per key position within the sequence, and a per-sequence shift read
    # through b: sequences share positions, so its gradient sums over them.
    g = torch.Generator().manual_seed(5)
    bias = (0.5 * torch.randn(max(case.lens_kv), generator=g)).to(dev).requires_grad_()
    shift = torch.randn(len(case.lens_q), generator=g).to(dev)

    def key_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx] + shift[b]

    return key_bias, None, (bias,)


def _shifted_causal_relative_bias(case, dev):
    # Every sequence has 64 more keys than queries; the mask is FA4's causal mask there.
    g = torch.Generator().manual_seed(4)
    table = (0.5 * torch.randn(case.heads_q, 2 * 128 + 1, generator=g)).to(dev).requires_grad_()

    def shifted_causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + 64

    return fmods.relative_bias(table), shifted_causal, (table,)


def _softcap_window(case, dev):
    return fmods.softcap(20.0), fm.sliding_window(256), ()


def _prefix_lm(case, dev):
    return fmods.softcap(30.0), fm.prefix_lm(50), ()


bf16, f16 = torch.bfloat16, torch.float16
CASES = [
    PackedCase("causal", (300, 1000, 1, 777, 128, 64), (300, 1000, 1, 777, 128, 64), 4, 4, 128,
               bf16, _causal, VARLEN, "its causal mask"),
    # GQA with a score_mod: the backward runs on K/V repeated per query head.
    PackedCase("learned_alibi_causal", (513, 1, 1100, 200), (513, 1, 1100, 200), 8, 2, 64, bf16,
               _learned_alibi, VARLEN, "its causal mask"),
    # GQA without a score_mod: FA4's own GQA backward.
    PackedCase("causal", (1000, 513, 2), (1000, 513, 2), 8, 2, 128, f16, _causal, VARLEN,
               "its causal mask"),
    # Empty and length-1 sequences (both sides empty: no tile of FA4's reads them).
    PackedCase("empty_and_single", (0, 1, 700, 0, 1, 65, 0), (0, 1, 700, 0, 1, 65, 0), 4, 4, 64,
               bf16, _softcap_causal, VARLEN, "its causal mask"),
    # cu_seqlens_q != cu_seqlens_kv.
    PackedCase("key_bias_no_mask", (100, 1, 257), (356, 40, 1000), 4, 4, 64, bf16, _key_bias,
               VARLEN, "no mask"),
    PackedCase("shifted_causal_relative_bias", (100, 1, 700), (164, 65, 764), 4, 2, 128, f16,
               _shifted_causal_relative_bias, VARLEN, "its causal mask"),
    PackedCase("softcap_window", (1000, 100, 1, 300), (1000, 100, 1, 300), 4, 4, 96, bf16,
               _softcap_window, VARLEN, "its window"),
    # Not FA4's varlen kernels: an inner mask that is no native mask, and sequences with queries
    # but no keys (rows without keys: output 0, LSE -inf) or keys but no queries.
    PackedCase("prefix_lm", (300, 700), (300, 700), 2, 2, 64, bf16, _prefix_lm, CONCATENATED),
    PackedCase("one_sided_empty", (5, 0, 300, 40), (5, 40, 300, 0), 2, 2, 64, bf16, _causal,
               CONCATENATED),
]  # fmt: skip


def _per_sequence(case, q, k, v, score_mod, mask_mod, dtype):
    """Each sequence alone through flexfa's reference in `dtype` (b = its index), concatenated;
    a sequence without keys gives output 0 and LSE -inf."""
    cq = _offsets(case.lens_q, "cpu").tolist()
    ck = _offsets(case.lens_kv, "cpu").tolist()
    outs, lses = [], []
    for s in range(len(case.lens_q)):
        qs = q[:, :, cq[s] : cq[s + 1]]
        ks, vs = k[:, :, ck[s] : ck[s + 1]], v[:, :, ck[s] : ck[s + 1]]
        if qs.shape[2] == 0:
            continue
        if ks.shape[2] == 0:
            outs.append(qs.new_zeros(qs.shape, dtype=dtype))
            lses.append(torch.full(qs.shape[:3], float("-inf"), dtype=dtype, device=q.device))
            continue
        sm = (lambda sc, b, h, i, j, s=s: score_mod(sc, b + s, h, i, j)) if score_mod else None
        mm = (lambda b, h, i, j, s=s: mask_mod(b + s, h, i, j)) if mask_mod else None
        o, lse = reference_attention(
            qs, ks, vs, sm, mm, enable_gqa=case.heads_q != case.heads_kv, dtype=dtype
        )
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _grads(out, inputs, do):
    grads = torch.autograd.grad(out, inputs, do.to(out.dtype), allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_packed_fa4_matches_reference_on_gpu(case: PackedCase) -> None:
    dev = "cuda"
    torch.manual_seed(0)
    score_mod, mask_mod, params = case.build(case, dev)
    total_q, total_kv = sum(case.lens_q), sum(case.lens_kv)
    q = torch.randn(1, case.heads_q, total_q, case.head_dim, device=dev, dtype=case.dtype)
    k, v = (
        torch.randn(1, case.heads_kv, total_kv, case.head_dim, device=dev, dtype=case.dtype)
        for _ in "kv"
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    call = dict(
        cu_seqlens_q=_offsets(case.lens_q, dev),
        cu_seqlens_kv=_offsets(case.lens_kv, dev),
        enable_gqa=case.heads_q != case.heads_kv,
    )
    explained = flexfa.explain_backend(q, k, v, score_mod, mask_mod, **call)
    fa4_line = explained.splitlines()[0]
    assert fa4_line.startswith("fa4: yes") and case.path in fa4_line, explained
    if case.path == VARLEN:
        assert f"{VARLEN} with {case.fa4_mask}," in fa4_line, explained
    out, lse = flexfa.attention(
        q, k, v, score_mod, mask_mod, return_lse=True, backend="fa4", **call
    )
    assert out.shape == (1, case.heads_q, total_q, case.head_dim)
    assert lse.shape == (1, case.heads_q, total_q)

    do = torch.randn_like(out)
    inputs = (q, k, v, *params)
    grads = _grads(out, inputs, do)
    check = ThreeWay(case.dtype, context=str(case))
    expected = {}
    for dtype in (torch.float64, case.dtype):
        o, l = _per_sequence(case, q, k, v, score_mod, mask_mod, dtype)
        expected[dtype] = (o, l, _grads(o, inputs, do))
    (ref_o, ref_l, ref_g), (eager_o, eager_l, eager_g) = (
        expected[torch.float64],
        expected[case.dtype],
    )
    check("out", out, eager_o, ref_o)
    check("lse", lse, eager_l.float(), ref_l, atol=1e-3)
    names = ("dq", "dk", "dv", *(f"dparam{i}" for i in range(len(params))))
    for name, a, e, r in zip(names, grads, eager_g, ref_g):
        check(name, a, e, r)
    check.assert_ok()
    for g in grads:
        assert torch.isfinite(g).all()
    # Sequences without keys: output 0 and LSE -inf; keys without queries: zero dK, dV.
    cq, ck = _offsets(case.lens_q, "cpu").tolist(), _offsets(case.lens_kv, "cpu").tolist()
    for s, (lq, lkv) in enumerate(zip(case.lens_q, case.lens_kv)):
        if lq and not lkv:
            assert (out[:, :, cq[s] : cq[s + 1]] == 0).all()
            assert torch.isneginf(lse[:, :, cq[s] : cq[s + 1]]).all()
        if lkv and not lq:
            assert (grads[1][:, :, ck[s] : ck[s + 1]] == 0).all()
            assert (grads[2][:, :, ck[s] : ck[s + 1]] == 0).all()


def test_varlen_hooks_see_sequences_and_positions_within_them_on_gpu() -> None:
    """FA4's varlen kernels hand the hooks b = the sequence and q_idx, kv_idx counted from its
    start, as flexfa's mods are defined (Note [Packed calls on FA4's varlen path]): each query
    attends only to the key 3 positions after its own within its sequence, and its score carries
    8 * b, so the output is that key's value row and the LSE is 8 * b, exactly."""
    lens_q, lens_kv = (5, 130, 1, 77), (8, 133, 4, 80)
    cu_q, cu_kv = _offsets(lens_q, "cuda"), _offsets(lens_kv, "cuda")
    q = torch.randn(1, 2, sum(lens_q), 64, device="cuda", dtype=bf16)
    k = torch.randn(1, 2, sum(lens_kv), 64, device="cuda", dtype=bf16)
    v = torch.randn(1, 2, sum(lens_kv), 64, device="cuda", dtype=bf16)

    def probe(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx == q_idx + 3, 0.0, -1000.0) + 8.0 * b + 0.0 * score

    call = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    fa4_line = flexfa.explain_backend(q, k, v, probe, **call).splitlines()[0]
    assert f"{VARLEN} with no mask," in fa4_line, fa4_line
    out, lse = flexfa.attention(q, k, v, probe, return_lse=True, backend="fa4", **call)
    cq, ck = _offsets(lens_q, "cpu").tolist(), _offsets(lens_kv, "cpu").tolist()
    for s, lq in enumerate(lens_q):
        rows = torch.arange(cq[s], cq[s] + lq)
        keys = torch.arange(ck[s], ck[s] + lq) + 3
        torch.testing.assert_close(out[:, :, rows], v[:, :, keys], atol=0, rtol=0)
        torch.testing.assert_close(lse[:, :, rows], torch.full_like(lse[:, :, rows], 8.0 * s))


def test_packed_causal_equals_the_concatenated_path_on_gpu() -> None:
    """The two paths of a packed call compute the same attention: FA4's varlen kernels and the
    concatenation with its document mask (forced by `kernel_options={"block_sparse": True}`)."""
    torch.manual_seed(1)
    lens = (512, 1, 1500, 300)
    cu = _offsets(lens, "cuda")
    q, k, v = (
        torch.randn(1, 4, sum(lens), 128, device="cuda", dtype=bf16, requires_grad=True)
        for _ in "qkv"
    )
    call = dict(score_mod=fmods.alibi, block_mask=fm.causal, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    varlen = flexfa.attention(q, k, v, backend="fa4", **call)
    concatenated = flexfa.attention(q, k, v, backend="fa4", kernel_options={"block_sparse": True},
                                    **call)  # fmt: skip
    assert VARLEN in flexfa.explain_backend(q, k, v, **call).splitlines()[0]
    torch.testing.assert_close(varlen, concatenated, atol=2e-2, rtol=2e-2)
    # auto takes fa4 for such a call (Note [Which backend auto picks]), on the varlen kernels.
    assert flexfa.explain_backend(q, k, v, **call).splitlines()[-1] == "auto: fa4"
