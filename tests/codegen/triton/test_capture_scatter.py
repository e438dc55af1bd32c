"""Accumulation of captured-tensor gradients in the Triton backward (Note [Scatter-add of captured
gradients] in flexfa/codegen/triton/scatter.py): which strategy each index expression gets, and each
strategy (and each run-time branch of the per-tile one) against the float64 reference, with float
atomics and with `deterministic=True`. CPU runs use Triton's interpreter at tiny sizes."""

from __future__ import annotations

import re

import pytest
import torch

import flexfa
from flexfa.codegen.triton.emit import emit_score_mod_grad
from flexfa.codegen.triton.scatter import ScatterStrategy, scatter_strategy
from flexfa.frontend.trace import trace_score_mod
from tests.e2e.harness import INTERPRETER_TILES, Problem, check_attention
from tests.mods import BuiltMod

_TABLE = torch.zeros(4, 8, 8)


def _index_mods():
    """(name, score_mod reading _TABLE, expected strategy)."""
    t = _TABLE

    def tile(score, b, h, q_idx, kv_idx):
        return score + t[b, h, 0]

    def row(score, b, h, q_idx, kv_idx):
        return score + t[h, q_idx % 8, 1]

    def column(score, b, h, q_idx, kv_idx):
        return score * t[h, 0, kv_idx // 8]

    def clamped_distance(score, b, h, q_idx, kv_idx):
        return score + t[h, 0, torch.clamp(q_idx - kv_idx, -3, 4) + 3]

    def log_buckets(score, b, h, q_idx, kv_idx):
        d = kv_idx - q_idx
        n = torch.abs(d).float()
        bucket = torch.clamp((torch.log(n + 1.0) * 2).to(torch.int32), max=3)
        return score + t[h, torch.where(d > 0, 4, 0) + bucket, 0]

    def t5_buckets(score, b, h, q_idx, kv_idx):  # the sign by comparing positions, as T5's code
        n = torch.abs(q_idx - kv_idx)
        return score + t[h, torch.where(kv_idx > q_idx, 4, 0) + torch.clamp(n, max=3), 0]

    def scaled_comparison(score, b, h, q_idx, kv_idx):  # not a function of the distance
        return score + t[h, torch.where(kv_idx * 2 > q_idx, 1, 0), 0]

    def two_d_blocks(score, b, h, q_idx, kv_idx):
        return score + t[h, q_idx // 64, kv_idx // 64]

    def rows_by_key_blocks(score, b, h, q_idx, kv_idx):
        return score + t[h, q_idx % 8, kv_idx // 16]

    def shifted_blocks(score, b, h, q_idx, kv_idx):
        return score + t[h, q_idx >> 5, kv_idx >> 4]

    def unaligned_blocks(score, b, h, q_idx, kv_idx):  # (q_idx + 1) // 64: not aligned blocks
        return score + t[h, (q_idx + 1) // 64, (kv_idx + 1) // 64]

    def blocks_of_three(score, b, h, q_idx, kv_idx):  # not a power of two
        return score + t[h, q_idx // 3, kv_idx // 3]

    def distance_plus_position(score, b, h, q_idx, kv_idx):
        return score + t[h, 0, (q_idx - kv_idx + q_idx % 2) % 8]

    def from_score(score, b, h, q_idx, kv_idx):
        return score + t[h, 0, (score > 0).to(torch.int32)]

    return [
        ("tile", tile, ScatterStrategy.TILE),
        ("from_score", from_score, ScatterStrategy.GENERAL),
        ("row", row, ScatterStrategy.ROW),
        ("column", column, ScatterStrategy.COLUMN),
        ("clamped_distance", clamped_distance, ScatterStrategy.DIAGONAL),
        ("log_buckets", log_buckets, ScatterStrategy.DIAGONAL),
        ("t5_buckets", t5_buckets, ScatterStrategy.DIAGONAL),
        ("scaled_comparison", scaled_comparison, ScatterStrategy.GENERAL),
        ("two_d_blocks", two_d_blocks, ScatterStrategy.BLOCKED),
        ("rows_by_key_blocks", rows_by_key_blocks, ScatterStrategy.BLOCKED),
        ("shifted_blocks", shifted_blocks, ScatterStrategy.BLOCKED),
        ("unaligned_blocks", unaligned_blocks, ScatterStrategy.GENERAL),
        ("blocks_of_three", blocks_of_three, ScatterStrategy.GENERAL),
        ("distance_plus_position", distance_plus_position, ScatterStrategy.GENERAL),
    ]


@pytest.mark.parametrize("name, fn, expected", _index_mods(), ids=[m[0] for m in _index_mods()])
def test_strategy_is_chosen_from_the_index_expression(name, fn, expected):
    traced = trace_score_mod(fn)
    grad = traced.gradient(frozenset({0}))
    (load,) = {id(g.load): g.load for g in grad.loads}.values()
    assert scatter_strategy(load) is expected
    source = emit_score_mod_grad(traced, grad, "f", frozenset({0})).source
    assert ("flexfa_diagonal_sums" in source) == (expected is ScatterStrategy.DIAGONAL), source
    assert ("flexfa_scatter_tile" in source) == (expected is ScatterStrategy.GENERAL), source
    assert ("flexfa_block_sums" in source) == (expected is ScatterStrategy.BLOCKED), source
    if expected is ScatterStrategy.DIAGONAL:
        # The index is evaluated once per diagonal, at q_idx = d and kv_idx = 0.
        assert re.search(r"u0_0 = .*\bd0\b.*\b0\b|u0_0 = .*\b0\b.*\bd0\b", source), source


def _distance_mods():
    """(name, index of (h, q, kv), proved monotone in q - kv) for DIAGONAL indices."""
    return [
        ("clamped", lambda h, q, kv: (h, torch.clamp(q - kv, -128, 128) + 128), True),
        ("falling_buckets", lambda h, q, kv: (h, torch.clamp((kv - q) // 4, -3, 3) + 3), True),
        ("scaled", lambda h, q, kv: (h, torch.clamp(-2 * (q - kv) + 7, 0, 31)), True),
        ("step", lambda h, q, kv: (h, (kv > q).to(torch.int32) * 2 + 1), True),
        ("float_floor", lambda h, q, kv: (h, torch.floor((q - kv) * 0.25).to(torch.int32)), True),
        ("absolute", lambda h, q, kv: (h, torch.clamp(torch.abs(q - kv), max=7)), False),
        (
            "signed_buckets",
            lambda h, q, kv: (h, torch.where(kv > q, 5, 0) + torch.clamp((q - kv).abs(), max=4)),
            False,
        ),
        ("equal", lambda h, q, kv: (h, (q == kv).to(torch.int32)), False),
        ("nonzero", lambda h, q, kv: (h, (q - kv).to(torch.bool).to(torch.int32)), False),
        (
            "logarithmic",
            lambda h, q, kv: (h, torch.log((q - kv).float() + 1).to(torch.int32)),
            False,
        ),
        (
            "mixed",
            lambda h, q, kv: (h, torch.clamp(q - kv, 0, 7) + torch.clamp(kv - q, 0, 7)),
            False,
        ),
    ]


@pytest.mark.parametrize(
    "name, index, monotone", _distance_mods(), ids=[m[0] for m in _distance_mods()]
)
def test_far_tiles_are_decided_at_their_corners_when_monotone(name, index, monotone):
    """Note [Far tiles decided at their corners]: proved monotone (either way) -> two scalar
    evaluations decide the tile; otherwise (transcendental, |d|, ==, rising and falling parts) the
    vector of the diagonals does."""
    from flexfa.codegen.triton.scatter import monotone_in_distance

    table = torch.zeros(2, 257)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[index(h, q_idx, kv_idx)]

    traced = trace_score_mod(score_mod)
    grad = traced.gradient(frozenset({0}))
    (load,) = {id(g.load): g.load for g in grad.loads}.values()
    assert scatter_strategy(load) is ScatterStrategy.DIAGONAL
    assert monotone_in_distance(load.srcs[1:]) is monotone
    source = emit_score_mod_grad(traced, grad, "f", frozenset({0})).source
    assert ("flexfa_tile_distance_range" in source) is monotone, source
    assert "flexfa_diagonal_sums" in source, source


def _table_mod(index, shape, *, scale: float = 0.5, device: str = "cpu"):
    """A maker of `score + table[index(h, q_idx, kv_idx)]` with a learnable table."""

    def make(dtype):
        g = torch.Generator().manual_seed(3)
        table = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(device, dtype)
        table.requires_grad_(True)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + table[index(h, q_idx, kv_idx)]

        return BuiltMod(score_mod, (table,))

    return make


# With 16-wide tiles, each index makes flexfa_scatter_tile take one branch in the dQ kernel (rows
# are queries): uniform tiles, two offsets per tile, one offset per row, one per pair. (The `+ 16`
# keeps the first three off the BLOCKED strategy, which `q // 16` alone would take.)
GENERAL_INDICES = {
    "uniform_tiles": (lambda h, q, kv: ((q + 16) // 16 - 1, (kv + 16) // 16 - 1), (4, 4)),
    "two_offsets": (lambda h, q, kv: ((q + 16) // 8 - 2, (kv + 16) // 16 - 1), (8, 4)),
    "row_uniform": (lambda h, q, kv: (h, q % 5, (kv + 16) // 16 - 1), (2, 5, 4)),
    "per_pair": (lambda h, q, kv: (h, (q + 2 * kv) % 7), (2, 7)),
    "clamped_distance": (lambda h, q, kv: (h, torch.clamp(q - kv, -5, 5) + 5), (2, 11)),
    "signed_buckets": (
        lambda h, q, kv: (h, torch.where(kv > q, 5, 0) + torch.clamp((q - kv).abs(), max=4)),
        (2, 10),
    ),
    "distance_buckets": (lambda h, q, kv: (h, torch.abs(q - kv) // 6), (2, 10)),
    # Monotone in the distance, falling and a step (Note [Far tiles decided at their corners]).
    "falling_distance": (lambda h, q, kv: (h, torch.clamp((kv - q) // 4, -3, 3) + 3), (2, 7)),
    "distance_step": (lambda h, q, kv: (h, (kv > q).to(torch.int32) * 2 + 1), (2, 4)),
}
PROBLEM = Problem(batch=1, heads_q=2, heads_kv=1, len_q=37, len_kv=45, head_dim=16, head_dim_v=16)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
@pytest.mark.parametrize("name", list(GENERAL_INDICES))
def test_interpreter_against_reference(name, deterministic):
    index, shape = GENERAL_INDICES[name]
    options = dict(INTERPRETER_TILES)
    check_attention(
        PROBLEM,
        score_mod=_table_mod(index, shape),
        mask_mod=flexfa.masks.causal if name == "clamped_distance" else None,
        backend="triton",
        kernel_options=options,
        context=f"{name} deterministic={deterministic}",
        **({"deterministic": True} if deterministic else {}),
    )


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
def test_interpreter_sub_blocks(deterministic):
    """32-wide tiles with an index constant on 16 x 16 sub-blocks, four offsets per tile that
    neither rows nor columns share: one atomic per sub-block."""
    wide = {key: 32 for key in INTERPRETER_TILES}
    check_attention(
        Problem(batch=1, heads_q=1, heads_kv=1, len_q=70, len_kv=45, head_dim=16, head_dim_v=16),
        score_mod=_table_mod(lambda h, q, kv: ((q + 16) // 16 - 1, (kv + 16) // 16 - 1), (5, 3)),
        backend="triton",
        kernel_options=wide,
        deterministic=deterministic,
    )


# The BLOCKED strategy on 16-wide tiles (32-wide in the last): blocks the size of the tile,
# smaller along either axis (several blocks per tile), larger (one per tile), a whole row of
# positions with blocks of keys, blocks given by shifts, and four 16 x 16 blocks per tile.
BLOCKED_INDICES = {
    "tile_blocks": (lambda h, q, kv: (q // 16, kv // 16), (5, 3), 16),
    "small_blocks": (lambda h, q, kv: (h, q // 8, kv // 4), (2, 9, 12), 16),
    "large_blocks": (lambda h, q, kv: (q // 64, kv // 32), (2, 2), 16),
    "rows_by_key_blocks": (lambda h, q, kv: (h, q % 5, kv // 16), (2, 5, 3), 16),
    "shifts": (lambda h, q, kv: (q >> 3, kv >> 5), (9, 2), 16),
    "sub_blocks": (lambda h, q, kv: (q // 16, kv // 16), (5, 3), 32),
}


@pytest.mark.parametrize("name", ["small_blocks", "rows_by_key_blocks"])
def test_interpreter_blocked_fused_dq(name):
    """BLOCKED in the dK/dV kernel (bwd_dq="fused"), whose tile rows are keys: the blocks' sides
    and starting positions swap axes."""
    index, shape, tile = BLOCKED_INDICES[name]
    check_attention(
        Problem(batch=1, heads_q=2, heads_kv=1, len_q=70, len_kv=45, head_dim=16, head_dim_v=16),
        score_mod=_table_mod(index, shape),
        backend="triton",
        kernel_options={**{key: tile for key in INTERPRETER_TILES}, "bwd_dq": "fused"},
    )


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
@pytest.mark.parametrize("name", list(BLOCKED_INDICES))
def test_interpreter_blocked(name, deterministic):
    """Note [Scatter-add of captured gradients], BLOCKED: per-block sums and one offset per block,
    against the float64 reference, with lengths that end inside a block, causal for two."""
    index, shape, tile = BLOCKED_INDICES[name]
    check_attention(
        Problem(batch=1, heads_q=2, heads_kv=1, len_q=70, len_kv=45, head_dim=16, head_dim_v=16),
        score_mod=_table_mod(index, shape),
        mask_mod=flexfa.masks.causal if name in ("small_blocks", "sub_blocks") else None,
        backend="triton",
        kernel_options={key: tile for key in INTERPRETER_TILES},
        context=f"{name} deterministic={deterministic}",
        **({"deterministic": True} if deterministic else {}),
    )


@pytest.mark.parametrize("name", ["row_uniform", "clamped_distance"])
def test_interpreter_fused_dq(name):
    """With bwd_dq="fused" the scatter runs in the dK/dV kernel, whose tile rows are keys: the
    row-uniform index takes the column branch there, and the diagonals run the other way."""
    index, shape = GENERAL_INDICES[name]
    check_attention(
        PROBLEM,
        score_mod=_table_mod(index, shape),
        backend="triton",
        kernel_options={**INTERPRETER_TILES, "bwd_dq": "fused"},
    )


def _grads(index, shape, deterministic: bool, device: str, dtype=torch.float32, n: int = 48):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, device=device, dtype=dtype) for _ in range(3))
    table = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.5).to(device)
    table.requires_grad_(True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[index(h, q_idx, kv_idx)]

    out = flexfa.attention(
        q, k, v, score_mod, backend="triton", deterministic=deterministic,
        kernel_options=INTERPRETER_TILES if device == "cpu" else None,
    )  # fmt: skip
    return torch.autograd.grad(
        (out.float() * torch.linspace(-1, 1, 16, device=device)).sum(), table
    )[0]


@pytest.mark.parametrize("name", ["two_offsets", "per_pair", "clamped_distance"])
def test_deterministic_is_bitwise_repeatable(name):
    index, shape = GENERAL_INDICES[name]
    first, second = (_grads(index, shape, True, "cpu") for _ in range(2))
    assert torch.equal(first, second), "deterministic gradients differ between runs"
    torch.testing.assert_close(first, _grads(index, shape, False, "cpu"), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
@pytest.mark.parametrize("name", list(GENERAL_INDICES))
def test_gpu_against_reference(name, deterministic, dtype):
    index, shape = GENERAL_INDICES[name]
    p = Problem(
        batch=2, heads_q=2, heads_kv=1, len_q=300, len_kv=333, head_dim=64, head_dim_v=64,
        dtype=dtype,
    )  # fmt: skip
    big = {
        "uniform_tiles": (24, 24),
        "two_offsets": (48, 24),
        "row_uniform": (2, 5, 24),
        "distance_buckets": (2, 56),  # |q - kv| // 6 up to 332 // 6
    }
    check_attention(
        p,
        score_mod=_table_mod(index, big.get(name, shape), device="cuda"),
        mask_mod=flexfa.masks.causal,
        backend="triton",
        device="cuda",
        context=f"{name} deterministic={deterministic}",
        **({"deterministic": True} if deterministic else {}),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
@pytest.mark.parametrize("name", [*BLOCKED_INDICES, "blocks_64"])
def test_gpu_blocked_against_reference(name, deterministic, dtype):
    """BLOCKED on the GPU's tiles (64 to 128 wide): blocks smaller than, equal to and larger than
    a tile, lengths that end inside blocks, GQA, causal."""
    index = (lambda h, q, kv: (q // 64, kv // 64)) if name == "blocks_64" else None
    index = index or BLOCKED_INDICES[name][0]
    shape = {
        "tile_blocks": (24, 24),
        "small_blocks": (2, 48, 96),
        "large_blocks": (8, 16),
        "rows_by_key_blocks": (2, 5, 24),
        "shifts": (48, 16),
        "sub_blocks": (24, 24),
        "blocks_64": (8, 8),
    }[name]
    p = Problem(
        batch=2, heads_q=4, heads_kv=2, len_q=300, len_kv=333, head_dim=64, head_dim_v=64,
        dtype=dtype,
    )  # fmt: skip
    check_attention(
        p,
        score_mod=_table_mod(index, shape, device="cuda"),
        mask_mod=flexfa.masks.causal,
        backend="triton",
        device="cuda",
        context=f"{name} deterministic={deterministic}",
        **({"deterministic": True} if deterministic else {}),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["two_offsets", "per_pair", "clamped_distance"])
def test_gpu_deterministic_is_bitwise_repeatable(name):
    index, shape = GENERAL_INDICES[name]
    big = {"two_offsets": (48, 24)}
    first, second = (
        _grads(index, big.get(name, shape), True, "cuda", torch.bfloat16, 300) for _ in range(2)
    )
    assert torch.equal(first, second), "deterministic gradients differ between runs"


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
def test_interpreter_index_computed_from_the_score(deterministic):
    """An index that reads the score varies over any tile: the per-tile decision, not TILE."""

    def make(dtype):
        g = torch.Generator().manual_seed(0)
        table = torch.randn(2, 2, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)

        def by_sign(score, b, h, q_idx, kv_idx):
            return score + table[h, (score > 0).to(torch.int32)]

        return BuiltMod(by_sign, (table,))

    check_attention(
        Problem(batch=1, heads_q=2, heads_kv=2, len_q=33, len_kv=21),
        score_mod=make,
        backend="triton",
        kernel_options=INTERPRETER_TILES,
        deterministic=deterministic,
    )


def test_interpreter_blocked_strided_table():
    """BLOCKED reads and scatters through the table's own strides: a transposed (non-contiguous)
    view of a learnable leaf, its gradient reaching the leaf through autograd."""

    def make(dtype):
        g = torch.Generator().manual_seed(5)
        leaf = (torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.5).to(dtype)
        leaf.requires_grad_(True)

        def score_mod(score, b, h, q_idx, kv_idx):
            table = leaf.t()  # (5, 3), strides (1, 5)
            return score + table[q_idx // 16, kv_idx // 16]

        return BuiltMod(score_mod, (leaf,))

    check_attention(
        Problem(batch=1, heads_q=2, heads_kv=1, len_q=70, len_kv=45, head_dim=16, head_dim_v=16),
        score_mod=make,
        backend="triton",
        kernel_options=dict(INTERPRETER_TILES),
    )
