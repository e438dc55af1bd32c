"""The BlockMask of a packed mask built from the offsets (Note [Tiles of a packed mask]) against the
dense oracle and the general path: random sequence lengths (0 and 1 included, queries and keys
alike or not), block sizes and inner masks; the fast builder's use, operations and syncs; the
traces of packed mods (Note [Packed batches without retracing])."""

from __future__ import annotations

import collections
import logging

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import flexfa
from flexfa import masks as fm
from flexfa.blockmask import packed
from flexfa.blockmask.block_mask import BlockSize, TileState
from flexfa.blockmask.build import classify
from flexfa.blockmask.grid import TileGrid
from flexfa.frontend.cache import traces
from flexfa.frontend.trace import _trace, trace, trace_mask_mod
from flexfa.varlen import packed_mods, packing
from tests.blockmask import oracle
from tests.blockmask.strategies import MAX_H, MaskExpr, examples, masks
from tests.tiers import sweep

_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
_CPU = torch.device("cpu")

#: Inner masks the analysis decides on every rectangle, each allowing (0, 0) of every sequence:
#: with sequences of at least one query and one key, the fast path is then the oracle exactly.
LIBRARY = {
    "none": None,
    "causal": fm.causal,
    "sliding_window(5)": fm.sliding_window(5),
    "sliding_window(3, causal=False)": fm.sliding_window(3, causal=False),
    "prefix_lm(4)": fm.prefix_lm(4),
    "chunked(6)": fm.chunked(6),
    "dilated_sliding_window(9, 3)": fm.dilated_sliding_window(9, 3),
    "noop_mask": fm.noop_mask,
}


def _offsets(lens) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()],
                        dtype=torch.int32)  # fmt: skip


def _build(inner, lens_q, lens_kv, heads=1, block=16):
    """(the packed mask_mod, its BlockMask, whether the fast builder made it)."""
    total_q, total_kv = sum(lens_q), sum(lens_kv)
    cu_q = _offsets(lens_q)
    cu_kv = cu_q if list(lens_kv) == list(lens_q) else _offsets(lens_kv)
    pack = packing(cu_q, cu_kv, total_q, total_kv, _CPU)
    _, mask = packed_mods(None, inner, pack, heads)
    H = heads if "h" in trace_mask_mod(mask).variables else None
    before = packed.built["packed"]
    bm = flexfa.create_block_mask(mask, 1, H, total_q, total_kv, BLOCK_SIZE=block)
    return mask, bm, packed.built["packed"] > before


def _check(inner, lens_q, lens_kv, heads, block, exact: bool) -> bool:
    mask, bm, fast = _build(inner, lens_q, lens_kv, heads, block)
    oracle.check_invariants(bm)
    H = bm.heads
    want = oracle.expected_states(mask, 1, H, sum(lens_q), sum(lens_kv), BlockSize.of(block))
    got = oracle.states_of(bm, 1, H)
    full, empty = int(TileState.FULL), int(TileState.EMPTY)
    where = f"lens_q={lens_q} lens_kv={lens_kv} block={block} heads={heads} fast={fast}"
    # Never a full tile with an excluded pair, never an empty tile with an allowed pair.
    wrong = ((got == full) & (want != full)) | ((got == empty) & (want != empty))
    assert not bool(wrong.any()), f"{where}\n{oracle.describe_mismatch(got, want)}"
    if exact or not fast:  # the general path is exact
        assert torch.equal(got, want), f"{where}\n{oracle.describe_mismatch(got, want)}"
    return fast


lengths = st.one_of(st.just(0), st.just(1), st.integers(0, 70))
blocks = st.sampled_from([1, 3, 16, (8, 16), (16, 4), (24, 40), 64])


@st.composite
def packings(draw, min_len: int = 0):
    n = draw(st.integers(1, 6))
    each = lengths.filter(lambda x: x >= min_len)
    lens_q = draw(st.lists(each, min_size=n, max_size=n))
    lens_kv = draw(st.one_of(st.just(lens_q), st.lists(each, min_size=n, max_size=n)))
    assume(sum(lens_q) > 0 and sum(lens_kv) > 0)
    return lens_q, lens_kv


@settings(max_examples=examples(120), **_SETTINGS)
@given(packings(), st.sampled_from(sorted(LIBRARY)), blocks)
def test_library_masks_sound_with_empty_sequences(lens, name, block):
    lens_q, lens_kv = lens
    assert _check(LIBRARY[name], lens_q, lens_kv, 1, block, exact=False)


@settings(max_examples=examples(120), **_SETTINGS)
@given(packings(min_len=1), st.sampled_from(sorted(LIBRARY)), blocks)
def test_library_masks_exact(lens, name, block):
    lens_q, lens_kv = lens
    assert _check(LIBRARY[name], lens_q, lens_kv, 1, block, exact=True)


@st.composite
def random_inner(draw, lens_q, lens_kv) -> MaskExpr:
    """A random mask of `tests/blockmask/strategies.py` (tables for the longest sequence), with b
    folded onto the two batch elements its tables have."""
    inner = draw(masks(max(lens_q), max(lens_kv), max_leaves=3))
    fn = inner.fn
    return MaskExpr(lambda b, h, q, kv: fn(b % 2, h, q, kv), f"{inner.text} at b % 2")


@settings(max_examples=examples(150), **_SETTINGS)
@given(st.data(), packings(), blocks, st.sampled_from([1, MAX_H]))
def test_random_inner_masks_sound(data, lens, block, heads):
    lens_q, lens_kv = lens
    assume(max(lens_q) > 0 and max(lens_kv) > 0)
    inner = data.draw(random_inner(lens_q, lens_kv), label="inner")
    _check(inner.fn, lens_q, lens_kv, heads, block, exact=False)


def test_matches_the_general_path_on_the_benchmark_shape():
    """The sequence lengths of bench/varlen.py, scaled down 16x, against `classify`."""
    lens = [32, 512, 64, 187, 375, 43, 256, 162]
    for inner in (fm.causal, fm.sliding_window(40), fm.prefix_lm(20), None):
        mask, bm, fast = _build(inner, lens, lens, block=16)
        assert fast
        grid = TileGrid(1, 1, sum(lens), sum(lens), BlockSize(16, 16), _CPU)
        want = classify(trace_mask_mod(mask), grid).states
        assert torch.equal(bm.tile_states(), want), oracle.describe_mismatch(bm.tile_states(), want)


class _Ops(TorchDispatchMode):
    """Counts torch operations (views aside) and device-to-host reads."""

    _VIEWS = frozenset(
        {"select", "slice", "unsqueeze", "expand", "view", "transpose", "alias", "t"}
    )
    _SYNCS = frozenset(
        {"_local_scalar_dense", "nonzero", "item", "is_nonzero", "_unique2", "equal"}
    )

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self._VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def syncs(self) -> list[str]:
        return [n for n in self.ops if n in self._SYNCS]


def test_fast_path_is_used_without_syncs():
    """A regression to the general path (witnesses, refinement: ~1700 operations and a dozen
    syncs for 8 sequences) fails here: the builder is used, with a bounded number of vectorized
    operations and no device-to-host read."""
    lens = [32, 512, 64, 187, 375, 43, 256, 162]
    cu = _offsets(lens)
    for inner in (fm.causal, fm.sliding_window(64), fm.prefix_lm(16), None):
        pack = packing(cu.clone(), cu.clone(), sum(lens), sum(lens), _CPU)
        _, mask = packed_mods(None, inner, pack, 16)
        flexfa.create_block_mask(mask, 1, None, sum(lens), sum(lens))  # warm the caches
        pack = packing(cu.clone(), cu.clone(), sum(lens), sum(lens), _CPU)
        _, mask = packed_mods(None, inner, pack, 16)
        before = packed.built["packed"]
        with _Ops() as seen:
            flexfa.create_block_mask(mask, 1, None, sum(lens), sum(lens))
        assert packed.built["packed"] == before + 1
        assert not seen.syncs, seen.ops
        assert sum(seen.ops.values()) <= 80, seen.ops


def test_masks_the_analysis_cannot_decide_take_the_general_path():
    keep = torch.tensor([[True, False, True], [False, True, True]])

    def table(b, h, q_idx, kv_idx):
        return keep[q_idx % 2, kv_idx % 3] | (q_idx == kv_idx)

    lens = [40, 7, 0, 33]
    assert not _check(table, lens, lens, 1, 8, exact=True)


def test_masks_reading_tensors_are_checked():
    keep = torch.tensor([3, 0, 50, 1], dtype=torch.int32)

    def key_padding(b, h, q_idx, kv_idx):
        return kv_idx < keep[b]

    assert _check(key_padding, [9, 4, 60, 2], [12, 5, 60, 1], 1, 8, exact=True)


def test_masks_reading_heads():
    windows = torch.tensor([1, 4, 30], dtype=torch.int32)

    def head_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < windows[h])

    assert _check(head_window, [50, 1, 3, 20], [50, 1, 3, 20], 3, (8, 4), exact=True)


def test_rebound_tensors_take_the_general_path():
    """torch.compile binds other tensors to a described trace: the builder, which knows its own
    packing only, must not answer for them."""
    lens, other = [20, 11, 9], [5, 30, 5]
    mask, _, _ = _build(fm.causal, lens, lens, block=8)
    mask_other, _, _ = _build(fm.causal, other, other, block=8)
    traced = trace_mask_mod(mask)
    rebound = traced.with_tensors(trace_mask_mod(mask_other).tensors)
    before = packed.built["packed"]
    bm = flexfa.create_block_mask(rebound, 1, None, 40, 40, BLOCK_SIZE=8)
    assert packed.built["packed"] == before
    want = oracle.expected_states(mask_other, 1, 1, 40, 40, BlockSize(8, 8))
    assert torch.equal(bm.tile_states(), want)


@pytest.mark.parametrize(
    "inner", [None, fm.causal, fm.sliding_window(7)], ids=["none", "causal", "sliding_window"]
)
def test_packed_traces_equal_a_trace_and_are_not_retraced(inner):
    lens = [5, 0, 9, 1]
    cu = _offsets(lens)
    pack = packing(cu, cu, 15, 15, _CPU)
    score, mask = packed_mods(flexfa.mods.alibi, inner, pack, 4)
    for fn, kind in ((mask, "mask_mod"), (score, "score_mod")):
        hooked, plain = trace(fn, kind), _trace(fn, kind, None, kind == "score_mod")
        assert hooked.key == plain.key and hooked.fn is fn
        assert all(a is b for a, b in zip(hooked.tensors, plain.tensors, strict=True))
    misses = traces.misses
    for _ in range(3):  # new batches: new tensors, the same traces
        pack = packing(cu.clone(), cu.clone(), 15, 15, _CPU)
        score, mask = packed_mods(flexfa.mods.alibi, inner, pack, 4)
        assert trace_mask_mod(mask).tensors[0] is pack.seq_q
        trace(score, "score_mod")
    assert traces.misses == misses


def test_an_inner_mask_without_captures_is_traced_once_for_every_device(monkeypatch):
    """Note [One inner trace for every device]: a packed call looks the user's mask_mod up once
    when it captures no tensor (its trace serves the BlockMask's trace and the builder's device),
    and once per device when it does."""
    import flexfa.varlen as varlen

    calls = []
    real = varlen.trace

    def counting(fn, kind, *, device=None):
        calls.append((fn, device))
        return real(fn, kind, device=device)

    monkeypatch.setattr(varlen, "trace", counting)
    lens = [5, 0, 9, 1]
    cu = _offsets(lens)
    ids = torch.tensor([0] * 8 + [1] * 7)

    def same_half(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    for inner, traces_wanted in ((fm.causal, 1), (same_half, 2)):
        calls.clear()
        pack = packing(cu.clone(), cu.clone(), 15, 15, _CPU)
        _, mask = packed_mods(None, inner, pack, 2)
        bm = flexfa.create_block_mask(mask, 1, None, 15, 15, BLOCK_SIZE=4)
        user = [device for fn, device in calls if fn is inner]
        assert len(user) == traces_wanted, (inner, calls)
        want = oracle.expected_states(mask, 1, 1, 15, 15, BlockSize.of(4))
        got = oracle.states_of(bm, 1, 1)
        assert torch.equal(got, want), oracle.describe_mismatch(got, want)


_WINDOW = 3  # read by `_windowed`, changed by the test below


def _windowed(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < _WINDOW)


def test_packed_mask_traces_follow_a_change_of_what_the_user_mask_reads(monkeypatch):
    """Mask twins are looked up by the user's trace (Note [Mask twins by the user's trace]): a
    change of a global the mask_mod reads gives another trace, and the packed mask's BlockMask
    and trace follow it; an unchanged mask_mod reuses the twin."""
    lens = [40, 0, 70, 1]
    cu = _offsets(lens)
    total = sum(lens)

    def packed_trace(window):
        monkeypatch.setitem(globals(), "_WINDOW", window)
        pack = packing(cu.clone(), cu.clone(), total, total, _CPU)
        _, mask = packed_mods(None, _windowed, pack, 2)
        traced = trace_mask_mod(mask)
        assert traced.fn is mask and traced.tensors[0] is pack.seq_q
        bm = flexfa.create_block_mask(mask, 1, None, total, total, BLOCK_SIZE=16)
        want = oracle.expected_states(mask, 1, 1, total, total, BlockSize.of(16))
        got = oracle.states_of(bm, 1, 1)
        assert torch.equal(got, want), oracle.describe_mismatch(got, want)
        return traced

    small = packed_trace(3)
    misses = traces.misses
    assert packed_trace(3).key == small.key and traces.misses == misses
    assert packed_trace(60).key != small.key


class _Limit:
    value = 5  # an attribute of an arbitrary object: the trace cache cannot keep a mod reading it


_LIMIT = _Limit()


def _uncacheable(b, h, q_idx, kv_idx):
    return kv_idx < _LIMIT.value


def test_packed_masks_the_trace_cache_cannot_keep_leave_it_alone():
    """Their twins are kept apart, a few (Note [Mask twins by the user's trace]): batches of a
    mask_mod the trace cache cannot keep add nothing to it, and each traces what it reads now."""
    from flexfa import varlen

    lens = [6, 0, 11, 1]
    cu = _offsets(lens)
    kept = len(traces._entries)
    uncacheable = traces.uncacheable
    for limit in (5, 2, 5, 3, 4) * 5:
        _LIMIT.value = limit
        pack = packing(cu.clone(), cu.clone(), sum(lens), sum(lens), _CPU)
        _, mask = packed_mods(None, _uncacheable, pack, 2)
        bm = flexfa.create_block_mask(mask, 1, None, sum(lens), sum(lens), BLOCK_SIZE=4)
        want = oracle.expected_states(mask, 1, 1, sum(lens), sum(lens), BlockSize.of(4))
        got = oracle.states_of(bm, 1, 1)
        assert torch.equal(got, want), f"limit {limit}\n{oracle.describe_mismatch(got, want)}"
    _LIMIT.value = 5
    assert traces.uncacheable > uncacheable
    assert len(traces._entries) == kept
    assert len(varlen._mask_twins) <= varlen._MASK_TWINS_KEPT


# ------------------------------------------------------------------------------------------------
# The packed kernel (Note [Packed block masks in one kernel]) and the positions kernel (Note
# [Packed positions in one kernel]), through Triton's interpreter: the same lists as the torch
# builder, which stays tested above (on the CPU it is what runs by default).
# ------------------------------------------------------------------------------------------------

_interpreted = pytest.mark.skipif(
    not flexfa.config.triton_interpret, reason="the kernels run through Triton's interpreter"
)
_LISTS = ("kv_partial", "kv_full", "q_partial", "q_full")


def _same_lists(got, want, where: str = "", kernel: bool = True) -> None:
    """The lists of `got` are those of `want`; the kernel's are zero past their counts."""
    for name in _LISTS:
        g, w = getattr(got, name), getattr(want, name)
        assert torch.equal(g.count, w.count), f"{where}: {name}.count differs"
        listed = torch.arange(g.index.shape[-1]) < g.count[..., None]
        assert torch.equal(g.index[listed], w.index[listed]), f"{where}: {name}.index differs"
        if kernel:
            assert not bool(g.index[~listed].any()), f"{where}: {name}.index not zero past count"


def _both(inner, lens_q, lens_kv, heads=1, block=16):
    """(the kernel's BlockMask or None if it was not used, the torch builder's, the mask_mod)."""
    total_q, total_kv = sum(lens_q), sum(lens_kv)
    cu_q = _offsets(lens_q)
    cu_kv = cu_q if list(lens_kv) == list(lens_q) else _offsets(lens_kv)
    with flexfa.config.override(fused_block_mask="on"):
        pack = packing(cu_q, cu_kv, total_q, total_kv, _CPU)
    _, mask = packed_mods(None, inner, pack, heads)
    H = heads if "h" in trace_mask_mod(mask).variables else None
    with flexfa.config.override(fused_block_mask="off"):
        want = flexfa.create_block_mask(mask, 1, H, total_q, total_kv, BLOCK_SIZE=block)
    before = packed.built["kernel"]
    with flexfa.config.override(fused_block_mask="on"):
        got = flexfa.create_block_mask(mask, 1, H, total_q, total_kv, BLOCK_SIZE=block)
    return (got if packed.built["kernel"] > before else None), want, mask


@pytest.fixture
def _cache_dir(tmp_path):
    with flexfa.config.override(cache_dir=tmp_path):
        yield


def _windows(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 2 * h + b)


KERNEL_MASKS = {**LIBRARY, "windows per head and sequence": _windows}


@_interpreted
@pytest.mark.usefixtures("_cache_dir")
@pytest.mark.parametrize(
    "name, block",
    sweep([(name, block) for block in [16, 32, (8, 16)] for name in sorted(KERNEL_MASKS)], keep=3),
)
def test_kernel_lists_equal_the_torch_builders(name, block):
    inner = KERNEL_MASKS[name]
    for lens_q, lens_kv in (
        ([5, 0, 40, 1, 33, 17], [5, 0, 40, 1, 33, 17]),
        ([9, 3, 0, 50], [1, 20, 6, 31]),
        ([7, 1, 30, 12], [7, 1, 30, 12]),
        ([3, 25, 1], [10, 2, 18]),
    ):
        got, want, mask = _both(inner, lens_q, lens_kv, heads=3, block=block)
        where = f"{name} lens_q={lens_q} lens_kv={lens_kv} block={block}"
        assert got is not None, where
        oracle.check_invariants(got)
        _same_lists(got, want, where)
        H = got.heads
        expect = oracle.expected_states(mask, 1, H, sum(lens_q), sum(lens_kv), BlockSize.of(block))
        states = oracle.states_of(got, 1, H)
        full, empty = int(TileState.FULL), int(TileState.EMPTY)
        wrong = ((states == full) & (expect != full)) | ((states == empty) & (expect != empty))
        assert not bool(wrong.any()), where
        if min(lens_q + lens_kv) > 0:  # Note [Tiles of a packed mask]: exact there
            assert torch.equal(states, expect), where


@_interpreted
@pytest.mark.usefixtures("_cache_dir")
@settings(max_examples=examples(25), **_SETTINGS)
@given(packings(), st.sampled_from(sorted(LIBRARY)), st.sampled_from([16, 32, (16, 8)]))
def test_kernel_on_random_offsets(lens, name, block):
    lens_q, lens_kv = lens
    got, want, _ = _both(LIBRARY[name], lens_q, lens_kv, block=block)
    assert got is not None
    _same_lists(got, want, f"{name} lens_q={lens_q} lens_kv={lens_kv} block={block}")


@_interpreted
@pytest.mark.usefixtures("_cache_dir")
def test_masks_the_kernel_cannot_take_fall_back_as_before(caplog):
    def half(b, h, q_idx, kv_idx):  # a float q-line: summarized per grid tile
        return q_idx * 0.5 >= kv_idx

    keep = torch.tensor([3, 0, 50, 1], dtype=torch.int32)

    def key_padding(b, h, q_idx, kv_idx):  # reads a tensor: checked, by the torch builder
        return kv_idx < keep[b]

    lens = [9, 4, 60, 2]
    for inner in (half, key_padding):
        with caplog.at_level(logging.DEBUG, logger="flexfa"):
            got, want, mask = _both(inner, lens, lens, block=16)
        assert got is None, inner.__name__
        with flexfa.config.override(fused_block_mask="on"):
            again = flexfa.create_block_mask(mask, 1, None, sum(lens), sum(lens), BLOCK_SIZE=16)
        _same_lists(again, want, inner.__name__, kernel=False)
    assert "a line summarized per tile" in caplog.text


@_interpreted
@pytest.mark.usefixtures("_cache_dir")
def test_a_cold_kernel_compiles_in_the_background_while_torch_builds(monkeypatch):
    from flexfa.codegen.triton import packing as positions
    from flexfa.codegen.triton.blockmask import packed_fused

    states = iter([True, False])
    seen = []

    def compiling(fast_key, label, kernel, warm):
        seen.append(label)
        return next(states)

    monkeypatch.setattr(packed_fused, "compiling_in_background", compiling)
    monkeypatch.setattr(positions, "compiling_in_background", lambda *a: True)
    lens = [20, 0, 35, 1, 12]
    first, want, _ = _both(fm.causal, lens, lens)
    assert first is None  # the torch builder answered meanwhile
    second, _, _ = _both(fm.causal, lens, lens)
    assert second is not None
    assert seen == ["packed block lists of packed_causal"] * 2
    _same_lists(second, want)


@_interpreted
@settings(max_examples=examples(30), **_SETTINGS)
@given(st.lists(lengths, min_size=1, max_size=9).filter(lambda x: sum(x) > 0))
def test_positions_kernel(lens):
    from flexfa.codegen.triton import packing as positions

    cu = _offsets(lens)
    want = _torch_positions(cu, sum(lens))
    got = torch.empty(sum(lens), dtype=torch.int32), torch.empty(sum(lens), dtype=torch.int32)
    assert positions.positions(cu, *got, sum(lens))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), lens


def _torch_positions(cu, total):
    """(seq, pos) of the tokens of offsets `cu`, by the torch operations."""
    from flexfa import varlen

    seq, pos = torch.empty(total, dtype=torch.int32), torch.empty(total, dtype=torch.int32)
    with flexfa.config.override(fused_block_mask="off"):
        varlen._write_positions(cu, seq, pos, total)
    return seq, pos


def _check_positions(pack, where=""):
    assert not pack.unwritten[0], where
    for cu, seq, pos in (
        (pack.cu_q, pack.seq_q, pack.pos_q),
        (pack.cu_kv, pack.seq_kv, pack.pos_kv),
    ):
        want_seq, want_pos = _torch_positions(cu, seq.numel())
        assert torch.equal(seq, want_seq) and torch.equal(pos, want_pos), where


@_interpreted
@pytest.mark.usefixtures("_cache_dir")
@settings(max_examples=examples(20), **_SETTINGS)
@given(packings(), st.sampled_from([None, fm.causal, fm.sliding_window(9)]))
def test_deferred_positions_are_written_by_the_list_kernel(lens, inner):
    """A deferred packing's positions come from the block-list kernel (Note [Positions written
    with the block lists]): the same as the torch operations', queries and keys."""
    lens_q, lens_kv = lens
    cu_q = _offsets(lens_q)
    cu_kv = cu_q if list(lens_kv) == list(lens_q) else _offsets(lens_kv)
    total_q, total_kv = sum(lens_q), sum(lens_kv)
    with flexfa.config.override(fused_block_mask="on"):
        pack = packing(cu_q, cu_kv, total_q, total_kv, _CPU, defer=True)
        assert pack.unwritten[0]
        _, mask = packed_mods(None, inner, pack, 2)
        before = packed.built["kernel"]
        flexfa.create_block_mask(mask, 1, None, total_q, total_kv, BLOCK_SIZE=16)
        assert packed.built["kernel"] == before + 1
    _check_positions(pack, f"{lens_q} {lens_kv}")


@_interpreted
@pytest.mark.usefixtures("_cache_dir")
def test_strided_offsets_reach_the_kernels_contiguous():
    """The kernels read cu[s]: a strided view of the offsets gives the positions and lists of its
    values."""
    lens = [5, 0, 40, 1, 33]
    cu = _offsets(lens)
    strided = torch.stack([cu, cu * 0], 1)[:, 0]
    assert not strided.is_contiguous()
    with flexfa.config.override(fused_block_mask="on"):
        got = []
        for c in (cu, strided):
            pack = packing(c, c, sum(lens), sum(lens), _CPU, defer=True)
            _, mask = packed_mods(None, fm.causal, pack, 2)
            got.append(flexfa.create_block_mask(mask, 1, None, sum(lens), sum(lens), BLOCK_SIZE=16))
            pack.fill()
            _check_positions(pack, "strided" if c is strided else "contiguous")
    _same_lists(got[1], got[0], "strided")


@_interpreted
@pytest.mark.usefixtures("_cache_dir")
def test_deferred_positions_are_written_when_the_list_kernel_does_not_run(monkeypatch):
    """The torch builder (while the kernel compiles, or for a mask it cannot take) and a later
    `packing()` without `defer` see written positions."""
    from flexfa.codegen.triton.blockmask import packed_fused

    lens = [20, 0, 35, 1, 12]
    cu = _offsets(lens)
    keep = torch.tensor([3, 0, 50, 1, 4], dtype=torch.int32)

    def key_padding(b, h, q_idx, kv_idx):  # reads a tensor: the torch builder's
        return kv_idx < keep[b]

    with flexfa.config.override(fused_block_mask="on"):
        with monkeypatch.context() as m:
            m.setattr(packed_fused, "compiling_in_background", lambda *a: True)
            pack = packing(cu.clone(), cu.clone(), sum(lens), sum(lens), _CPU, defer=True)
            _, mask = packed_mods(None, fm.causal, pack, 2)
            bm = flexfa.create_block_mask(mask, 1, None, sum(lens), sum(lens), BLOCK_SIZE=16)
            _check_positions(pack, "compiling")
            want = oracle.expected_states(mask, 1, 1, sum(lens), sum(lens), BlockSize.of(16))
            assert torch.equal(oracle.states_of(bm, 1, 1), want)
        pack = packing(cu.clone(), cu.clone(), sum(lens), sum(lens), _CPU, defer=True)
        _, mask = packed_mods(None, key_padding, pack, 2)
        flexfa.create_block_mask(mask, 1, None, sum(lens), sum(lens), BLOCK_SIZE=16)
        _check_positions(pack, "key padding")
        fresh = cu.clone()
        pending = packing(fresh, fresh, sum(lens), sum(lens), _CPU, defer=True)
        assert pending.unwritten[0]
        assert packing(fresh, fresh, sum(lens), sum(lens), _CPU) is pending  # cached, now written
        _check_positions(pending, "cached")


@_interpreted
@pytest.mark.usefixtures("_cache_dir")
def test_a_new_batch_is_one_launch_and_no_other_operation(monkeypatch):
    """With the kernels, a new batch's packing and BlockMask, as a packed call makes them, run no
    torch operation on the device (allocations aside) and launch one kernel: the block lists,
    which writes the positions too (Note [Positions written with the block lists]). Without
    deferring, the positions are a launch of their own."""
    from torch.utils._python_dispatch import _disable_current_modes

    from flexfa.codegen.triton import packing as positions
    from flexfa.codegen.triton.blockmask import packed_fused

    launches = []
    for module in (packed_fused, positions):
        run = module.launch_default

        def counted(fast_key, label, *rest, run=run):
            launches.append(label)
            with _disable_current_modes():  # the interpreter's own copies are no launches
                run(fast_key, label, *rest)

        monkeypatch.setattr(module, "launch_default", counted)
    lens = [32, 512, 64, 187, 375, 43, 256, 162]
    cu = _offsets(lens)
    with flexfa.config.override(fused_block_mask="on"):
        for inner in (fm.causal, fm.sliding_window(64), None):
            for defer in (True, False):
                for _ in range(2):  # the first warms the caches
                    launches.clear()
                    fresh = cu.clone()
                    with _Ops() as seen:
                        pack = packing(fresh, fresh, sum(lens), sum(lens), _CPU, defer=defer)
                        _, mask = packed_mods(None, inner, pack, 16)
                        flexfa.create_block_mask(mask, 1, None, sum(lens), sum(lens))
                        pack.fill()
                lists = "packed block lists of " + mask.__name__
                assert sorted(launches) == ([lists] if defer else [lists, "packed positions"])
                assert set(seen.ops) <= {"empty", "empty_strided", "as_strided"}, seen.ops
                _check_positions(pack, f"{mask.__name__} defer={defer}")


@_interpreted
def test_batches_of_new_lengths_share_the_analysis_and_the_kernel_plan(monkeypatch):
    """Batches whose longest sequences differ (within a power of 2) reuse the mask's analysis and
    the packed kernel's plan (Note [Relative grids of powers of 2]), and their lists are still
    exact where the dense oracle says so."""
    from flexfa.codegen.triton.blockmask import packed_fused

    made = []
    make = packed_fused._make
    monkeypatch.setattr(packed_fused, "_make", lambda *a: made.append(a[1]) or make(*a))
    analyzed = []
    analyzer = packed.Analyzer
    monkeypatch.setattr(packed, "Analyzer", lambda *a: analyzed.append(a[1]) or analyzer(*a))
    batches = ([32, 300, 64, 187], [290, 43, 256, 162], [5, 511, 77, 1])
    with flexfa.config.override(fused_block_mask="on"):
        for lens in batches:
            cu = _offsets(lens)
            pack = packing(cu, cu, sum(lens), sum(lens), _CPU)
            _, mask = packed_mods(None, fm.sliding_window(100), pack, 2)
            before = packed.built["kernel"]
            bm = flexfa.create_block_mask(mask, 1, None, sum(lens), sum(lens), BLOCK_SIZE=16)
            assert packed.built["kernel"] == before + 1
            want = oracle.expected_states(mask, 1, 1, sum(lens), sum(lens), BlockSize.of(16))
            got = oracle.states_of(bm, 1, 1)
            assert torch.equal(got, want), f"{lens}\n{oracle.describe_mismatch(got, want)}"
    assert len(made) <= 1 and len(analyzed) <= 1, (made, analyzed)
    assert all(g.q_len == g.kv_len == 512 for g in made + analyzed), (made, analyzed)


def _masks_of_heads(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) | (h == 0)


@pytest.mark.parametrize(("inner", "heads"), [(fm.sliding_window(9), 1), (_masks_of_heads, 4)])
def test_a_deferred_block_mask_is_built_by_its_first_read(inner, heads):
    """Note [Block masks built on first read]: a packed call's BlockMask tells its lengths, (B, H),
    device and mask without a build; the first read of a list builds all four, once, equal to
    create_block_mask's; `dataclasses.replace` and a copy build it first."""
    import copy
    import dataclasses

    from flexfa.blockmask.block_mask import BlockMask, DeferredBlockMask
    from flexfa.varlen import deferred_block_mask

    lens = [20, 0, 35, 1, 12]
    cu, total = _offsets(lens), sum(lens)

    def deferred():
        pack = packing(cu, cu, total, total, _CPU, defer=True)
        return deferred_block_mask(packed_mods(None, inner, pack, 4)[1], pack, 4, _CPU)

    before = packed.built["packed"]
    bm = deferred()
    assert isinstance(bm, DeferredBlockMask) and not bm.built
    assert (bm.q_len, bm.kv_len, bm.batch, bm.heads, bm.device) == (total, total, 1, heads, _CPU)
    assert (bm.num_q_blocks, bm.mask.kind) == (1, "mask_mod")
    assert packed.built["packed"] == before, "built before a list was read"
    count = bm.kv_partial.count
    assert bm.built and packed.built["packed"] == before + 1
    assert bm.q_full.index is not None and bm.kv_partial.count is count
    assert packed.built["packed"] == before + 1, "built twice"
    want = flexfa.create_block_mask(bm.mask, 1, 4, total, total)
    _same_lists(bm, want, "deferred", kernel=False)
    assert (bm.batch, bm.heads) == (want.batch, want.heads)
    for made in (dataclasses.replace(deferred()), copy.copy(deferred())):
        assert made.built if isinstance(made, DeferredBlockMask) else type(made) is BlockMask
        _same_lists(made, want, type(made).__name__, kernel=False)
