"""Reusing traces: a mod is traced again only when something it could depend on has changed.

# Note [Trace cache]
# Tracing a mod costs hundreds of microseconds (proxies, IR interning, simplification), which a
# training step calling attention dozens of times should not pay every call. A trace depends on
# the mod's code and on the values its code can reach: closure cells, globals it names, default
# arguments, and, for callable objects, their attributes. `fingerprint` summarizes those:
#   - numbers, strings, dtypes and devices by value;
#   - tensors by identity plus dtype, rank and device (a trace reads only those; the values are
#     bound at run time, and an in-place update keeps the identity);
#   - functions by their code object and, recursively, their own closures and globals;
#   - nn.Modules by their class's forward, parameters, buffers, submodules and public attributes;
#   - modules by name; tuples, lists and dicts by their contents (small ones only).
# Anything else (an arbitrary object whose attributes could change) makes the mod uncacheable and
# it is traced every call. Two closures made by the same factory with equal contents share one
# trace, so `flexfa.mods.softcap(30.0)` called twice hits the cache.
# The floats a score_mod lifts (Note [Lifted scalars] in flexfa/ir/nodes.py) enter the fingerprint
# by type only and are returned beside it, in the order of the tracer's slots, so
# `softcap(30.0)` and `softcap(50.0)` share one trace and differ only in `TracedMod.scalar_values`.
"""

from __future__ import annotations

import collections
import enum
import functools
import threading
import types
from collections.abc import Hashable
from typing import Any

import torch

_MAX_PARTS = 512
_MAX_ITEMS = 64
_MAX_DEPTH = 6


class Uncacheable(Exception):
    """The mod reaches a value whose effect on the trace cannot be summarized."""


@functools.lru_cache(maxsize=4096)
def _code_names(code: types.CodeType) -> tuple[str, ...]:
    """Global names a code object (and the code nested in it) can read."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_code_names(const))
    return tuple(dict.fromkeys(names))


_SCALARS = (bool, int, float, complex, str, bytes)
_ATOMS = (torch.dtype, torch.device, enum.Enum, type)


class _Fingerprint:
    """Walks what a mod can reach and records it (see Note [Trace cache])."""

    __slots__ = ("lift", "parts", "scalars", "seen")

    def __init__(self, lift: bool = False) -> None:
        self.parts: list[Hashable] = []
        self.seen: set[int] = set()
        self.lift = lift
        self.scalars: list[float] = []

    def maybe_lifted(self, v: Any, depth: int) -> None:
        """A value at a lift site (Note [Lifted scalars]): floats by type, others by value."""
        if type(v) is float:
            self.add("lifted float")
            self.scalars.append(v)
        else:
            self.value(v, depth)

    def sites(self, values: Any, depth: int) -> None:
        """A tuple or dict of lift sites (defaults, kwdefaults, partial arguments)."""
        if isinstance(values, dict):
            self.add(("dict", len(values)))
            for k, v in values.items():
                self.add(k)
                self.maybe_lifted(v, depth)
        else:
            self.add((tuple, len(values)))
            for v in values:
                self.maybe_lifted(v, depth)

    def add(self, item: Hashable) -> None:
        self.parts.append(item)
        if len(self.parts) > _MAX_PARTS:
            raise Uncacheable("too much reachable state")

    def function(self, f: Any, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise Uncacheable("nested too deeply")
        if id(f) in self.seen:
            self.add(("seen", id(f)))
            return
        self.seen.add(id(f))
        code = getattr(f, "__code__", None)
        lift = self.lift and depth == 0  # only the mod's own sites (see lift_sites)
        if code is not None:
            self.add(code)
            for cell in f.__closure__ or ():
                try:
                    contents = cell.cell_contents
                except ValueError:  # an empty cell
                    self.add("empty cell")
                    continue
                if lift:
                    self.maybe_lifted(contents, depth + 1)
                else:
                    self.value(contents, depth + 1)
            glob = f.__globals__
            for name in _code_names(code):
                if name in glob:
                    self.add(name)
                    self.value(glob[name], depth + 1)
            for values in (f.__defaults__, f.__kwdefaults__):
                if values and lift:
                    self.sites(values, depth + 1)
                elif values:
                    self.value(values, depth + 1)
        elif isinstance(f, functools.partial):
            self.add("partial")
            self.function(f.func, depth + 1)
            if lift:
                self.sites(f.args, depth + 1)
                self.sites(f.keywords, depth + 1)
            else:
                self.value(f.args, depth + 1)
                self.value(f.keywords, depth + 1)
        elif isinstance(f, types.MethodType):
            self.add("method")
            self.function(f.__func__, depth + 1)
            self.value(f.__self__, depth + 1)
        elif isinstance(f, torch.nn.Module):
            # A module's forward, its parameters and buffers (by identity), submodules and public
            # attributes; hooks could change what a call does, so a module with hooks is not kept.
            if f._forward_hooks or f._forward_pre_hooks:
                raise Uncacheable("a module with forward hooks")
            self.add(("module", type(f)))
            self.function(type(f).forward, depth + 1)
            for name, item in vars(f).items():
                if name in ("_parameters", "_buffers", "_modules") or not name.startswith("_"):
                    self.add(name)
                    self.value(item, depth + 1)
        elif callable(f) and hasattr(f, "__dict__"):
            self.add(("callable", type(f)))
            self.value(vars(f), depth + 1)
        else:
            raise Uncacheable(f"cannot summarize {type(f).__name__}")

    def value(self, v: Any, depth: int) -> None:
        if v is None or isinstance(v, _SCALARS):
            self.add((type(v), v))
        elif isinstance(v, torch.Tensor):
            self.add(("tensor", id(v), v.dtype, v.ndim, v.device))
        elif isinstance(v, _ATOMS):
            self.add(v)
        elif isinstance(v, types.ModuleType):
            self.add(("module", v.__name__))
        elif isinstance(v, (tuple, list)):
            if len(v) > _MAX_ITEMS:
                raise Uncacheable("a long sequence")
            self.add((type(v), len(v)))
            for item in v:
                self.value(item, depth + 1)
        elif isinstance(v, dict):
            if len(v) > _MAX_ITEMS:
                raise Uncacheable("a large dict")
            self.add(("dict", len(v)))
            for k, item in v.items():
                self.value(k, depth + 1)
                self.value(item, depth + 1)
        elif callable(v):
            self.function(v, depth + 1)
        else:
            raise Uncacheable(f"a {type(v).__name__} is reachable from the mod")


def fingerprint(fn: Any) -> tuple:
    """A hashable summary of what tracing `fn` can depend on (see Note [Trace cache])."""
    walker = _Fingerprint()
    walker.function(fn, 0)
    return tuple(walker.parts)


def lifting_fingerprint(fn: Any) -> tuple[tuple, tuple[float, ...]]:
    """`fingerprint` with the mod's liftable floats by type, and their values in slot order."""
    walker = _Fingerprint(lift=True)
    walker.function(fn, 0)
    return tuple(walker.parts), tuple(walker.scalars)


class TraceCache:
    """An LRU map from (kind, device, fingerprint) to traced mods."""

    def __init__(self, size: int = 512) -> None:
        self.size = size
        self._entries: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.uncacheable = 0

    def key(
        self, fn: Any, kind: str, device: torch.device | None, lift: bool = False
    ) -> tuple[tuple | None, tuple[float, ...]]:
        """The cache key of `fn`, and the values of its lifted floats (with `lift`)."""
        try:
            if lift:
                parts, scalars = lifting_fingerprint(fn)
                return (kind, str(device), parts), scalars
            return (kind, str(device), fingerprint(fn)), ()
        except (Uncacheable, RecursionError):
            return None, ()

    def get(self, key: tuple | None):
        if key is None:
            self.uncacheable += 1
            return None
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
            return hit

    def put(self, key: tuple | None, value: Any) -> None:
        if key is None:
            return
        with self._lock:
            self._entries[key] = value
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


traces = TraceCache()
