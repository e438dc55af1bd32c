"""Hypothesis strategies for attention problems (shapes, dtypes, tilings)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from tests.e2e.harness import Problem
from tests.e2e.layouts import LAYOUTS, TENSORS
from tests.tiers import examples  # noqa: F401  (the tier's example counts, for the tests here)

LOW_PRECISION = (torch.float32, torch.bfloat16, torch.float16)

#: Tile sizes for explicit BlockMasks (None: the bare mask_mod, flexfa's default 128 x 128).
BLOCK_SIZES = st.sampled_from([None, 4, (8, 4), (4, 8), (16, 16), (8, 32)])
#: The tiled backend's columns per step (fewer than a tile means one tile per step).
STEP_COLUMNS = st.sampled_from([4, 8, 16, 512])


@st.composite
def problems(draw, dtypes=LOW_PRECISION, max_len: int = 40) -> Problem:
    """Odd and unequal lengths (1 included), GQA groups of 1 to 3, E != Ev, mixed dtypes."""
    heads_kv = draw(st.integers(1, 2))
    return Problem(
        batch=draw(st.integers(1, 2)),
        heads_q=heads_kv * draw(st.sampled_from([1, 2, 3])),
        heads_kv=heads_kv,
        len_q=draw(st.integers(1, max_len)),
        len_kv=draw(st.integers(1, max_len)),
        head_dim=draw(st.sampled_from([8, 16])),
        head_dim_v=draw(st.sampled_from([8, 12, 16])),
        dtype=draw(st.sampled_from(dtypes)),
    )


def layouts(names: tuple[str, ...] = TENSORS) -> st.SearchStrategy[dict[str, str]]:
    """A memory layout (tests/e2e/layouts.py) for each of q, k, v and the upstream gradients."""
    return st.fixed_dictionaries({n: st.sampled_from(LAYOUTS) for n in names})
