"""Document masks on FA4's varlen kernels, without a GPU (Note [Document masks on FA4's varlen
kernels] in flexfa/codegen/cute/plan.py): which calls take the path and why not, and the whole
path - one varlen call per batch row, layouts, LSE, autograd, GQA, a captured tensor's gradient
summed over the rows - with FA4's varlen entry points replaced by the float64 stand-in of
tests/codegen/cute/test_varlen.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flexfa
from flexfa import masks as fm
from flexfa.api import build_spec
from flexfa.backends import fa4
from flexfa.reference import reference_attention
from tests.codegen.cute.test_varlen import _install, _StandIn


@pytest.fixture(autouse=True)
def _gpu_like(monkeypatch):
    """An sm90 GPU as the path's checks see it, FA4 installed, its varlen path on."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(fa4, "missing_package", lambda: None)
    with flexfa.config.override(fa4_varlen=True, fa4_documents=True):
        yield


def _ids(*rows) -> torch.Tensor:
    """Document ids per row from the documents' lengths."""
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]
    )


def _spec(q, k, v, score_mod, mask_mod, **kw):
    spec = build_spec(q, k, v, score_mod, mask_mod, enable_gqa=q.shape[1] != k.shape[1], **kw)
    return dataclasses.replace(spec, device=torch.device("cuda"))  # the spec FA4 would get


def _lowering(mask_mod, B=2, L=24, score_mod=None, **kw):
    from flexfa.codegen.cute import backend

    q = torch.randn(B, 2, L, 64, dtype=torch.bfloat16, requires_grad=True)
    return backend.document_lowering(_spec(q, q, q, score_mod, mask_mod, **kw))


def test_document_masks_take_the_varlen_path_where_proven():
    ids = _ids([5, 11, 8], [24])
    by_batch = lambda b, h, q, kv: (ids[b, q] == ids[b, kv]) & (q >= kv)
    lowering, rows = _lowering(by_batch)
    assert lowering.kind == "causal" and "document mask on FA4's varlen kernels" in lowering.reason
    assert [r.cu_seqlens_q.tolist() for r in rows] == [[0, 5, 16, 24], [0, 24]]
    assert [r.max_seqlen_q for r in rows] == [11, 24]
    window = fm.and_masks(fm.document(ids[0]), fm.sliding_window(4))
    lowering, rows = _lowering(window)
    assert lowering.fa4_kwargs() == {"window_size_left": 3, "window_size_right": 0}
    assert len(rows) == 2 and rows[0] is rows[1]  # 1-D ids: every row has the same documents
    softcap = flexfa.mods.softcap(20.0)  # reads the score alone
    lowering, rows = _lowering(fm.document(ids[0]), score_mod=softcap)
    assert lowering.kind == "full" and rows is not None  # no condition inside the documents
    assert _lowering(fm.causal) is None


def test_document_masks_stay_off_the_varlen_path_with_a_reason():
    ids = _ids([5, 11, 8], [24])
    causal_docs = lambda b, h, q, kv: (ids[b, q] == ids[b, kv]) & (q >= kv)
    decreasing = torch.tensor([[0, 0, 1, 1, 0, 0] * 4] * 2)
    cases = {
        "an id in two runs": (
            lambda b, h, q, kv: decreasing[b, q] == decreasing[b, kv], {}, "decrease"
        ),
        "a score_mod of positions": (
            causal_docs, {"score_mod": flexfa.mods.alibi}, "score_mod reads"
        ),
        "not native inside": (
            fm.and_masks(fm.document(ids[0]), fm.prefix_lm(3)), {}, "inside the documents"
        ),
        "a deterministic backward": (causal_docs, {"deterministic": True}, "deterministic"),
        "ids of another batch": (causal_docs, {"B": 1}, "batch of 1"),
        "the block-sparse option": (
            causal_docs, {"kernel_options": {"block_sparse": True}}, "block_sparse"
        ),
    }  # fmt: skip
    for why, (mask_mod, kw, reason) in cases.items():
        lowering, rows = _lowering(mask_mod, **kw)
        assert rows is None and not lowering.native, why
        assert reason in lowering.reason, (why, lowering.reason)
    with flexfa.config.override(fa4_varlen=False):
        assert "FLEXFA_FA4_VARLEN=0" in _lowering(causal_docs)[0].reason
    with flexfa.config.override(fa4_documents=False):  # the default
        assert "FLEXFA_FA4_DOCUMENTS" in _lowering(causal_docs)[0].reason


def test_explain_says_which_path():
    ids = _ids([5, 11, 8], [24])
    q = torch.randn(2, 2, 24, 64, dtype=torch.bfloat16)
    spec = _spec(q, q, q, None, lambda b, h, q, kv: (ids[b, q] == ids[b, kv]) & (q >= kv))
    answer = fa4.Fa4Backend().supports(spec)
    assert answer.ok and "a document mask on FA4's varlen kernels" in answer.reason


@pytest.mark.parametrize(
    ("by_batch", "layout"),
    [(True, "bhld"), (False, "bhld"), (True, "blhd")],
    ids=["ids-per-row", "ids-shared", "ids-per-row-permuted-expanded-dlse"],
)
def test_document_path_end_to_end_with_a_stand_in(monkeypatch, by_batch, layout):
    """`backend.run` with a document mask: one varlen call per batch row on (L, H, D) views, the
    row's document offsets and FA4's causal mask; output, LSE, dq, dk, dv and the gradient of a
    per-head temperature (summed over the rows) equal flexfa's float64 reference of the mask
    itself. "blhd": q, k, v are (B, L, H, D) tensors seen permuted, and the LSE's upstream
    gradient is the stride-0 one of `lse.sum()`."""
    f64 = torch.float64
    B, (Hq, Hkv), L, D = 2, (4, 2), 24, 64
    temp = torch.tensor([0.5, -0.25, 0.125, 1.0], dtype=f64, requires_grad=True)

    def make(temp):
        def per_head(score, b, h, q_idx, kv_idx):
            return score * temp[h]

        return per_head

    calls = []
    stand_in = _StandIn(make, num_captures=1)
    forward = stand_in.forward
    stand_in.forward = lambda *a, **kw: (
        calls.append(kw["cu_seqlens_q"].tolist()) or forward(*a, **kw)
    )
    _install(monkeypatch, stand_in)
    ids = _ids([5, 11, 8], [1, 20, 3]) if by_batch else _ids([5, 11, 8])[0]
    if by_batch:
        mask_mod = lambda b, h, q, kv: (ids[b, q] == ids[b, kv]) & (q >= kv)
    else:
        mask_mod = lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv)
    g = torch.Generator().manual_seed(0)

    def randn(b, h, n, d):
        if layout == "blhd":
            return torch.randn(b, n, h, d, generator=g, dtype=f64).requires_grad_().transpose(1, 2)
        return torch.randn(b, h, n, d, generator=g, dtype=f64).requires_grad_()

    q, k, v = randn(B, Hq, L, D), randn(B, Hkv, L, D), randn(B, Hkv, L, D)
    spec = _spec(q, k, v, make(temp), mask_mod)
    from flexfa.codegen.cute import backend

    call = backend.make_call(spec)
    assert call.rows is not None and call.lowering.fa4_kwargs() == {"causal": True}
    out, lse = backend.run(spec, q, k, v)
    want_cu = [[0, 5, 16, 24], [0, 1, 21, 24]] if by_batch else [[0, 5, 16, 24]] * 2
    assert calls == want_cu
    do = torch.randn(out.shape, generator=g, dtype=f64)
    dl = torch.randn(lse.shape, generator=g).float()
    if layout == "blhd":  # what autograd hands the backward for lse.sum()
        dl = torch.ones(()).expand(lse.shape)
        assert dl.stride() == (0, 0, 0)
    got = torch.autograd.grad((out, lse), (q, k, v, temp), (do, dl))
    ref, ref_lse = reference_attention(q, k, v, make(temp), mask_mod, enable_gqa=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)  # float32 LSE
    want = torch.autograd.grad((ref, ref_lse), (q, k, v, temp), (do, dl.double()))
    for name, a, b in zip(("dq", "dk", "dv", "dtemp"), got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_the_document_path_is_opt_in(monkeypatch):
    """Off unless FLEXFA_FA4_DOCUMENTS is set: not measured faster than the mask_mod path
    (docs/cute.md)."""
    monkeypatch.delenv("FLEXFA_FA4_DOCUMENTS", raising=False)
    assert not type(flexfa.config)().fa4_documents
    monkeypatch.setenv("FLEXFA_FA4_DOCUMENTS", "1")
    assert type(flexfa.config)().fa4_documents
