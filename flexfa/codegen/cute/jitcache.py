"""FA4's compiled kernels for flexfa's generated mods, kept on disk across processes.

# Note [FA4 kernels on disk]
# A first call through the "fa4" backend spends seconds in FA4's compile (the CuTe DSL traces
# FA4's kernel in Python, then MLIR, LLVM and ptxas run), every process again: FA4 keeps compiled
# kernels in memory unless FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 is set before it is imported.
# flexfa's generated hooks are the same text in every process (Note [CuTe compile cache]), so their
# kernels can be kept: each generated function carries `__cute_hash__ = "flexfa-<module digest>-
# <function>"` (FA4 takes that as the function's hash in its compile key, and the module digest
# covers the mods' IR, the gradient slots, the emitter and the flexfa / FA4 / CuTe DSL / torch
# versions), and FA4's forward and backward compile caches are wrapped, at the first fa4 call, by
# `_Routed`: a key that holds a flexfa hash is also looked up in, and written to, FA4's own
# persistent store (its `JITPersistentCache`: object files exported with `export_to_c`, written
# atomically under a file lock, an unloadable file recompiled and replaced) in flexfa's cache
# directory, `fa4/<fingerprint of FA4's sources and the CuTe DSL version>/<fwd|bwd>/`. Every other
# key (the user's own FA4 calls, torch's FLASH backend) stays in FA4's in-memory cache as before,
# so nothing changes for them. The other keys of FA4's compile key (dtypes, head dims, tile sizes,
# arch, GQA, mask flags, FA4's log level) say which kernel a file holds.
# These are compiled binaries, trusted as Triton's own binary cache is: they live in flexfa's
# private cache directory (docs/cache.md) and cannot be checked against a rendering without the
# compile the cache saves. FLEXFA_FA4_DISK_CACHE=0 keeps them in memory only (export turns it off:
# it wants the compile's PTX); with FA4's own disk cache turned on, flexfa writes nothing to disk
# (FA4 does). The same wrapper lets the fa4 backend see which compiled function FA4 calls, with
# which arguments (`recording`, Note [Direct FA4 launches] in direct.py).
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from typing import Any

from flexfa.config import config
from flexfa.runtime import diskcache

PREFIX = "flexfa-"
_installed = False
_lock = threading.Lock()


def tag(function: Any, module_digest: str, name: str) -> None:
    """Give a generated hook the hash FA4 keys its compiles by (Note [FA4 kernels on disk])."""
    if function is not None:
        function.__cute_hash__ = f"{PREFIX}{module_digest[:32]}-{name}"


def _ours(key: Any) -> bool:
    return isinstance(key, tuple) and any(type(x) is str and x.startswith(PREFIX) for x in key)


class _Routed:
    """FA4's in-memory compile cache, with flexfa's keys also kept on disk (`disk` None: in
    memory only), and the compiled functions it hands out seen by `recording`."""

    def __init__(self, memory: Any, disk: Any):
        self.memory = memory  # FA4's own cache object
        self.disk = disk  # a JITPersistentCache in flexfa's cache directory, or None

    def _on_disk(self, key: Any) -> bool:
        return self.disk is not None and _ours(key) and config.fa4_disk_cache

    def __contains__(self, key: Any) -> bool:
        if key in self.memory:
            return True
        if self._on_disk(key) and key in self.disk:  # loads the object file
            self.memory[key] = self.disk[key]
            return True
        return False

    def __getitem__(self, key: Any) -> Any:
        fn = self.memory[key]
        calls = _recorded.calls
        return fn if calls is None else _Recorder(fn, calls)

    def __setitem__(self, key: Any, fn: Any) -> None:
        self.memory[key] = fn
        if self._on_disk(key):
            self.disk[key] = fn  # exports the object file

    def clear(self) -> None:
        self.memory.clear()

    def __getattr__(self, name: str) -> Any:  # the rest of FA4's cache object (e.g. `.cache`)
        return getattr(self.memory, name)


class _Recorded(threading.local):
    calls: list | None = None


_recorded = _Recorded()


class _Recorder:
    """A compiled FA4 function that notes each call's arguments before making it."""

    def __init__(self, fn: Any, calls: list):
        self.fn, self.calls = fn, calls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((self.fn, args, kwargs))
        return self.fn(*args, **kwargs)


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """The compiled functions FA4's entry points call in this thread inside the block, with their
    arguments, as a list of (function, args, kwargs) (Note [Direct FA4 launches] in direct.py).
    Empty where FA4's caches are not wrapped (`install`)."""
    saved, calls = _recorded.calls, []
    _recorded.calls = calls
    try:
        yield calls
    finally:
        _recorded.calls = saved


def install() -> None:
    """Wrap FA4's forward and backward compile caches (once per process; Note [FA4 kernels on
    disk]), on disk where flexfa's cache directory and FA4's internals allow, in memory
    otherwise. Imports flash_attn."""
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        _installed = True
        from flash_attn.cute import cache_utils, interface

        on_disk = {"fwd": interface._flash_attn_fwd, "bwd": interface._flash_attn_bwd}
        disks = {}
        root = diskcache.directory("fa4")
        # With FA4's own disk cache on, FA4 keeps everything on disk itself.
        if root is not None and not cache_utils.CUTE_DSL_CACHE_ENABLED:
            try:  # FA4's internals, as of the pinned versions
                path = root / cache_utils._compute_source_fingerprint()[:24]
                disks = {
                    id(fn): cache_utils.JITPersistentCache(path / name)
                    for name, fn in on_disk.items()
                }
            except (AttributeError, OSError) as e:
                diskcache.warn(
                    "flexfa: FA4 kernels stay in memory for this process (cannot keep them on "
                    f"disk: {e})",
                    once=("fa4-disk", type(e).__name__),
                )
        # Every compiled-kernel cache of FA4's entry points, so that `recording` sees every
        # kernel they call (Note [Direct FA4 launches] in direct.py).
        for fn in [*on_disk.values(), *_functions(interface)]:
            cache = getattr(fn, "compile_cache", None)
            if cache is not None and not isinstance(cache, _Routed):
                fn.compile_cache = _Routed(cache, disks.get(id(fn)))


def _functions(module: Any) -> list:
    return [x for x in vars(module).values() if isinstance(x, types.FunctionType)]


def reset() -> None:
    """Unwrap FA4's caches (tests)."""
    global _installed
    with _lock:
        if "flash_attn.cute.interface" in __import__("sys").modules:
            from flash_attn.cute import interface

            for fn in [
                interface._flash_attn_fwd,
                interface._flash_attn_bwd,
                *_functions(interface),
            ]:
                if isinstance(getattr(fn, "compile_cache", None), _Routed):
                    fn.compile_cache = fn.compile_cache.memory
        _installed = False
