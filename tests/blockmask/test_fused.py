"""The fused block-mask kernel (flexfa/codegen/triton/blockmask/fused.py) through Triton's interpreter on the CPU:
the same lists as the general path, states equal to the dense oracle, and the general path taken
where the kernel cannot decide."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import flexfa
from flexfa import masks as fm
from flexfa.blockmask.block_mask import BlockSize
from flexfa.blockmask.grid import TileGrid
from flexfa.codegen.triton.blockmask import fused
from tests.blockmask import oracle
from tests.blockmask.strategies import cases, examples
from tests.tiers import sweep

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter run is the CPU check"
)

_CPU = torch.device("cpu")
_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
_LISTS = ("kv_partial", "kv_full", "q_partial", "q_full")


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path):
    with flexfa.config.override(cache_dir=tmp_path):
        yield


def _docs(length: int, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(batch):
        lengths = torch.randint(5, 40, (length,), generator=g)
        rows.append(torch.repeat_interleave(torch.arange(length), lengths)[:length])
    return torch.stack(rows).to(torch.int32)


def _library(length: int) -> dict[str, object]:
    docs = _docs(length)
    return {
        "causal": fm.causal,
        "sliding_window(37)": fm.sliding_window(37),
        "sliding_window(30, causal=False)": fm.sliding_window(30, causal=False),
        "prefix_lm(50)": fm.prefix_lm(50),
        "chunked(40)": fm.chunked(40),
        "dilated_sliding_window(60, 3)": fm.dilated_sliding_window(60, 3),
        "noop": fm.noop_mask,
        "document": fm.document(docs),
        "document & causal": fm.and_masks(fm.causal, fm.document(docs)),
        "chunked & sliding_window": fm.and_masks(fm.chunked(64), fm.sliding_window(50)),
    }


def _grid(fn, B, q_len, kv_len, block) -> tuple[flexfa.TracedMod, TileGrid]:
    traced = flexfa.trace_mask_mod(fn)
    batch = B if "b" in traced.variables else 1
    return traced, TileGrid(batch, 1, q_len, kv_len, BlockSize.of(block), _CPU)


def _same_lists(got, want) -> None:
    for name in _LISTS:
        g, w = getattr(got, name), getattr(want, name)
        assert torch.equal(g.count, w.count), f"{name}.count differs"
        listed = torch.arange(g.index.shape[-1]) < g.count[..., None]
        assert torch.equal(g.index[listed], w.index[listed]), f"{name}.index differs"


LENGTHS = [(200, 200), (150, 211), (211, 77)]
BLOCKS = [16, (32, 16), (24, 40)]


@pytest.mark.parametrize("name", sweep(sorted(_library(8)), keep=2))
def test_library_masks_take_the_fused_path(name) -> None:
    for (q_len, kv_len), block in itertools.product(LENGTHS, BLOCKS):
        fn = _library(max(q_len, kv_len))[name]
        traced, grid = _grid(fn, 2, q_len, kv_len, block)
        got = fused.build(traced, grid)
        assert got is not None, f"{name} at {q_len}x{kv_len}, block {block}: general path"
        with flexfa.config.override(fused_block_mask="off"):
            want = flexfa.create_block_mask(fn, 2, None, q_len, kv_len, BLOCK_SIZE=block)
        _same_lists(got, want)
        oracle.check_invariants(got)


@settings(max_examples=examples(60), **_SETTINGS)
@given(cases(max_len=120, max_leaves=3))
def test_matches_dense_oracle(case) -> None:
    with flexfa.config.override(fused_block_mask="on"):
        bm = flexfa.create_block_mask(
            case.mask.fn, case.B, case.H, case.q_len, case.kv_len, BLOCK_SIZE=case.block_size
        )
    block = BlockSize.of(case.block_size)
    want = oracle.expected_states(
        case.mask.fn, case.batch, case.heads, case.q_len, case.kv_len, block
    )
    got = oracle.states_of(bm, case.batch, case.heads)
    assert torch.equal(got, want), f"{case}\n{oracle.describe_mismatch(got, want)}"
    oracle.check_invariants(bm)


def test_create_block_mask_uses_it_when_enabled(monkeypatch) -> None:
    calls = []
    real = fused.build
    monkeypatch.setattr(fused, "build", lambda *a: calls.append(a) or real(*a))
    with flexfa.config.override(fused_block_mask="on"):
        flexfa.create_block_mask(fm.causal, None, None, 100, 100, BLOCK_SIZE=16)
    assert len(calls) == 1
    with flexfa.config.override(fused_block_mask="off"):
        flexfa.create_block_mask(fm.causal, None, None, 100, 100, BLOCK_SIZE=16)
    # "auto" uses it on CUDA only.
    flexfa.create_block_mask(fm.causal, None, None, 100, 100, BLOCK_SIZE=16)
    assert len(calls) == 1


def test_unsupported_operations_take_the_general_path(caplog) -> None:
    keep = torch.tensor([[True, False, True], [False, False, True]])

    def table(b, h, q_idx, kv_idx):  # a load indexed by both q_idx and kv_idx
        return keep[q_idx % 2, kv_idx % 3]

    def product(b, h, q_idx, kv_idx):  # an integer product of q- and kv-values
        return (q_idx // 7) * (kv_idx // 5) < 20

    for fn, why in ((table, "a load indexed by q_idx and kv_idx"), (product, "mul of values")):
        traced, grid = _grid(fn, 1, 60, 45, 16)
        with caplog.at_level(logging.DEBUG, logger="flexfa"):
            assert fused.build(traced, grid) is None
        assert why in caplog.text
        with flexfa.config.override(fused_block_mask="on"):
            bm = flexfa.create_block_mask(fn, None, None, 60, 45, BLOCK_SIZE=16)
        want = oracle.expected_states(fn, 1, 1, 60, 45, BlockSize(16, 16))
        assert torch.equal(oracle.states_of(bm, 1, 1), want)


def test_undecided_tiles_take_the_general_path(caplog) -> None:
    # Ids with gaps: the q-side range {0, 2} of a tile overlaps the kv-side {1} though no pair is
    # equal, and no witness can prove a tile partial that is empty.
    ids = torch.tensor([0] * 8 + [2] * 8 + [1] * 16, dtype=torch.int64)

    def gappy(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    traced, grid = _grid(gappy, 1, 32, 32, 16)
    with caplog.at_level(logging.DEBUG, logger="flexfa"):
        assert fused.build(traced, grid) is None
    assert "undecided" in caplog.text
    with flexfa.config.override(fused_block_mask="on"):
        bm = flexfa.create_block_mask(gappy, None, None, 32, 32, BLOCK_SIZE=16)
    want = oracle.expected_states(gappy, 1, 1, 32, 32, BlockSize(16, 16))
    assert torch.equal(oracle.states_of(bm, 1, 1), want)


def test_witnesses_in_the_kernel_prove_partial_tiles() -> None:
    # Document & causal: on the diagonal both sides are partial, which only witnesses settle.
    docs = _docs(96, batch=1)
    fn = fm.and_masks(fm.causal, fm.document(docs))
    traced, grid = _grid(fn, 1, 96, 96, 32)
    bm = fused.build(traced, grid)
    assert bm is not None
    want = oracle.expected_states(fn, 1, 1, 96, 96, BlockSize(32, 32))
    assert torch.equal(oracle.states_of(bm, 1, 1), want)


def test_out_of_bounds_loads_are_not_trusted() -> None:
    # Reads past the table at allowed pairs are an error (Note [Loads out of bounds]): the fused
    # path must leave those tiles to exact evaluation, which raises on the CPU.
    table = torch.arange(40, dtype=torch.int32)

    def reads_past_the_end(b, h, q_idx, kv_idx):
        return table[q_idx] >= kv_idx

    with flexfa.config.override(fused_block_mask="on"), pytest.raises(IndexError):
        flexfa.create_block_mask(reads_past_the_end, None, None, 64, 64, BLOCK_SIZE=16)


def test_generated_source_is_cached_and_readable(tmp_path) -> None:
    traced, grid = _grid(fm.causal, 1, 64, 64, 16)
    fused.clear_memory_cache()
    fused.build(traced, grid)
    files = list((tmp_path / "blockmask").glob("lists_*/kernels.py"))
    assert len(files) == 1
    source = files[0].read_text()
    assert "def flexfa_block_lists(" in source and "def mask_mod_causal(" in source
    fused.clear_memory_cache()
    fused.build(traced, grid)  # read back from disk, not written again
    assert len(list((tmp_path / "blockmask").glob("lists_*/kernels.py"))) == 1


def test_affine_values_that_fold_to_constants() -> None:
    """Found by the GPU fuzzer: `q_idx - q_idx + c` is an affine form without variables, whose
    bounds the kernel once printed as `(c).to(tl.float64)` (a compile error)."""

    def never(b, h, q_idx, kv_idx):
        return ~((q_idx - q_idx) > 0)

    def folded(b, h, q_idx, kv_idx):
        d = q_idx - q_idx + -3
        return torch.where(d != d, 7, d) >= (b >= b).int()

    for fn in (never, folded):
        with flexfa.config.override(fused_block_mask="on"):
            bm = flexfa.create_block_mask(fn, 2, None, 80, 70, BLOCK_SIZE=16)
        want = oracle.expected_states(fn, 1, 1, 80, 70, BlockSize(16, 16))
        assert torch.equal(oracle.states_of(bm, 1, 1), want), fn.__name__


def test_a_cold_kernel_compiles_in_the_background_while_the_general_path_builds(
    monkeypatch, caplog
) -> None:
    # Note [Concurrent compiles]: while the kernel compiles, the general path gives the lists;
    # once it is ready, the kernel does, and both are the same.
    states = iter([True, False])
    seen = []

    def compiling(fast_key, label, kernel, warm):
        seen.append(label)
        return next(states)

    monkeypatch.setattr(fused, "compiling_in_background", compiling)
    traced, grid = _grid(fm.sliding_window(37), 2, 150, 211, 16)
    with caplog.at_level(logging.DEBUG, logger="flexfa"):
        assert fused.build(traced, grid) is None
    assert "its kernel is compiling" in caplog.text
    got = fused.build(traced, grid)
    assert got is not None
    assert seen == ["block lists of " + traced.name] * 2
    with flexfa.config.override(fused_block_mask="off"):
        want = flexfa.create_block_mask(fm.sliding_window(37), 2, None, 150, 211, BLOCK_SIZE=16)
    _same_lists(got, want)
