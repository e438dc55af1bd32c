"""The fused block-mask kernel on a GPU: the same lists as the general path at real sizes."""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa import masks as fm
from flexfa.blockmask.block_mask import BlockSize
from flexfa.blockmask.grid import TileGrid
from flexfa.codegen.triton.blockmask import fused
from flexfa.runtime.launch import wait_for_background
from tests.blockmask import oracle

pytestmark = pytest.mark.gpu

_LISTS = ("kv_partial", "kv_full", "q_partial", "q_full")


def _docs(n: int, batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(batch):
        lengths = torch.randint(128, 2049, (n // 128 + 1,), generator=g)
        rows.append(torch.repeat_interleave(torch.arange(lengths.numel()), lengths)[:n])
    return torch.stack(rows).to(device="cuda", dtype=torch.int32)


def _masks(n: int) -> dict[str, tuple[object, int | None]]:
    docs = _docs(n, 2)
    return {
        "causal": (fm.causal, None),
        "sliding_window(1024)": (fm.sliding_window(1024), None),
        "sliding_window(100)": (fm.sliding_window(100), None),
        "prefix_lm(2048)": (fm.prefix_lm(2048), None),
        "chunked(1000)": (fm.chunked(1000), None),
        "dilated_sliding_window(700, 3)": (fm.dilated_sliding_window(700, 3), None),
        "document": (fm.document(docs), 2),
        "document & causal": (fm.and_masks(fm.causal, fm.document(docs)), 2),
    }


@pytest.mark.parametrize("lengths", [(8192, 8192), (8191, 5000), (1000, 12345)])
@pytest.mark.parametrize("block", [128, (128, 64)])
def test_fused_lists_match_the_general_path(lengths, block) -> None:
    q_len, kv_len = lengths
    for name, (fn, B) in _masks(max(lengths)).items():
        traced = flexfa.trace_mask_mod(fn)
        batch = B if "b" in traced.variables else 1
        grid = TileGrid(batch, 1, q_len, kv_len, BlockSize.of(block), torch.device("cuda", 0))
        for _ in range(2):
            if fused.build(traced, grid) is not None:
                break
            # A cold kernel compiles in the background, from the second build that asks for it,
            # while the general path builds the lists (Note [Background compiles from the second
            # call]); wait for it, to compare the kernel's lists.
            wait_for_background()
        got = flexfa.create_block_mask(fn, B, 16, q_len, kv_len, device="cuda", BLOCK_SIZE=block)
        with flexfa.config.override(fused_block_mask="off"):
            want = flexfa.create_block_mask(
                fn, B, 16, q_len, kv_len, device="cuda", BLOCK_SIZE=block
            )
        for field in _LISTS:
            g, w = getattr(got, field), getattr(want, field)
            assert torch.equal(g.count, w.count), f"{name}: {field}.count differs"
            listed = torch.arange(g.index.shape[-1], device="cuda") < g.count[..., None]
            assert torch.equal(g.index[listed], w.index[listed]), f"{name}: {field}.index differs"
        oracle.check_invariants(got)
        # Every one of these masks is decided by the kernel alone.
        assert fused.build(traced, grid) is not None, f"{name} took the general path"
