"""Mods whose IR folds to a constant or reads only the indices, on every backend and in the
block-mask kernels (Note [Constant and index-only results] in flexfa/codegen/triton/emit.py).

Each of these once crashed the Triton backend's code generation (a Python literal returned where
a typed tile was needed) while the tiled backend was right. The Triton cases run compiled where a
GPU is present, else through the interpreter.
"""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa.blockmask import exact
from flexfa.blockmask.block_mask import BlockSize
from flexfa.blockmask.grid import TileGrid, TileList
from tests.blockmask import oracle
from tests.e2e.harness import INTERPRETER_TILES as TRITON_TILES
from tests.e2e.harness import Problem, check_attention
from tests.mods import BuiltMod
from tests.tiers import sweep

_TAB = torch.tensor([[0.5, -1.0, 0.25], [2.0, 0.0, -0.75]])


#: Where each backend runs: Triton compiled on a GPU, else through its interpreter.
_DEVICE = {"tiled": "cpu", "triton": "cuda" if torch.cuda.is_available() else "cpu"}


def _options(backend: str) -> dict | None:
    return TRITON_TILES if backend == "triton" and _DEVICE[backend] == "cpu" else None


def _plain(fn):
    return lambda device: lambda dtype: BuiltMod(fn)


def _with_tab(make):
    """A score_mod reading a learnable table (on `device`, in the run's parameter dtype)."""

    def on(device: str):
        def build(dtype: torch.dtype) -> BuiltMod:
            tab = _TAB.to(device=device, dtype=dtype).requires_grad_(True)
            return BuiltMod(make(tab), (tab,))

        return build

    return on


SCORE_MODS = {
    # The cases of the original report: constants, and a mod the simplifier folds to one.
    "zeros_like": _plain(lambda s, b, h, q, kv: torch.zeros_like(s)),
    "full_like": _plain(lambda s, b, h, q, kv: torch.full_like(s, 2.0)),
    "sigmoid(full_like)": _plain(lambda s, b, h, q, kv: torch.sigmoid(torch.full_like(s, 0.5))),
    "where(q != q, score, -inf)": _plain(
        lambda s, b, h, q, kv: torch.where(q != q, s, float("-inf"))
    ),
    # Folds to a constant through `x * 0`, and constants in other spellings.
    "score * 0 + 1": _plain(lambda s, b, h, q, kv: s * 0.0 + 1.0),
    "new_full": _plain(lambda s, b, h, q, kv: s.new_full((), -0.5)),
    "float64 constant": _plain(lambda s, b, h, q, kv: torch.zeros_like(s).double() + 0.25),
    # Index-only: a scalar (h), a row (q_idx), a column (kv_idx), and a captured table.
    "per head": _plain(lambda s, b, h, q, kv: h.float() * 0.5),
    "per row": _plain(lambda s, b, h, q, kv: (q % 3).float()),
    "per column": _plain(lambda s, b, h, q, kv: torch.where(kv > 4, 1.0, -1.0) + s * 0.0),
    "table, no score": _with_tab(lambda tab: lambda s, b, h, q, kv: tab[h % 2, kv % 3]),
    # Constant derivatives: d/d score is 2, the load's factor 1; a constant-index load.
    "2 score + table": _with_tab(lambda tab: lambda s, b, h, q, kv: 2.0 * s + tab[h % 2, q % 3]),
    "score + constant load": _with_tab(lambda tab: lambda s, b, h, q, kv: s + tab[1, 2]),
    "d score folds to 0": _with_tab(lambda tab: lambda s, b, h, q, kv: s * 0.0 + tab[0, kv % 3]),
}

MASK_MODS = {
    "q == q (True)": lambda b, h, q, kv: q == q,
    "folds to causal": lambda b, h, q, kv: (q != q) | (kv <= q),
    "per head": lambda b, h, q, kv: (h == 0) | (kv == kv),
    "per row": lambda b, h, q, kv: q % 3 != 1,
    "kv != kv (False)": lambda b, h, q, kv: kv != kv,
    # A tile of truths or'ed with a per-head one (Note [Scalar truths in the interpreter]).
    "tile | per head": lambda b, h, q, kv: (
        (q % 7 - 3 >= torch.clamp(kv, -1, 5)) | ((h == 11) & (h > 2))
    ),
}

PROBLEM = Problem(batch=1, heads_q=2, heads_kv=1, len_q=19, len_kv=23, head_dim=16, head_dim_v=24)


@pytest.mark.parametrize(
    "name, backend",
    [(name, "tiled") for name in sorted(SCORE_MODS)]
    + sweep([(name, "triton") for name in sorted(SCORE_MODS)], keep=3),
)
def test_constant_and_index_only_score_mods(name, backend):
    check_attention(
        PROBLEM,
        score_mod=SCORE_MODS[name](_DEVICE[backend]),
        backend=backend,
        kernel_options=_options(backend),
        context=f"{name} on {backend}",
        device=_DEVICE[backend],
    )


@pytest.mark.parametrize("backend", ["tiled", "triton"])
@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_constant_and_index_only_mask_mods(name, backend):
    check_attention(
        PROBLEM,
        score_mod=SCORE_MODS["per row"](_DEVICE[backend]),
        mask_mod=MASK_MODS[name],
        block_size=16,
        backend=backend,
        kernel_options=_options(backend),
        context=f"{name} on {backend}",
        device=_DEVICE[backend],
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU check")
@pytest.mark.parametrize("name", sweep(sorted(MASK_MODS), keep=2))
def test_block_mask_kernels_on_folded_masks(name, tmp_path):
    """The exact tier's kernel and the fused block-list kernel, against the CPU tier and the
    dense oracle."""
    from flexfa.codegen.triton.blockmask import exact_triton

    fn = MASK_MODS[name]
    traced = flexfa.trace_mask_mod(fn)
    with flexfa.config.override(cache_dir=tmp_path):
        grid = TileGrid(1, 2, 40, 29, BlockSize.of((16, 8)), torch.device("cpu"))
        tiles = TileList.where(torch.ones(grid.shape, dtype=torch.bool))
        got = exact_triton.classify_tiles(traced, grid, tiles)
        assert torch.equal(got, exact.classify_tiles(traced, grid, tiles))
        with flexfa.config.override(fused_block_mask="on"):
            bm = flexfa.create_block_mask(fn, 1, 2, 40, 29, BLOCK_SIZE=(16, 8))
    block = BlockSize.of((16, 8))
    want = oracle.expected_states(fn, 1, 2, 40, 29, block)
    assert torch.equal(oracle.states_of(bm, 1, 2), want)
