"""Witnesses: prove a tile partial by finding one allowed and one excluded pair in it.

After the analytic tier, some tiles are undecided (e.g. a tile of a document mask where a document
boundary crosses it). Evaluating the mask exactly at a handful of pairs of each such tile settles
most of them: a pair where the mask is True and a pair where it is False *prove* that the tile is
partial. This is a proof, not a sample, because it is only ever used to certify "partial" with two
actual pairs; a tile where the candidates all agree is not concluded anything about, and goes to
exact evaluation.

# Note [Witness candidates]
# Per tile, 32 pairs: the 4 corners, the centre, the 4 edge midpoints, 4 interior quarter points,
# the 3 pairs where q_idx - kv_idx is -1, 0 and 1 (when the diagonal crosses the tile; else a
# corner again), 8 neighbours of corners one and two steps inside, and 8 interior points of a
# Halton sequence. Mask boundaries are usually monotone in q_idx or kv_idx (documents, chunks,
# prefixes), so a boundary crossing a tile separates two of its corners; the diagonal points
# catch causal-like boundaries that pass between corners; the neighbours give consecutive values
# of q_idx - kv_idx, which periodic masks (`% d`) need. The cost is 32 mask evaluations per
# undecided tile, vectorized over all of them.
"""

from __future__ import annotations

import torch

from flexfa.blockmask.grid import TileGrid, TileList
from flexfa.frontend.trace import TracedMod
from flexfa.ir.evaluate import Evaluator

# Mask evaluations per chunk (bounds the temporaries).
_CHUNK_PAIRS = 1 << 20
_NUM_CANDIDATES = 32
# Halton points (bases 2 and 3) in [0, 1)^2, for interior candidates.
_HALTON = (
    (0.5, 1 / 3),
    (0.25, 2 / 3),
    (0.75, 1 / 9),
    (0.125, 4 / 9),
    (0.625, 7 / 9),
    (0.375, 2 / 9),
    (0.875, 5 / 9),
    (0.0625, 8 / 9),
)


def candidate_pairs(grid: TileGrid, tiles: TileList) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_idx, kv_idx), int64 [T, 32]: in-range pairs of each tile (Note [Witness candidates])."""
    q_lo, q_hi = (t[tiles.i] for t in grid.q_bounds)
    kv_lo, kv_hi = (t[tiles.j] for t in grid.kv_bounds)
    q_mid, kv_mid = (q_lo + q_hi) // 2, (kv_lo + kv_hi) // 2
    q_1, q_3 = (3 * q_lo + q_hi) // 4, (q_lo + 3 * q_hi) // 4
    kv_1, kv_3 = (3 * kv_lo + kv_hi) // 4, (kv_lo + 3 * kv_hi) // 4
    qs = [q_lo, q_lo, q_hi, q_hi, q_mid, q_lo, q_hi, q_mid, q_mid, q_1, q_1, q_3, q_3]
    ks = [kv_lo, kv_hi, kv_lo, kv_hi, kv_mid, kv_mid, kv_mid, kv_lo, kv_hi, kv_1, kv_3, kv_1, kv_3]
    for t in (-1, 0, 1):
        q = torch.clamp(kv_lo + t, min=q_lo, max=q_hi)
        kv = q - t
        ok = (kv >= kv_lo) & (kv <= kv_hi)
        qs.append(torch.where(ok, q, q_lo))
        ks.append(torch.where(ok, kv, kv_lo))
    for step in (1, 2):
        qs += [q_lo, q_hi, torch.clamp(q_lo + step, max=q_hi), torch.clamp(q_hi - step, min=q_lo)]
        ks += [
            torch.clamp(kv_lo + step, max=kv_hi),
            torch.clamp(kv_hi - step, min=kv_lo),
            kv_lo,
            kv_hi,
        ]
    q_span, kv_span = q_hi - q_lo + 1, kv_hi - kv_lo + 1
    for fq, fkv in _HALTON:
        qs.append(q_lo + (q_span.double() * fq).long())
        ks.append(kv_lo + (kv_span.double() * fkv).long())
    return torch.stack(qs, dim=1), torch.stack(ks, dim=1)


def prove_partial(mask: TracedMod, grid: TileGrid, tiles: TileList) -> torch.Tensor:
    """bool [T]: True where witnesses prove the tile partial (False means "not shown").

    >>> import torch, flexfa
    >>> from flexfa.blockmask.block_mask import BlockSize
    >>> doc = torch.tensor([0] * 40 + [1] * 24)
    >>> grid = TileGrid(1, 1, 64, 64, BlockSize(32, 32), torch.device("cpu"))
    >>> tiles = TileList.where(torch.ones(grid.shape, dtype=torch.bool))
    >>> prove_partial(flexfa.trace_mask_mod(flexfa.masks.document(doc)), grid, tiles).tolist()
    [False, True, True, True]
    """
    out = torch.zeros(len(tiles), dtype=torch.bool, device=grid.device)
    per_chunk = max(1, _CHUNK_PAIRS // _NUM_CANDIDATES)
    start = 0
    for chunk in tiles.chunks(per_chunk):
        q, kv = candidate_pairs(grid, chunk)
        env = {
            "b": chunk.b.to(torch.int32).view(-1, 1),
            "h": chunk.h.to(torch.int32).view(-1, 1),
            "q_idx": q.to(torch.int32),
            "kv_idx": kv.to(torch.int32),
        }
        ev = Evaluator(env, mask.tensors, device=grid.device)
        allowed = ev(mask.output).expand(q.shape)
        proven = allowed.any(dim=1) & (~allowed).any(dim=1)
        if ev.out_of_bounds is not None:
            # A tile where some candidate read out of bounds goes to exact evaluation, which
            # reports it if that pair is allowed (Note [Loads out of bounds]).
            proven = proven & ~ev.out_of_bounds.expand(q.shape).any(dim=1)
        out[start : start + len(chunk)] = proven
        start += len(chunk)
    return out
