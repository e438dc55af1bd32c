"""Packed calls on FA4's varlen kernels, without a GPU (Note [Packed calls on FA4's varlen path]):
the proof that one native mask of FA4's equals the user's mask in every sequence, the decision
which path a packed call takes, and the whole path - layouts, offsets, autograd, captured-tensor
gradients - with FA4's varlen entry points replaced by a float64 stand-in that applies FA4's own
mask semantics (bottom-right aligned per sequence) and hands the mods FA4's indices."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import math
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flexfa
from flexfa import masks as fm
from flexfa.api import _packed, build_spec
from flexfa.backends import fa4
from flexfa.codegen.cute.emit import AuxLayout
from flexfa.codegen.cute.plan import lower_packed_mask, native_mask
from flexfa.frontend import trace_mask_mod
from flexfa.reference import reference_attention
from tests.codegen.cute.test_plan import dense
from tests.sequences import per_sequence_reference


@pytest.fixture(autouse=True)
def _fa4_varlen_on():
    """FA4's varlen path on, whatever FLEXFA_FA4_VARLEN says (Note [Packed calls on FA4's varlen
    path])."""
    with flexfa.config.override(fa4_varlen=True):
        yield


def _offsets(lens) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _shapes(lens_q, lens_kv):
    pairs = {(a, b) for a, b in zip(lens_q, lens_kv) if a and b}
    return sorted(pairs, key=lambda p: (-(p[0] + p[1]), p))


def check(mask_mod, lens_q, lens_kv) -> str:
    """The lowering of `mask_mod` for sequences of these lengths; where it is native, FA4's
    native mask equals the mask at every pair of every sequence."""
    shapes = _shapes(lens_q, lens_kv)
    lowering = lower_packed_mask(trace_mask_mod(mask_mod), shapes)
    if lowering.native:
        for len_q, len_kv in shapes:
            torch.testing.assert_close(
                native_mask(lowering, len_q, len_kv),
                dense(mask_mod, len_q, len_kv),
                msg=lambda m, s=(len_q, len_kv): f"sequence {s}: {m}",
            )
    return lowering.kind


def _shifted_causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx + 64  # causal for sequences with 64 more keys than queries


def _strictly_causal(b, h, q_idx, kv_idx):
    return kv_idx < q_idx  # row 0 sees nothing


def _by_sequence(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (b == 0)


SAME = [700, 1, 300, 129]
PLUS_64 = [n + 64 for n in SAME]


@pytest.mark.parametrize(
    ("mask_mod", "lens_q", "lens_kv", "kind"),
    [
        (fm.causal, SAME, SAME, "causal"),
        (fm.causal, [1, 1, 1], [1, 1, 1], "full"),  # one pair per sequence: nothing to mask
        (fm.causal, [0, 5, 0], [0, 5, 0], "causal"),  # empty sequences do not enter the proof
        (fm.sliding_window(100), SAME, SAME, "window"),
        (fm.sliding_window(1000), SAME, SAME, "causal"),  # wider than every sequence
        (fm.sliding_window(100, causal=False), SAME, SAME, "window"),
        (fm.noop_mask, SAME, PLUS_64, "full"),
        (_shifted_causal, SAME, PLUS_64, "causal"),  # bottom-right causal in every sequence
        # Top-left causal with more keys than queries: FA4's right bound would be negative.
        (fm.causal, SAME, PLUS_64, "mask_mod"),
        # Sequences with different len_kv - len_q: no one window of FA4's fits them all.
        (fm.causal, [300, 100], [200, 100], "mask_mod"),
        (fm.causal, [300, 100], [100, 300], "mask_mod"),
        (_strictly_causal, SAME, SAME, "mask_mod"),  # rows without keys
        (fm.prefix_lm(16), SAME, SAME, "mask_mod"),
        (fm.dilated_sliding_window(64, 2), SAME, SAME, "mask_mod"),
        (fm.chunked(64), SAME, SAME, "mask_mod"),
        (_by_sequence, SAME, SAME, "mask_mod"),  # reads b
    ],
)
def test_packed_lowering_and_its_proof(mask_mod, lens_q, lens_kv, kind):
    assert check(mask_mod, lens_q, lens_kv) == kind


def test_window_bounds_of_a_packed_sliding_window():
    shapes = _shapes(SAME, SAME)
    lowering = lower_packed_mask(trace_mask_mod(fm.sliding_window(100)), shapes)
    assert lowering.fa4_kwargs() == {"window_size_left": 99, "window_size_right": 0}
    assert "q_idx - kv_idx <= 99" in lowering.reason


@settings(max_examples=60, deadline=None)
@given(
    lo=st.integers(-60, 60),
    width=st.integers(0, 90),
    lens=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 70)), min_size=1, max_size=5),
)
def test_band_masks_go_native_only_where_equal_in_every_sequence(lo, width, lens):
    lens = [(a, b) if a and b else (0, 0) for a, b in lens]
    if not any(a for a, _ in lens):
        return
    hi = lo + width

    def band(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx >= lo) & (q_idx - kv_idx <= hi)

    check(band, [a for a, _ in lens], [b for _, b in lens])  # asserts wherever it goes native


# -- the decision, through the front door's own spec --------------------------------------------


def _packed_spec(
    lens_q,
    lens_kv,
    score_mod=None,
    mask_mod=fm.causal,
    *,
    heads=(2, 2),
    head_dim=64,
    dtype=torch.bfloat16,
    grad=True,
    cuda=True,
    **kw,
):
    """The spec `flexfa.attention` builds for a packed call, moved to a (pretend) CUDA device."""
    cu_q, cu_kv = _offsets(lens_q), _offsets(lens_kv)
    q = torch.randn(1, heads[0], sum(lens_q), head_dim, dtype=dtype, requires_grad=grad)
    k = torch.randn(1, heads[1], sum(lens_kv), head_dim, dtype=dtype, requires_grad=grad)
    score, mask, packed = _packed(q, k, score_mod, mask_mod, cu_q, cu_kv)
    spec = build_spec(q, k, k, score, mask, enable_gqa=heads[0] != heads[1], packed=packed, **kw)
    return dataclasses.replace(spec, device=torch.device("cuda")) if cuda else spec


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fa4, "missing_package", lambda: None)


def test_packed_spec_keeps_the_users_own_mods():
    spec = _packed_spec([3, 0, 5], [4, 0, 5], flexfa.mods.alibi, fm.causal, cuda=False)
    packed = spec.packed
    assert packed.lens_q == (3, 0, 5) and packed.lens_kv == (4, 0, 5)
    assert (packed.max_len_q, packed.max_len_kv, packed.shapes) == (5, 5, ((5, 5), (3, 4)))
    assert packed.score_mod.name == "alibi" and packed.mask.name == "causal"
    assert spec.score_mod.name == "packed_alibi"  # every backend runs the rewritten mods
    plain = build_spec(*(torch.randn(1, 2, 8, 64) for _ in range(3)))
    assert plain.packed is None


def test_varlen_path_taken_exactly_where_proven(sm90):
    from flexfa.codegen.cute import backend

    same = [300, 1, 0, 129]
    taken = {
        "causal": _packed_spec(same, same),
        "alibi + causal, GQA": _packed_spec(same, same, flexfa.mods.alibi, heads=(4, 2)),
        "no mask, other key lengths": _packed_spec(same, [10, 7, 0, 1], mask_mod=None),
        "a sliding window": _packed_spec(same, same, mask_mod=fm.sliding_window(64)),
        "deterministic without a backward": _packed_spec(
            same, same, grad=False, deterministic=True
        ),
    }
    for why, spec in taken.items():
        lowering = backend.packed_lowering(spec)
        assert lowering is not None and lowering.native, (why, lowering)
    declined = {
        "a mask not native": (_packed_spec(same, same, mask_mod=fm.prefix_lm(8)), "function of"),
        "top-left causal with more keys": (
            _packed_spec(same, [n + 1 if n else 0 for n in same]),
            "negative",
        ),
        "queries without keys": (_packed_spec([3, 4], [3, 0]), "sequence 1 has 4 queries and 0"),
        "keys without queries": (_packed_spec([3, 0], [3, 4]), "sequence 1 has 0 queries and 4"),
        "deterministic backward": (_packed_spec(same, same, deterministic=True), "deterministic"),
        "block-sparse option": (
            _packed_spec(same, same, kernel_options={"block_sparse": True}),
            "block_sparse",
        ),
    }
    for why, (spec, reason) in declined.items():
        lowering = backend.packed_lowering(spec)
        assert lowering is not None and not lowering.native, why
        assert reason in lowering.reason, (why, lowering.reason)
    unpacked = dataclasses.replace(taken["causal"], packed=None)
    assert backend.packed_lowering(unpacked) is None


def test_varlen_path_is_sm90_only(monkeypatch, sm90):
    from flexfa.codegen.cute import backend

    spec = _packed_spec([64, 64], [64, 64])
    assert backend.packed_lowering(spec).native
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert "sm90" in backend.packed_lowering(spec).reason


def test_explain_and_auto_say_which_path(sm90):
    native = _packed_spec([512, 300], [512, 300])
    answer = fa4.Fa4Backend().supports(native)
    assert answer.ok and "packed sequences on FA4's varlen kernels with its causal mask" in (
        answer.reason
    )
    assert fa4.Fa4Backend().auto_prefers(native)
    concatenated = _packed_spec([512, 300], [512, 300], mask_mod=fm.prefix_lm(8))
    answer = fa4.Fa4Backend().supports(concatenated)
    assert answer.ok and "as one call on the concatenation" in answer.reason
    assert "not a function of q_idx - kv_idx" in answer.reason
    # A note on the path is no reservation: auto still runs the varlen path, and notes that are
    # reservations (a padded backward) are kept beside it.
    padded = _packed_spec([512, 300], [512, 300], head_dim=80)
    answer = fa4.Fa4Backend().supports(padded)
    assert "FA4's varlen kernels" in answer.reason and "head dim 96" in answer.reason
    assert not fa4.Fa4Backend().auto_prefers(padded)


def test_packed_calls_stay_out_of_the_call_memo():
    from flexfa import api

    cu = _offsets([5, 3])
    q = torch.randn(1, 2, 8, 16)
    api._memo.clear()
    with torch.no_grad():
        for _ in range(2):
            flexfa.attention(q, q, q, block_mask=fm.causal, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert not api._memo


# -- the whole path, FA4's varlen entry points replaced by a stand-in ---------------------------


def _fa4_mask(causal=False, window_size_left=None, window_size_right=None):
    """FA4's native mask as a mask_mod of one sequence, bottom-right aligned (off is bound per
    sequence by the caller)."""

    def mask(off):
        def fn(b, h, q_idx, kv_idx):
            ok = q_idx == q_idx
            if causal or window_size_right is not None:
                ok = ok & (kv_idx <= q_idx + off + (0 if causal else window_size_right))
            if window_size_left is not None:
                ok = ok & (kv_idx >= q_idx + off - window_size_left)
            return ok

        return fn

    return mask


def _tensors_at(aux_scalars, aux) -> list[torch.Tensor]:
    """The tensors whose addresses and sizes the call passed in `aux_scalars` (Note [Captured
    tensors by address]), as CPU tensors over the same memory: what the generated hooks' views
    read and the gradient atomics write."""
    if aux_scalars is None:
        return []
    tensors = []
    for position, (dtype, rank) in enumerate(aux.tensors):
        if aux.address(position) >= len(aux_scalars):  # the forward passes no gradient buffers
            break
        address = aux_scalars[aux.address(position)].value
        sizes = [aux_scalars[aux.size(position, d)].value for d in range(rank)]
        stored = torch.uint8 if dtype.is_bool else dtype.torch
        nbytes = math.prod(sizes) * torch.empty((), dtype=stored).element_size()
        memory = (ctypes.c_byte * nbytes).from_address(address)
        tensors.append(torch.frombuffer(memory, dtype=stored).view(sizes))
    return tensors


class _StandIn:
    """FA4's `_flash_attn_fwd` / `_flash_attn_bwd` for varlen calls, in float64: per sequence,
    the mods with FA4's indices (b = sequence, positions within it) under FA4's native mask. The
    score_mod is the test's, made from the captured tensors FA4 would hand its hooks: read at the
    addresses in `aux_scalars`, laid out as `aux` (the call's AuxLayout) says."""

    def __init__(self, make_score_mod, num_captures):
        self.make_score_mod = make_score_mod
        self.num_captures = num_captures
        self.seen = {}
        self.aux = None  # set when the call's hooks are made

    def _sequences(self, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        lens_q = [b - a for a, b in itertools.pairwise(cq)]
        lens_kv = [b - a for a, b in itertools.pairwise(ck)]
        assert (max_seqlen_q, max_seqlen_k) == (max(lens_q), max(lens_kv))
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        return [(s, cq[s], cq[s + 1], ck[s], ck[s + 1]) for s in range(len(lens_q))]

    def _attend(self, s, q, k, v, captures, scale, mask_kwargs):
        """(out, lse) of one sequence from (L, H, D) slices, differentiable."""
        score_mod = self.make_score_mod(*captures) if self.make_score_mod else None
        sm = (lambda sc, b, h, i, j: score_mod(sc, b + s, h, i, j)) if score_mod else None
        off = k.shape[0] - q.shape[0]
        as_flexfa = [t.transpose(0, 1)[None] for t in (q, k, v)]
        return reference_attention(
            *as_flexfa, sm, _fa4_mask(**mask_kwargs)(off), scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # fmt: skip

    def forward(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, mask_mod, aux_tensors, aux_scalars, block_sparse_tensors, out,
                lse=None, **kw):  # fmt: skip
        assert q.ndim == k.ndim == v.ndim == 3 and mask_mod is None and block_sparse_tensors is None
        assert aux_tensors is None  # Note [Captured tensors by address]
        mask_kwargs = {n: kw.pop(n) for n in ("causal", "window_size_left", "window_size_right")
                       if n in kw}  # fmt: skip
        self.seen["fwd"] = (tuple(q.shape), tuple(k.shape), mask_kwargs)
        captures = _tensors_at(aux_scalars, self.aux)[: self.num_captures]
        given, lse = lse, torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
        for s, q0, q1, k0, k1 in self._sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                 max_seqlen_k):  # fmt: skip
            if q1 == q0:
                continue
            o, l = self._attend(s, q[q0:q1], k[k0:k1], v[k0:k1], captures, softmax_scale,
                                mask_kwargs)  # fmt: skip
            out[q0:q1] = o[0].transpose(0, 1).to(out.dtype)
            lse[:, q0:q1] = l[0].float()
        if given is not None:  # FA4 writes the LSE into a tensor it is given
            given.copy_(lse)
            lse = given
        return out, lse, None, None, None

    def backward(self, q, k, v, out, dout, lse, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, softmax_scale, aux_tensors, aux_scalars, dlse, **kw):  # fmt: skip
        mask_kwargs = {n: kw[n] for n in ("causal", "window_size_left", "window_size_right")
                       if n in kw}  # fmt: skip
        self.seen["bwd"] = (tuple(q.shape), tuple(k.shape), tuple(lse.shape), mask_kwargs)
        assert aux_tensors is None
        aux = _tensors_at(aux_scalars, self.aux)
        captures = [t.detach().clone().requires_grad_() for t in aux[: self.num_captures]]
        buffers = aux[self.num_captures :]
        dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
        for s, q0, q1, k0, k1 in self._sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                 max_seqlen_k):  # fmt: skip
            if q1 == q0:
                continue
            leaves = [t.detach().requires_grad_() for t in (q[q0:q1], k[k0:k1], v[k0:k1])]
            with torch.enable_grad():
                o, l = self._attend(s, *leaves, captures, softmax_scale, mask_kwargs)
                d_lse = dlse[:, q0:q1][None] if dlse is not None else torch.zeros_like(l)
                grads = torch.autograd.grad(
                    (o, l), [*leaves, *captures], (dout[q0:q1].transpose(0, 1)[None], d_lse),
                    allow_unused=True,
                )  # fmt: skip
            for dst, g, lo, hi in ((dq, grads[0], q0, q1), (dk, grads[1], k0, k1),
                                   (dv, grads[2], k0, k1)):  # fmt: skip
                dst[lo:hi] = g
            for buf, g in zip(buffers, grads[3:]):
                if g is not None:
                    buf.add_(g.reshape(buf.shape).float())
        return dq, dk, dv


def _install(monkeypatch, stand_in):
    from flexfa.codegen.cute import backend, jitcache, launch

    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd = stand_in.forward
    interface._flash_attn_bwd = stand_in.backward
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    monkeypatch.setattr(jitcache, "install", lambda: None)

    def hooks_for(score, mask, grad_slots):
        stand_in.aux = AuxLayout.of(score, mask, grad_slots)
        return launch.Hooks(None, None, None, stand_in.aux)

    monkeypatch.setattr(backend, "hooks_for", hooks_for)
    monkeypatch.setattr(backend, "_arch_major", lambda device: 9)


def _four_more_keys_causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx + 4  # FA4's causal mask where every sequence has 4 more keys


@pytest.mark.parametrize(
    ("heads", "head_dim", "lens_q", "lens_kv", "mask_mod", "fa4_mask"),
    [
        ((4, 2), 64, [7, 0, 1, 12], [7, 0, 1, 12], fm.causal, {"causal": True}),
        ((2, 2), 40, [9, 1, 5], [13, 5, 9], _four_more_keys_causal, {"causal": True}),
        ((2, 2), 64, [9, 1, 5], [3, 8, 2], None, {}),
    ],
    ids=["alibi-causal-gqa", "shifted-causal-padded-backward", "no-mask-other-key-lengths"],
)
def test_varlen_path_end_to_end_with_a_stand_in(monkeypatch, heads, head_dim, lens_q, lens_kv,
                                                mask_mod, fa4_mask):  # fmt: skip
    """`backend.run` on a packed call: FA4's varlen entry points get (total, H, D) views, the
    offsets and the longest lengths, the native mask and the user's own mods' captures (plus a
    float32 gradient buffer); output, LSE, dq, dk, dv and the captured tensor's gradient equal
    each sequence computed alone by flexfa's reference. GQA with a score_mod runs the backward
    on repeated K/V; head dim 40 runs it zero-padded to 64."""
    f64 = torch.float64
    slopes = torch.tensor([0.5, -0.25, 0.125, 1.0][: heads[0]], dtype=f64, requires_grad=True)

    def make(slopes):
        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx) + 0.1 * b

        return alibi

    stand_in = _StandIn(make, num_captures=1)
    _install(monkeypatch, stand_in)
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=f64).requires_grad_()

    q = randn(1, heads[0], sum(lens_q), head_dim)
    k, v = randn(1, heads[1], sum(lens_kv), head_dim), randn(1, heads[1], sum(lens_kv), head_dim)
    cu_q, cu_kv = _offsets(lens_q), _offsets(lens_kv)
    score, mask, packed = _packed(q, k, make(slopes), mask_mod, cu_q, cu_kv)
    spec = build_spec(q, k, v, score, mask, enable_gqa=heads[0] != heads[1], packed=packed)
    spec = dataclasses.replace(spec, device=torch.device("cuda"))  # the spec FA4 would get
    from flexfa.codegen.cute import backend

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    call = backend.make_call(spec)
    assert call.sequences is not None and call.lowering.fa4_kwargs() == fa4_mask
    out, lse = backend.run(spec, q, k, v)
    total_q, total_kv = sum(lens_q), sum(lens_kv)
    assert stand_in.seen["fwd"] == ((total_q, heads[0], head_dim), (total_kv, heads[1], head_dim),
                                    fa4_mask)  # fmt: skip
    do = torch.randn(out.shape, generator=g, dtype=f64)
    dl = torch.randn(lse.shape, generator=g, dtype=f64)
    got = torch.autograd.grad((out, lse), (q, k, v, slopes), (do, dl.float()))
    padded = fa4.backward_head_dim(head_dim, head_dim, 9) or head_dim
    group_heads = heads[0]  # the backward with a score_mod runs on K/V repeated per query head
    assert stand_in.seen["bwd"] == (
        (total_q, heads[0], padded), (total_kv, group_heads, padded), (heads[0], total_q), fa4_mask,
    )  # fmt: skip
    ref, ref_lse = per_sequence_reference(q, k, v, make(slopes), mask_mod, lens_q, lens_kv)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)  # float32 LSE
    want = torch.autograd.grad((ref, ref_lse), (q, k, v, slopes), (do, dl.float().double()))
    for name, a, b in zip(("dq", "dk", "dv", "dslopes"), got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_the_varlen_path_is_on_by_default_and_can_be_turned_off(monkeypatch) -> None:
    from flexfa.codegen.cute import backend

    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q = torch.randn(1, 2, 12, 16)
    score, mask, packed = _packed(q, q, None, fm.causal, cu, cu)
    spec = build_spec(q, q, q, score, mask, packed=packed)
    monkeypatch.delenv("FLEXFA_FA4_VARLEN", raising=False)
    assert flexfa.config.fa4_varlen
    with flexfa.config.override(fa4_varlen=False):
        lowering = backend.packed_lowering(spec)
        assert not lowering.native and "FLEXFA_FA4_VARLEN=0" in lowering.reason
    with flexfa.config.override(fa4_varlen=True):
        assert backend.packed_lowering(spec).native


def test_a_packed_call_on_the_varlen_path_builds_no_block_lists(monkeypatch, tmp_path):
    """FA4's varlen kernels read neither the concatenation's block lists nor its packed positions
    (Note [Block masks built on first read]): `flexfa.attention(backend="fa4")` builds neither,
    where a backend that runs the concatenation builds both before it runs (here with the
    block-list kernel, which writes the positions, through Triton's interpreter)."""
    from flexfa.backends.base import Support
    from flexfa.blockmask import packed as packed_builder

    stand_in = _StandIn(None, num_captures=0)
    _install(monkeypatch, stand_in)
    monkeypatch.setattr(fa4.Fa4Backend, "_supports", lambda self, spec: Support.yes())
    monkeypatch.setenv("FLEXFA_CACHE_DIR", str(tmp_path))
    lens = [7, 0, 1, 12]
    total = sum(lens)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, total, 16, generator=g, dtype=torch.float64) for _ in range(3))
    ref, _ = per_sequence_reference(q, k, v, None, fm.causal, lens, lens)
    cu = _offsets(lens)
    call = dict(block_mask=fm.causal, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    built = packed_builder.built["packed"]
    with flexfa.config.override(fused_block_mask="on"):
        out = flexfa.attention(q, k, v, backend="fa4", **call)
        assert stand_in.seen["fwd"][2] == {"causal": True}
        assert packed_builder.built["packed"] == built, "block lists built for FA4"
        pack = flexfa.varlen.packing(cu, cu, total, total, q.device, defer=True)  # the call's
        assert pack.unwritten[0], "positions written for FA4"
        torch.testing.assert_close(out, ref)
        tiled = flexfa.attention(q, k, v, backend="tiled", **call)  # the same packing
    assert packed_builder.built["packed"] == built + 1 and not pack.unwritten[0]
    torch.testing.assert_close(tiled, ref)
