"""The analytic tier: what it decides without evaluating the mask per pair, and that it is sound
on any rectangle (the refinement step analyzes sub-rectangles of tiles)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexfa
from flexfa import masks as fm
from flexfa.blockmask.analysis import Analyzer, Sig, analyze
from flexfa.blockmask.block_mask import BlockSize
from flexfa.blockmask.build import classify
from flexfa.blockmask.grid import TileGrid, TileList, TileSet
from flexfa.blockmask.witness import prove_partial
from tests.blockmask import oracle
from tests.blockmask.strategies import cases, examples

_CPU = torch.device("cpu")
_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])

N = 2048
LIBRARY = {
    "causal": fm.causal,
    "sliding_window(300)": fm.sliding_window(300),
    "sliding_window(200, causal=False)": fm.sliding_window(200, causal=False),
    "prefix_lm(700)": fm.prefix_lm(700),
    "chunked(500)": fm.chunked(500),
    "dilated_sliding_window(400, 3)": fm.dilated_sliding_window(400, 3),
    "noop": fm.noop_mask,
}


def _classify(fn, q_len=N, kv_len=N - 77, block=(128, 128), batch=1):
    grid = TileGrid(batch, 1, q_len, kv_len, BlockSize.of(block), _CPU)
    return classify(flexfa.trace_mask_mod(fn), grid)


@pytest.mark.parametrize("name", sorted(LIBRARY))
@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_library_masks_are_decided_by_analysis_alone(name, block) -> None:
    c = _classify(LIBRARY[name], block=block)
    if name.startswith("prefix_lm"):
        # The tile holding both the prefix end and the diagonal needs a witness.
        assert c.witnessed + c.refined <= 2 and c.evaluated == 0
    else:
        assert c.analytic == c.tiles, (c.analytic, c.witnessed, c.refined, c.evaluated)


def test_document_masks_are_decided_by_analysis_alone() -> None:
    lengths = torch.tensor([130, 300, 1, 700, 45, 1000, 10, 200, 1])
    ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[:N].view(1, -1)
    ids = torch.cat([ids, ids.flip(1).max() - ids.flip(1)])  # a second batch element
    c = _classify(fm.document(ids), q_len=N, kv_len=N, batch=2)
    assert c.analytic == c.tiles


COMBINATIONS = [
    (a, b, how)
    for (a, b) in itertools.combinations(sorted(k for k in LIBRARY if k != "noop"), 2)
    for how in ("and", "or")
]


@pytest.mark.parametrize(("a", "b", "how"), COMBINATIONS, ids=lambda x: str(x))
def test_library_combinations_need_no_exact_evaluation(a, b, how) -> None:
    combinator = fm.and_masks if how == "and" else fm.or_masks
    c = _classify(combinator(LIBRARY[a], LIBRARY[b]))
    assert c.evaluated == 0, (c.analytic, c.witnessed, c.refined, c.evaluated)


def test_signatures() -> None:
    def sig(fn):
        traced = flexfa.trace_mask_mod(fn)
        a = Analyzer(traced, TileGrid(2, 2, 64, 64, BlockSize(16, 16), _CPU))
        return a.static.sig[id(traced.output)]

    docs = torch.zeros(64, dtype=torch.int32)
    assert sig(fm.causal) is Sig.D
    assert sig(lambda b, h, q, kv: (q + 3) - (kv * 1) >= 2 - kv + kv) is Sig.D
    assert sig(fm.dilated_sliding_window(9, 3)) is Sig.D
    assert sig(lambda b, h, q, kv: kv < 5) is Sig.K
    assert sig(lambda b, h, q, kv: docs[q] > h) is Sig.Q
    assert sig(lambda b, h, q, kv: (q + kv) - kv < 5) is Sig.Q
    assert sig(lambda b, h, q, kv: h > b) is Sig.NONE
    assert sig(fm.document(docs)) is Sig.TWO
    assert sig(fm.chunked(4)) is Sig.TWO


def test_int32_wraparound_is_not_trusted() -> None:
    # q * 100000 wraps in int32 for q > 21474: the comparison is not q > kv there.
    def wraps(b, h, q_idx, kv_idx):
        return q_idx * 100000 > kv_idx * 100000

    q_len, kv_len = 30000, 40
    bm = flexfa.create_block_mask(wraps, None, None, q_len, kv_len, BLOCK_SIZE=(1024, 16))
    want = oracle.expected_states(wraps, 1, 1, q_len, kv_len, BlockSize(1024, 16))
    assert torch.equal(oracle.states_of(bm, 1, 1), want), oracle.describe_mismatch(
        oracle.states_of(bm, 1, 1), want
    )


@st.composite
def rectangles(draw, q_len: int, kv_len: int, batch: int, heads: int, n: int = 12) -> TileSet:
    def one(length):
        lo = draw(st.integers(0, length - 1))
        return lo, draw(st.integers(lo, min(length - 1, lo + draw(st.sampled_from([0, 1, 7, 40])))))

    rows = [
        (
            draw(st.integers(0, batch - 1)),
            draw(st.integers(0, heads - 1)),
            *one(q_len),
            *one(kv_len),
        )
        for _ in range(n)
    ]
    cols = [torch.tensor(c) for c in zip(*rows)]
    return TileSet(*cols, shape=(n,))


@settings(max_examples=examples(60), **_SETTINGS)
@given(st.data(), cases(max_len=120))
def test_analysis_is_sound_on_any_rectangle(data, case) -> None:
    traced = flexfa.trace_mask_mod(case.mask.fn)
    batch = case.batch if "b" in traced.variables else 1
    heads = case.heads if "h" in traced.variables else 1
    grid = TileGrid(batch, heads, case.q_len, case.kv_len, BlockSize.of(case.block_size), _CPU)
    ts = data.draw(rectangles(case.q_len, case.kv_len, batch, heads))
    a = Analyzer(traced, grid).run(ts)
    dense = oracle.dense_allowed(case.mask.fn, batch, heads, case.q_len, case.kv_len)
    for r in range(ts.shape[0]):
        block = dense[ts.b[r], ts.h[r], ts.q_lo[r] : ts.q_hi[r] + 1, ts.kv_lo[r] : ts.kv_hi[r] + 1]
        rect = (
            int(ts.b[r]),
            int(ts.h[r]),
            int(ts.q_lo[r]),
            int(ts.q_hi[r]),
            int(ts.kv_lo[r]),
            int(ts.kv_hi[r]),
        )
        if a.full[r]:
            assert bool(block.all()), f"{case.mask}: {rect} claimed full"
        if a.empty[r]:
            assert not bool(block.any()), f"{case.mask}: {rect} claimed empty"
        if a.partial[r]:
            assert bool(block.any()) and not bool(block.all()), (
                f"{case.mask}: {rect} claimed partial"
            )


@settings(max_examples=examples(40), **_SETTINGS)
@given(cases(max_len=120))
def test_witnesses_only_prove_partial_tiles(case) -> None:
    traced = flexfa.trace_mask_mod(case.mask.fn)
    batch = case.batch if "b" in traced.variables else 1
    heads = case.heads if "h" in traced.variables else 1
    bs = BlockSize.of(case.block_size)
    grid = TileGrid(batch, heads, case.q_len, case.kv_len, bs, _CPU)
    tiles = TileList.where(torch.ones(grid.shape, dtype=torch.bool))
    proven = prove_partial(traced, grid, tiles).view(grid.shape)
    want = oracle.expected_states(case.mask.fn, batch, heads, case.q_len, case.kv_len, bs)
    assert bool((want[proven] == 1).all()), case.mask


def test_analyze_on_the_grid_matches_tile_set_of_grid() -> None:
    traced = flexfa.trace_mask_mod(fm.and_masks(fm.causal, fm.chunked(40)))
    grid = TileGrid(1, 1, 300, 200, BlockSize(32, 16), _CPU)
    a = analyze(traced, grid)
    b = Analyzer(traced, grid).run(TileSet.of_grid(grid))
    for x, y in ((a.full, b.full), (a.empty, b.empty), (a.partial, b.partial)):
        assert torch.equal(x, y)
