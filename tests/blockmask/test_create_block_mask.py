"""create_block_mask against the dense oracle: random masks, lengths, block sizes, broadcasting."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import flexfa
from flexfa.blockmask.block_mask import BlockSize
from flexfa.blockmask.build import classify
from flexfa.blockmask.grid import TileGrid
from tests.blockmask import oracle
from tests.blockmask.strategies import Case, cases, examples
from tests.mods import MASK_MODS, Shape

_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check(case: Case) -> None:
    bm = flexfa.create_block_mask(
        case.mask.fn, case.B, case.H, case.q_len, case.kv_len, BLOCK_SIZE=case.block_size
    )
    want = oracle.expected_states(
        case.mask.fn,
        case.batch,
        case.heads,
        case.q_len,
        case.kv_len,
        BlockSize.of(case.block_size),
    )
    got = oracle.states_of(bm, case.batch, case.heads)
    assert torch.equal(got, want), f"{case}\n{oracle.describe_mismatch(got, want)}"
    oracle.check_invariants(bm)
    variables = bm.mask.variables
    assert bm.batch == (case.batch if "b" in variables else 1)
    assert bm.heads == (case.heads if "h" in variables else 1)


@settings(max_examples=examples(150), **_SETTINGS)
@given(cases())
def test_matches_dense_oracle(case: Case) -> None:
    _check(case)


@settings(max_examples=examples(40), **_SETTINGS)
@given(cases(max_len=300, max_leaves=2))
def test_matches_dense_oracle_longer(case: Case) -> None:
    _check(case)


@pytest.mark.parametrize("entry", MASK_MODS, ids=str)
@pytest.mark.parametrize("block", [16, (32, 16)])
def test_catalog_masks(entry, block) -> None:
    shape = Shape(batch=2, heads=3, len_q=77, len_kv=53)
    fn = entry.build(shape).fn
    bm = flexfa.create_block_mask(fn, 2, 3, 77, 53, BLOCK_SIZE=block)
    want = oracle.expected_states(fn, 2, 3, 77, 53, BlockSize.of(block))
    got = oracle.states_of(bm, 2, 3)
    assert torch.equal(got, want), oracle.describe_mismatch(got, want)


def test_exact_tier_alone_matches() -> None:
    doc = torch.tensor([0] * 30 + [1] * 50 + [2] * 20)
    traced = flexfa.trace_mask_mod(flexfa.masks.document(doc))
    grid = TileGrid(1, 1, 100, 100, BlockSize(16, 32), torch.device("cpu"))
    tiered, exact = classify(traced, grid), classify(traced, grid, analysis=False)
    assert torch.equal(tiered.states, exact.states)
    assert exact.evaluated == grid.num_tiles and tiered.evaluated == 0


@pytest.mark.parametrize(
    ("q_len", "kv_len", "block"), [(1, 1, 128), (1, 300, 16), (300, 1, 16), (5, 7, 256)]
)
def test_degenerate_shapes(q_len, kv_len, block) -> None:
    for fn in (flexfa.masks.causal, flexfa.masks.sliding_window(3), flexfa.noop_mask):
        bm = flexfa.create_block_mask(fn, None, None, q_len, kv_len, BLOCK_SIZE=block)
        want = oracle.expected_states(fn, 1, 1, q_len, kv_len, BlockSize.of(block))
        assert torch.equal(oracle.states_of(bm, 1, 1), want)


def test_broadcast_dims_are_stored_once() -> None:
    bm = flexfa.create_block_mask(flexfa.masks.causal, 4, 16, 256, 256)
    assert (bm.batch, bm.heads) == (1, 1)
    heads = torch.tensor([10, 20, 30])
    per_head = flexfa.create_block_mask(lambda b, h, q, kv: q - kv < heads[h], 4, 3, 256, 256)
    assert (per_head.batch, per_head.heads) == (1, 3)


def test_out_of_bounds_at_allowed_pair_raises() -> None:
    short = torch.zeros(10, dtype=torch.int32)

    def reads_past_end(b, h, q_idx, kv_idx):
        return short[kv_idx] == 0

    with pytest.raises(IndexError, match="out of bounds"):
        flexfa.create_block_mask(reads_past_end, None, None, 32, 32, BLOCK_SIZE=16)


def test_out_of_bounds_at_excluded_pairs_is_fine() -> None:
    table = torch.arange(10, dtype=torch.int32)

    def guarded(b, h, q_idx, kv_idx):
        return (kv_idx < 10) & (table[kv_idx] <= q_idx)

    bm = flexfa.create_block_mask(guarded, None, None, 40, 40, BLOCK_SIZE=8)
    want = oracle.expected_states(
        lambda b, h, q, kv: (kv < 10) & (kv <= q), 1, 1, 40, 40, BlockSize(8, 8)
    )
    assert torch.equal(oracle.states_of(bm, 1, 1), want)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(B=0), ValueError, "B must be a positive int"),
        (dict(H=2.0), ValueError, "H must be a positive int"),
        (dict(Q_LEN=0), ValueError, "Q_LEN"),
        (dict(KV_LEN=True), ValueError, "KV_LEN"),
        (dict(BLOCK_SIZE=(16, 0)), ValueError, "BLOCK_SIZE kv"),
        (dict(BLOCK_SIZE="big"), ValueError, "BLOCK_SIZE must be"),
    ],
)
def test_bad_arguments(kwargs, error, match) -> None:
    args = dict(B=None, H=None, Q_LEN=64, KV_LEN=64, BLOCK_SIZE=16) | kwargs
    with pytest.raises(error, match=match):
        flexfa.create_block_mask(flexfa.masks.causal, **args)


def test_mask_reading_b_needs_B() -> None:
    docs = torch.zeros(2, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="depends on 'b'"):
        flexfa.create_block_mask(flexfa.masks.document(docs), None, None, 64, 64)


def test_non_mask_return_is_a_trace_error() -> None:
    with pytest.raises(flexfa.ModTraceError, match="must return a bool"):
        flexfa.create_block_mask(lambda b, h, q, kv: q - kv, None, None, 64, 64)
