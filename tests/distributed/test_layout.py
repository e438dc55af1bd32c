"""Balancers, the ring's schedule (which blocks are skipped) and the cost model, without spawning."""

from __future__ import annotations

import doctest
import re

import pytest
import torch

import flexfa
from flexfa.distributed import Document, context_parallel_attention, cost, layout, resolve_layout
from flexfa.distributed.blocks import Options
from flexfa.distributed.comm import Group
from flexfa.distributed.ring import RingPlan


def _covers_once(lay):
    seen = torch.cat([lay.global_index(r) for r in range(lay.world_size)])
    return torch.equal(seen.sort().values, torch.arange(lay.length))


def test_none_and_head_tail_pieces():
    assert resolve_layout("none", 12, 3).pieces == (((0, 4),), ((4, 4),), ((8, 4),))
    lay = resolve_layout("head_tail", 12, 3)
    assert lay.pieces == (((0, 2), (10, 2)), ((2, 2), (8, 2)), ((4, 2), (6, 2)))
    assert lay.chunks(1) == ((0, 2, 2), (2, 8, 2))
    assert _covers_once(lay)


@pytest.mark.parametrize(
    ("balance", "length", "world", "needs"),
    [("none", 10, 3, "a multiple of 3"), ("head_tail", 12, 4, "2 * 4 = 8")],
)
def test_uneven_lengths_name_length_and_world_size(balance, length, world, needs):
    with pytest.raises(
        ValueError, match=rf"length {length} .*world size {world}.*{re.escape(needs)}"
    ):
        resolve_layout(balance, length, world)


def test_document_balance_evens_out_causal_work():
    lengths = [40, 7, 90, 3, 60]
    lay = Document(lengths).layout(200, 4)
    assert _covers_once(lay)
    within = torch.cat([torch.arange(1, n + 1) for n in lengths]).double()
    work = [float(within[lay.global_index(r)].sum()) for r in range(4)]
    assert max(work) - min(work) <= 2 * float(within.max())  # a cut moves at most one row's work
    contiguous = resolve_layout("none", 200, 4)
    work_none = [float(within[contiguous.global_index(r)].sum()) for r in range(4)]
    assert max(work) - min(work) < max(work_none) - min(work_none)


def test_document_balance_errors():
    with pytest.raises(ValueError, match="total length 10, but the sequence has length 12"):
        Document([4, 6]).layout(12, 2)
    with pytest.raises(ValueError, match="needs the documents' lengths"):
        resolve_layout("document", 12, 2)
    with pytest.raises(ValueError, match="positive ints"):
        Document([3, 0])
    with pytest.raises(ValueError, match="length 3 cannot be split across world size 4"):
        Document([3]).layout(3, 4)
    with pytest.raises(ValueError, match="balance must be"):
        resolve_layout("round_robin", 12, 2)


def test_layout_doctest():
    result = doctest.testmod(layout, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _plan(balance: str, rank: int, world: int, length: int, mask=_causal) -> RingPlan:
    g = Group(None, rank, world, tuple(range(world)))
    opts = Options(None, mask, None, False, "tiled", None, False)
    lay = resolve_layout(balance, length, world)
    return RingPlan(g, lay, opts, 1, 2, 2, 16, 16, torch.device("cpu"))


def test_ring_skips_blocks_with_only_empty_tiles():
    # Contiguous shards under a causal mask: rank r attends to ranks 0..r only.
    for r in range(4):
        steps = {s for s, _, _ in _plan("none", r, 4, 32).computed_blocks()}
        assert steps == set(range(r + 1))
    # head_tail, W = 2 (chunks [0,2) [6,8) | [2,4) [4,6)): 5 of 8 blocks on both ranks.
    assert _plan("head_tail", 0, 2, 8).computed_blocks() == [
        (0, 0, 0),
        (0, 1, 0),
        (0, 1, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]
    assert len(_plan("head_tail", 1, 2, 8).computed_blocks()) == 5


def test_head_tail_evens_out_causal_tiles():
    def tiles(balance, r):
        p = _plan(balance, r, 4, 2048)
        return sum(
            int(bm.kv_full.count.sum()) * 2 + int(bm.kv_partial.count.sum())
            for todo in p.steps
            for _, _, bm in todo
        )

    head_tail = [tiles("head_tail", r) for r in range(4)]
    none = [tiles("none", r) for r in range(4)]
    assert max(head_tail) == min(head_tail)
    assert max(none) > 3 * min(none)


def test_auto_cost_model_estimates():
    p = _plan("head_tail", 1, 4, 2048)
    q = torch.empty(1, 2, 512, 16)
    ring, allgather, gathered = cost.estimate(p, q, 2, 16, 16)
    assert ring > 0 and allgather > 0
    assert gathered == 4 * (1 * 2 * 512 * (16 + 16) * 4)  # all W shards of K and V, float32
    # A causal rank with contiguous shards: rank 0 computes one step of four, so the ring hides
    # nothing behind its idle steps and its estimate is the transfers.
    idle = _plan("none", 0, 4, 2048)
    r0, _, _ = cost.estimate(idle, q, 2, 16, 16)
    assert r0 >= 2 * cost.MACHINES["cpu"].latency


def test_needs_an_initialized_process_group():
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_attention(q, q, q, mask_mod=flexfa.masks.causal)
