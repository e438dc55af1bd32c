"""FA4's compiled forward kernel called directly, without FA4's per-call Python.

# Note [Direct FA4 launches]
# FA4's `_flash_attn_fwd` runs several hundred lines of Python per call (argument checks, tile,
# scheduler and block-sparse choices, its compile key) before its compiled kernel takes the
# call's tensors through TVM-FFI. On the H200's host that Python took 77-333 µs per forward
# (causal to document-causal, B=2, H=16, N=8192, three runs), and calling the compiled kernel with
# the same arguments 7-12 µs; the document-causal forward runs 0.30 ms on the GPU, so FA4's Python set its
# speed (docs/performance.md). A flexfa call repeats: a planned call gets tensors of the same
# sizes, strides and dtypes each time, and only their addresses and the lifted scalars' values
# change. So `launch` records, through FA4's wrapped compile caches (`jitcache.recording`), which
# compiled functions FA4 calls and with what, and turns every argument into a template:
#   - a tensor is one of the call's own (q, k, v, out, lse, offsets, block lists), found by its
#     address and dtype, as it is or seen with other sizes and strides (FA4 broadcasts block
#     lists over heads);
#   - the aux scalars are the call's own tuple (lifted floats, captured tensors' addresses);
#   - None, bools, ints, floats and strings are constants;
#   - tuples and FA4's NamedTuples hold templates.
# Anything else (a tensor FA4 made itself, such as scheduler metadata or a workspace; an object of
# another type; no compiled call at all, as for an empty input) means the call is not replayed
# and FA4's entry point runs every time. FA4's varlen forward is such a call: wherever it gets
# cu_seqlens_k (packed calls, Note [Packed calls on FA4's varlen path] in backend.py, and document
# masks run per batch row) it allocates a workspace for per-CTA copies of V's TMA descriptor on
# every call and hands it to its kernel, so those calls always take FA4's entry point (the
# signature is then marked once, and no call records again). A template holds no tensor. It is used only once two
# calls with the same launch signature recorded equal templates (the same compiled functions,
# the same constants): from the third call on, flexfa calls those functions itself with the new
# call's tensors and scalars in their places, and FA4's entry point is skipped. The signature
# holds everything FA4's Python reads besides data: each tensor's sizes, strides, dtype, device and
# 16-byte alignment, which tensors share an address, the scale, the mask lowering, the generated
# hooks, the longest sequences of a varlen call, the arch and the block-list block size. Settings
# FA4 reads from the environment are not in it: a change of them within a process does not reach
# calls already replayed (as FA4's own compile cache keeps its kernels for settings outside its
# key).
# The backward is not replayed: FA4's backward allocates its own workspaces for each call, which a
# template of the call's tensors cannot describe, and its kernels run longer than its Python.
# FLEXFA_FA4_DIRECT=0 turns this off.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from flexfa.codegen.cute import jitcache
from flexfa.config import config

_CONSTANT_TYPES = (type(None), bool, int, float, str)
_MAX_SIGNATURES = 512

#: How forwards were launched in this process: "direct" (the compiled kernel called by flexfa),
#: "fa4" (through FA4's entry point). For tests and benchmarks.
counts: collections.Counter = collections.Counter()


class _NotReplayable(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class _Const:
    value: Any
    kind: type  # 1, 1.0 and True are equal in Python, not as arguments


@dataclasses.dataclass(frozen=True)
class _Tensor:
    role: str
    view: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # FA4's (sizes, strides) of it


@dataclasses.dataclass(frozen=True)
class _Tuple:
    kind: type
    items: tuple


class _Scalars:
    """The place of the call's aux scalars."""


_SCALARS = _Scalars()


class Replay:
    """The compiled calls FA4 made for one launch signature, as templates, and ready to be made
    again with another call's tensors and scalars."""

    def __init__(self, calls: tuple[tuple[Callable, tuple, tuple], ...]):
        self.calls = calls  # (function, args, sorted kwargs), as templates
        self._steps = []
        for fn, args, kwargs in calls:
            makers = [_maker(a) for a in args]
            fixed = [a.value if m is None else None for a, m in zip(args, makers)]
            places = [(i, m) for i, m in enumerate(makers) if m is not None]
            named = [(n, _maker(t), t.value if type(t) is _Const else None) for n, t in kwargs]
            self._steps.append((fn, fixed, places, named))

    def same_as(self, other: Replay) -> bool:
        return len(self.calls) == len(other.calls) and all(
            f is g and a == b and k == m for (f, a, k), (g, b, m) in zip(self.calls, other.calls)
        )

    def run(self, tensors: Mapping[str, torch.Tensor], scalars: tuple | None) -> None:
        for fn, fixed, places, kwargs in self._steps:
            args = fixed.copy()
            for i, make in places:
                args[i] = make(tensors, scalars)
            if kwargs:  # FA4 passes none today; kept general
                fn(*args, **{n: m(tensors, scalars) if m else v for n, m, v in kwargs})
            else:
                fn(*args)


@dataclasses.dataclass(frozen=True, eq=False)
class _SeenOnce:
    replay: Replay


# signature -> _SeenOnce (recorded once), Replay (in use) or str (why FA4's entry point runs)
_plans: dict[tuple, _SeenOnce | Replay | str] = {}


def signature(tensors: Mapping[str, torch.Tensor], scalars: tuple | None, extra: tuple) -> tuple:
    """What FA4's Python reads of a call besides data (Note [Direct FA4 launches])."""
    layout, addresses = [], []
    for t in tensors.values():
        address = t.data_ptr()
        layout.append((t.shape, t.stride(), t.dtype, t.device, address & 15))
        addresses.append(address)
    shared = tuple(addresses.index(a) for a in addresses)
    types = None if scalars is None else tuple(map(type, scalars))
    return (tuple(tensors), tuple(layout), shared, types, extra)


def launch(
    tensors: Mapping[str, torch.Tensor],
    scalars: tuple | None,
    through_fa4: Callable[[], Any],
    extra: tuple,
) -> None:
    """Run one FA4 forward: FA4's compiled calls replayed with `tensors` and `scalars` where
    two earlier calls of the same signature recorded the same ones, else `through_fa4()`, FA4's
    entry point, which writes into the same `tensors` (Note [Direct FA4 launches])."""
    # Fake tensors (an offline compile) and other subclasses of the caller's q, k and v take FA4's
    # own path.
    user = tensors["q"], tensors["k"], tensors["v"]
    if not config.fa4_direct or any(type(t) is not torch.Tensor for t in user):
        counts["fa4"] += 1
        through_fa4()
        return
    key = signature(tensors, scalars, extra)
    plan = _plans.get(key)
    if type(plan) is Replay:
        counts["direct"] += 1
        plan.run(tensors, scalars)
        return
    counts["fa4"] += 1
    if type(plan) is str:
        through_fa4()
        return
    with jitcache.recording() as calls:
        through_fa4()
    try:
        recorded = _replay(calls, tensors, scalars)
    except _NotReplayable as e:
        _remember(key, str(e))
        return
    finally:
        del calls  # the recorded arguments hold the call's tensors
    if plan is None:
        _remember(key, _SeenOnce(recorded))
    elif plan.replay.same_as(recorded):
        _remember(key, plan.replay)
    else:
        _remember(key, "FA4 made other calls for the same signature")


def why_not(tensors: Mapping[str, torch.Tensor], scalars: tuple | None, extra: tuple) -> str | None:
    """Why calls of this signature go through FA4's entry point (None: replayed, or not yet
    decided)."""
    plan = _plans.get(signature(tensors, scalars, extra))
    return plan if type(plan) is str else None


def reset() -> None:
    """Forget every recorded call (tests)."""
    _plans.clear()
    counts.clear()


def _remember(key: tuple, plan: _SeenOnce | Replay | str) -> None:
    if key not in _plans and len(_plans) >= _MAX_SIGNATURES:
        _plans.pop(next(iter(_plans)))
    _plans[key] = plan


def _replay(calls: list, tensors: Mapping[str, torch.Tensor], scalars: tuple | None) -> Replay:
    if not calls:
        raise _NotReplayable("FA4 called no compiled kernel")
    return Replay(
        tuple(
            (
                fn,
                tuple(_template(a, tensors, scalars) for a in args),
                tuple((n, _template(a, tensors, scalars)) for n, a in sorted(kwargs.items())),
            )
            for fn, args, kwargs in calls
        )
    )


def _template(arg: Any, tensors: Mapping[str, torch.Tensor], scalars: tuple | None) -> Any:
    if scalars is not None and arg is scalars:
        return _SCALARS
    if isinstance(arg, torch.Tensor):
        return _tensor(arg, tensors)
    if type(arg) in _CONSTANT_TYPES:
        return _Const(arg, type(arg))
    if type(arg) is tuple or (isinstance(arg, tuple) and hasattr(type(arg), "_fields")):
        return _Tuple(type(arg), tuple(_template(a, tensors, scalars) for a in arg))
    raise _NotReplayable(f"FA4 passed its kernel an argument of type {type(arg).__name__}")


def _tensor(arg: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> _Tensor:
    address, found = arg.data_ptr(), None
    for role, t in tensors.items():
        if t.data_ptr() != address or t.dtype != arg.dtype or t.device != arg.device:
            continue
        if t.shape == arg.shape and t.stride() == arg.stride():
            return _Tensor(role)
        found = found or _Tensor(role, (tuple(arg.shape), tuple(arg.stride())))
    if found is None:
        raise _NotReplayable(
            f"FA4 passed its kernel a tensor of its own (sizes {tuple(arg.shape)}, {arg.dtype})"
        )
    return found


class _View:
    """Makes FA4's view of one of the call's tensors; the view of the last tensor it was given is
    kept (block lists are the same tensors from call to call), as one (tensor, view) pair that
    threads replace whole."""

    __slots__ = ("last", "role", "size", "stride")

    def __init__(self, role: str, size: tuple[int, ...], stride: tuple[int, ...]):
        self.role, self.size, self.stride = role, size, stride
        self.last: tuple = (None, None)

    def __call__(self, tensors: Mapping[str, torch.Tensor], scalars: tuple | None) -> torch.Tensor:
        x = tensors[self.role]
        source, view = self.last
        if source is not x:
            view = x.as_strided(self.size, self.stride)
            self.last = (x, view)
        return view


def _maker(t: Any) -> Callable | None:
    """A function of (tensors, scalars) that makes the argument template `t` stands for; None
    when it is a constant (`_Const`)."""
    kind = type(t)
    if kind is _Const:
        return None
    if kind is _Tensor:
        if t.view is not None:
            return _View(t.role, *t.view)
        role = t.role
        return lambda tensors, scalars: tensors[role]
    if kind is _Tuple:
        makers = [_maker(i) for i in t.items]
        if all(m is None for m in makers):
            value = tuple(i.value for i in t.items)
            value = value if t.kind is tuple else t.kind(*value)
            return lambda tensors, scalars: value
        parts = [(m, None if m else i.value) for m, i in zip(makers, t.items)]
        build = tuple if t.kind is tuple else (lambda items, k=t.kind: k(*items))
        return lambda tensors, scalars: build([m(tensors, scalars) if m else v for m, v in parts])
    assert t is _SCALARS, t
    return lambda tensors, scalars: scalars
