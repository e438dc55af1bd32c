"""The mask lowering's proofs: wherever a mask is sent to FA4's native causal / window path, the
native mask FA4 applies equals the mask_mod at every pair (so on every tile); elsewhere the
generated mask_mod is kept (Note [Native masks from the IR])."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexfa import masks as fm
from flexfa.blockmask.exact import evaluate_mask, index_grids
from flexfa.codegen.cute.plan import lower_mask, native_mask
from flexfa.frontend import trace_mask_mod


def dense(mask_mod, len_q: int, len_kv: int) -> torch.Tensor:
    traced = trace_mask_mod(mask_mod)
    env = index_grids(1, 1, torch.arange(len_q), torch.arange(len_kv), torch.device("cpu"))
    return torch.broadcast_to(evaluate_mask(traced, env), (1, 1, len_q, len_kv))[0, 0]


def check(mask_mod, len_q: int, len_kv: int) -> str:
    lowering = lower_mask(trace_mask_mod(mask_mod), len_q, len_kv)
    if lowering.native:
        torch.testing.assert_close(
            native_mask(lowering, len_q, len_kv), dense(mask_mod, len_q, len_kv)
        )
    return lowering.kind


def _shifted_causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx + 5  # a causal band shifted by 5: FA4's window with right = 5


def _written_differently(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx >= 0) & ~(q_idx - kv_idx > 99)  # sliding window 100, other spelling


@pytest.mark.parametrize(
    ("mask_mod", "len_q", "len_kv", "kind"),
    [
        (fm.causal, 300, 300, "causal"),
        (fm.causal, 513, 200, "window"),  # top-left causal with Lq > Lkv: a right bound
        (fm.causal, 200, 513, "mask_mod"),  # would need a negative right bound
        (fm.sliding_window(64), 300, 300, "window"),
        (fm.sliding_window(64, causal=False), 257, 257, "window"),
        (_written_differently, 400, 400, "window"),
        (_shifted_causal, 300, 300, "window"),
        (fm.sliding_window(4096), 300, 300, "causal"),  # the window covers every causal pair
        (lambda b, h, q, kv: q - kv < 10_000, 300, 300, "full"),
        (fm.noop_mask, 31, 77, "full"),
        (fm.prefix_lm(16), 300, 300, "mask_mod"),
        (fm.dilated_sliding_window(64, 2), 300, 300, "mask_mod"),  # not one run of distances
        (fm.chunked(64), 300, 300, "mask_mod"),
        (lambda b, h, q, kv: (q >= kv) & (h == 0), 100, 100, "mask_mod"),  # reads h
        (lambda b, h, q, kv: q < kv - 500, 300, 300, "mask_mod"),  # allows no pair
    ],
)
def test_lowering_and_its_proof(mask_mod, len_q, len_kv, kind):
    assert check(mask_mod, len_q, len_kv) == kind


def test_window_bounds_for_causal_sliding_window():
    lowering = lower_mask(trace_mask_mod(fm.sliding_window(1024)), 8192, 8192)
    assert lowering.fa4_kwargs() == {"window_size_left": 1023, "window_size_right": 0}


def test_a_mask_reading_a_tensor_of_the_distance_is_proven_with_its_values():
    allowed = torch.zeros(2 * 300, dtype=torch.bool)
    allowed[300:340] = True  # d = q - kv in [0, 39]

    def table_window(b, h, q_idx, kv_idx):
        return allowed[q_idx - kv_idx + 300]

    assert check(table_window, 300, 300) == "window"
    allowed[320] = False  # a hole: no longer one run
    assert check(table_window, 300, 300) == "mask_mod"


@settings(max_examples=40, deadline=None)
@given(
    lo=st.integers(-80, 80),
    width=st.integers(0, 120),
    len_q=st.integers(1, 97),
    len_kv=st.integers(1, 97),
)
def test_band_masks_lower_to_an_equal_native_mask(lo, width, len_q, len_kv):
    hi = lo + width

    def band(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx >= lo) & (q_idx - kv_idx <= hi)

    check(band, len_q, len_kv)  # asserts equality whenever it goes native


@settings(max_examples=60, deadline=None)
@given(
    runs=st.lists(st.tuples(st.integers(-300, 300), st.integers(0, 40)), min_size=0, max_size=2),
    len_q=st.integers(1, 200),
    len_kv=st.integers(1, 200),
)
def test_runs_of_the_powers_of_2_range_are_those_of_the_lengths_range(runs, len_q, len_kv):
    """Note [Allowed runs by powers of 2]: the run cut from the range of the next powers of 2
    equals the one evaluated over the lengths' own range, for masks of d = q_idx - kv_idx with
    none, one or two runs of allowed d (inside, across or outside the lengths' range)."""
    from flexfa.codegen.cute import plan

    def mask(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        ok = d != d
        for lo, width in runs:
            ok = ok | ((d >= lo) & (d <= lo + width))
        return ok

    traced = trace_mask_mod(mask)
    got, want = plan._allowed_run(traced, len_q, len_kv), plan._evaluated_run(traced, len_q, len_kv)
    if isinstance(want, tuple):
        assert got == want, (runs, len_q, len_kv)
    else:
        assert not isinstance(got, tuple) and got.reason == want.reason, (runs, got, want)


# -- document masks (Note [Document masks on FA4's varlen kernels]) ------------------------------

_IDS = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 3]])
_IDS1 = _IDS[0]


@pytest.mark.parametrize(
    ("mask_mod", "by_batch", "inner"),
    [
        (lambda b, h, q, kv: (_IDS[b, q] == _IDS[b, kv]) & (q >= kv), True, "causal"),
        (lambda b, h, q, kv: (q >= kv) & (_IDS1[kv] == _IDS1[q]) & (q - kv < 3), False, "window"),
        (fm.document(_IDS1), False, None),
        (fm.and_masks(fm.document(_IDS), fm.causal), True, "causal"),
    ],
    ids=["by-batch-causal", "reversed-window", "library-document", "library-and"],
)
def test_document_masks_are_found_with_their_inner_condition(mask_mod, by_batch, inner):
    from flexfa.codegen.cute.plan import document_mask

    traced = trace_mask_mod(mask_mod)
    doc = document_mask(traced)
    assert doc is not None and doc.by_batch == by_batch
    assert traced.tensors[doc.ids_slot].shape[-1] == 8
    if inner is None:
        assert doc.inner is None
        return
    # The inner condition is the rest of the mask: equal to it wherever the documents agree.
    q, kv = torch.arange(8)[:, None], torch.arange(8)[None]
    env = {"b": torch.tensor(0), "h": torch.tensor(0), "q_idx": q, "kv_idx": kv}
    ids = _IDS[0]
    same = ids[:, None] == ids[None]
    assert torch.equal(evaluate_mask(doc.inner, env) & same, evaluate_mask(traced, env))
    assert lower_mask(doc.inner, 8, 8).kind == inner


@pytest.mark.parametrize(
    "mask_mod",
    [
        lambda b, h, q, kv: _IDS[b, q] == _IDS[0, kv],  # another row on one side
        lambda b, h, q, kv: _IDS1[q] == _IDS[1, kv],  # two tensors
        lambda b, h, q, kv: (_IDS1[q] == _IDS1[kv]) | (q >= kv),  # not a conjunction
        lambda b, h, q, kv: (_IDS1[q] == _IDS1[kv]) & (_IDS1[q] > 0),  # a term reads the ids
        lambda b, h, q, kv: (_IDS1[q] == _IDS1[kv]) & (h > 0),  # a term reads h
        lambda b, h, q, kv: _IDS1[q] == _IDS1[q],  # not q against kv
        lambda b, h, q, kv: _IDS[h, q] == _IDS[h, kv],  # per head
        fm.causal,
    ],
)
def test_other_masks_are_not_document_masks(mask_mod):
    from flexfa.codegen.cute.plan import document_mask

    assert document_mask(trace_mask_mod(mask_mod)) is None
