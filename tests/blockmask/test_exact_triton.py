"""The exact tier's generated Triton kernel: on the CPU through Triton's interpreter (small), and
on a GPU inside create_block_mask."""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa import masks as fm
from flexfa.blockmask import exact
from flexfa.blockmask.block_mask import BlockSize
from flexfa.blockmask.build import classify
from flexfa.blockmask.grid import TileGrid, TileList
from flexfa.codegen.triton.blockmask import exact_triton
from tests.blockmask import oracle


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path):
    with flexfa.config.override(cache_dir=tmp_path):
        yield


def _masks():
    doc = torch.tensor([0] * 13 + [1] * 30 + [4] * 17, dtype=torch.int32)
    keep = torch.tensor([[True, False, True], [False, False, True]])
    heads = torch.tensor([3, 11], dtype=torch.int64)
    return {
        "document & causal": fm.and_masks(fm.causal, fm.document(doc)),
        "table": lambda b, h, q, kv: keep[q % 2, kv % 3],
        "per head": lambda b, h, q, kv: (q - kv < heads[h]) & (kv <= q),
        "float": lambda b, h, q, kv: (q.float() * 0.7 - kv.float()) > -3.5,
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU check")
@pytest.mark.parametrize("name", sorted(_masks()))
@pytest.mark.parametrize("block", [(16, 8), (24, 16)])
def test_kernel_matches_torch_tier_in_interpreter(name, block) -> None:
    fn = _masks()[name]
    traced = flexfa.trace_mask_mod(fn)
    heads = 2 if "h" in traced.variables else 1
    grid = TileGrid(1, heads, 60, 45, BlockSize.of(block), torch.device("cpu"))
    tiles = TileList.where(torch.ones(grid.shape, dtype=torch.bool))
    got = exact_triton.classify_tiles(traced, grid, tiles)
    want = exact.classify_tiles(traced, grid, tiles)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, (128, 64)])
def test_create_block_mask_on_gpu_matches_cpu(block) -> None:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(128, 2049, (64,), generator=g)
    docs = torch.repeat_interleave(torch.arange(64), lengths)[:8192].view(1, -1).repeat(2, 1)
    docs[1] = docs[1].flip(0)
    keep = torch.rand(5, 7, generator=g) < 0.5

    def undecidable(b, h, q_idx, kv_idx):  # the analysis cannot bound a two-dimensional table
        return keep_gpu[q_idx % 5, kv_idx % 7] | (q_idx - kv_idx < 300)

    keep_gpu = keep.cuda()
    for fn, B in ((fm.and_masks(fm.causal, fm.document(docs.cuda())), 2), (undecidable, None)):
        bm = flexfa.create_block_mask(fn, B, None, 8192, 8192, device="cuda", BLOCK_SIZE=block)
        traced = flexfa.trace_mask_mod(fn)
        grid = TileGrid(bm.batch, 1, 8192, 8192, BlockSize.of(block), torch.device("cuda"))
        stats = classify(traced, grid)
        assert torch.equal(bm.tile_states(), stats.states)
        cpu = classify(traced, grid, analysis=False).states
        assert torch.equal(stats.states.cpu(), cpu.cpu())


def _checkerboard(device):
    """Tiles of 64 are all-True or all-False, but the analysis bounds a two-dimensional table by
    its whole range, and witnesses find no mixed tile: every tile reaches exact evaluation."""
    keep = torch.tensor([[True, False], [False, True]], device=device)

    def checkerboard(b, h, q_idx, kv_idx):
        return keep[(q_idx // 512) % 2, (kv_idx // 512) % 2]

    return checkerboard


def test_checkerboard_reaches_the_exact_tier() -> None:
    traced = flexfa.trace_mask_mod(_checkerboard("cpu"))
    grid = TileGrid(1, 1, 1000, 700, BlockSize(64, 64), torch.device("cpu"))
    c = classify(traced, grid)
    assert c.evaluated == grid.num_tiles


@pytest.mark.gpu
def test_gpu_exact_tier_is_the_triton_kernel() -> None:
    exact_triton._modules.clear()
    bm = flexfa.create_block_mask(
        _checkerboard("cuda"), None, None, 1000, 700, device="cuda", BLOCK_SIZE=64
    )
    want = oracle.expected_states(_checkerboard("cpu"), 1, 1, 1000, 700, BlockSize(64, 64))
    assert torch.equal(bm.tile_states().cpu(), want)
    assert exact_triton._modules, "the Triton exact tier did not run"
