"""The generated module's gradient helpers (`flexfa_atomic_add_uniform`, `flexfa_atomic_add_warp`,
Note [Captured gradients in the FA4 backward]) run on the CPU by a model of one warp: 32 Python
threads execute the helpers' source, one lane each, with scalar values; the warp votes, shuffles
and reductions meet at a barrier. A lane that skipped a collective the others reached would leave
the barrier waiting: the model fails on a timeout, so the tests also check that the helpers call
their collectives outside lane-dependent branches. The atomics are logged per lane."""

from __future__ import annotations

import threading
import types
from collections import defaultdict

import pytest
import torch

from flexfa.codegen.cute import module as cmodule
from flexfa.frontend import trace_score_mod

WARP = 32


class _Warp:
    """The collectives of one warp: each lane posts its value, all wait, each reads all values."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(WARP, timeout=5)
        self.posted: list = [None] * WARP
        self.local = threading.local()
        self.atomics: list[tuple[int, int, float]] = []  # (lane, offset, value)
        self.lock = threading.Lock()

    @property
    def lane(self) -> int:
        return self.local.lane

    def exchange(self, value) -> list:
        self.barrier.wait()
        self.posted[self.lane] = value
        self.barrier.wait()
        values = list(self.posted)
        self.barrier.wait()
        return values

    def run(self, fn, args_per_lane) -> None:
        errors = []

        def lane(i: int) -> None:
            self.local.lane = i
            try:
                fn(*args_per_lane[i])
            except BaseException as e:  # a broken barrier: some lane skipped a collective
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=lane, args=(i,)) for i in range(WARP)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]


class _Pointer:
    def __init__(self, warp: _Warp, offset: int = 0) -> None:
        self.warp, self.offset = warp, offset

    def __add__(self, k: int) -> _Pointer:
        return _Pointer(self.warp, self.offset + int(k))


class _Buffer:
    """A row-major gradient buffer as the helpers see it: `.iterator`, `.layout` (its shape)."""

    def __init__(self, warp: _Warp, shape: tuple[int, ...]) -> None:
        self.iterator, self.layout = _Pointer(warp), shape


class _Fragment(list):
    @property
    def shape(self) -> tuple[int]:
        return (len(self),)


def _crd2idx(coord, shape) -> int:
    coord = coord if isinstance(coord, tuple) else (coord,)
    index = 0
    for c, n in zip(coord, shape):
        index = index * n + int(c)
    return index


def _helpers(warp: _Warp) -> types.SimpleNamespace:
    """The generated module's helper functions, executed with a model of the CuTe DSL."""
    arch = types.SimpleNamespace(
        lane_idx=lambda: warp.lane,
        lanemask_lt=lambda: (1 << warp.lane) - 1,
        vote_ballot_sync=lambda p: sum(1 << i for i, x in enumerate(warp.exchange(bool(p))) if x),
        vote_all_sync=lambda p: all(warp.exchange(bool(p))),
        warp_redux_sync=lambda v, kind: {"min": min, "max": max}[kind](warp.exchange(v)),
        warp_reduction_sum=lambda v: sum(warp.exchange(v)),
    )
    cute = types.SimpleNamespace(
        jit=lambda f: f, arch=arch, size=lambda shape: shape[0], crd2idx=_crd2idx
    )
    cutlass = types.SimpleNamespace(
        Int32=int,
        Uint32=lambda x: int(x) & 0xFFFFFFFF,
        Float32=float,
        Boolean=bool,
        const_expr=lambda x: x,
        range_constexpr=range,
    )

    def atomic_add_fp32(value, pointer) -> None:
        with warp.lock:
            warp.atomics.append((warp.lane, pointer.offset, float(value)))

    def elem_pointer(buffer, coord):
        return buffer.iterator + _crd2idx(coord, buffer.layout)

    slopes = torch.rand(4, requires_grad=True)
    traced = trace_score_mod(lambda s, b, h, q_idx, kv_idx: s + slopes[h])
    source = cmodule.render(traced, None, traced.grad_slots()).source
    body = "\n".join(
        line for line in source.splitlines() if not line.startswith(("import", "from"))
    )
    namespace = {
        "cute": cute,
        "cutlass": cutlass,
        "atomic_add_fp32": atomic_add_fp32,
        "elem_pointer": elem_pointer,
    }
    exec(compile(body, "<generated module>", "exec"), namespace)
    return types.SimpleNamespace(**namespace)


def _sums(atomics) -> dict[int, float]:
    out: dict[int, float] = defaultdict(float)
    for _, offset, value in atomics:
        out[offset] += value
    return dict(out)


def _expected(values, offsets) -> dict[int, float]:
    out: dict[int, float] = defaultdict(float)
    for vs, os in zip(values, offsets):
        for v, o in zip(vs, os):
            if v != 0.0:
                out[o] += v
    return dict(out)


def _warp_add(values, offsets, shape=(4, 64)):
    """Each lane calls flexfa_atomic_add_warp with its elements; the atomics issued."""
    warp = _Warp()
    h = _helpers(warp)
    buffer = _Buffer(warp, shape)
    warp.run(
        h.flexfa_atomic_add_warp,
        [(_Fragment(v), _Fragment(o), buffer) for v, o in zip(values, offsets)],
    )
    return warp.atomics


@pytest.mark.parametrize("n", [1, 4])
def test_one_atomic_where_every_adding_element_shares_an_offset(n):
    # Lanes 0..2 and every fourth element add nothing; their offsets are junk and must not count.
    values = [
        [0.0 if lane < 3 or e == 3 else float(lane + e) for e in range(n)] for lane in range(32)
    ]
    offsets = [[7 if v else 1000 + lane for v in vs] for lane, vs in enumerate(values)]
    atomics = _warp_add(values, offsets)
    assert len(atomics) == 1 and atomics[0][0] == 3, atomics  # the lowest adding lane
    assert _sums(atomics) == _expected(values, offsets)


def test_one_atomic_per_adding_element_where_offsets_differ():
    values = [[float(lane + 1), 0.0, float(lane + 2), 1.0] for lane in range(32)]
    offsets = [[lane, 5, lane + 1, 200] for lane in range(32)]
    atomics = _warp_add(values, offsets)
    # The lanes' elements differ, so each element goes alone; the last element of every lane
    # shares offset 200, so the warp adds it once.
    assert len(atomics) == 32 * 2 + 1, len(atomics)
    assert _sums(atomics) == _expected(values, offsets)


def test_calls_whose_elements_share_an_offset_sum_before_the_warp_step():
    # Every lane's adding elements share one offset, but lanes differ: one atomic per lane.
    values = [[1.0, 2.0, 0.0, 3.0] for _ in range(32)]
    offsets = [[lane % 5, lane % 5, 99, lane % 5] for lane in range(32)]
    atomics = _warp_add(values, offsets)
    assert len(atomics) == 32 and all(v == 6.0 for _, _, v in atomics), atomics
    assert _sums(atomics) == _expected(values, offsets)


def test_nothing_added_issues_nothing():
    values = [[0.0] * 4 for _ in range(32)]
    offsets = [[lane, -lane, 3, 1 << 30] for lane in range(32)]
    assert _warp_add(values, offsets) == []


def test_uniform_add_sums_the_warp_into_one_atomic():
    warp = _Warp()
    h = _helpers(warp)
    buffer = _Buffer(warp, (4,))
    warp.run(h.flexfa_atomic_add_uniform, [(float(lane), buffer, 2) for lane in range(32)])
    assert warp.atomics == [(0, 2, float(sum(range(32))))]
    warp = _Warp()
    h = _helpers(warp)
    warp.run(h.flexfa_atomic_add_uniform, [(0.0, _Buffer(warp, (4,)), 2) for _ in range(32)])
    assert warp.atomics == []


def test_the_model_catches_a_collective_under_a_lane_dependent_branch():
    """The check the tests above rely on: a helper that votes in only some lanes fails."""
    warp = _Warp()
    warp.barrier = threading.Barrier(WARP, timeout=0.5)
    h = _helpers(warp)

    def divergent(value):
        if value > 0:  # lanes 1..31 only
            h.cute.arch.vote_all_sync(True)

    with pytest.raises(AssertionError):
        warp.run(divergent, [(float(lane),) for lane in range(32)])
