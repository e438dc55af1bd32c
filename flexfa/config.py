"""Run-time configuration, read lazily from the environment.

Nothing is read at import time. Each setting is looked up when used, so a test or a user can change
the environment, or use `config.override(...)`, at any point.

| variable | meaning | default |
| --- | --- | --- |
| FLEXFA_CACHE_DIR | where generated kernel sources and tuning results are kept (docs/cache.md; an unusable or shared directory is replaced by a private one, see flexfa/runtime/diskcache.py) | the user cache dir |
| FLEXFA_VERIFY_IR | check IR invariants after every pass | on under pytest |
| FLEXFA_DUMP_IR | a directory: write each traced mod's IR there | unset |
| FLEXFA_AUTOTUNE | benchmark kernel configs on first use (GPU only) | 0 |
| FLEXFA_LOG_COMPILES | log every kernel compile at INFO level (long ones are always logged) | 0 |
| FLEXFA_CONCURRENT_COMPILE | compile a cold backward's kernels on a thread pool, starting with the first forward that needs a backward | 1 |
| FLEXFA_COMPILE_WORKERS | processes that do those background compiles (Note [Compile workers]; 0 compiles on the threads) | 4, at most the CPU count less one |
| FLEXFA_DIRECT_LAUNCH | after a kernel's first launch, launch it without Triton's per-call argument binding (Note [Direct launches]; 0 always goes through Triton's launcher) | 1 |
| FLEXFA_FA4_DISK_CACHE | keep FA4 kernels compiled with flexfa's generated mods in the cache directory, for later processes (Note [FA4 kernels on disk]) | 1 |
| FLEXFA_FA4_VARLEN | run packed calls that the fa4 backend takes on FA4's varlen kernels (Note [Packed calls on FA4's varlen path]); 0 keeps them on the concatenation | 1 |
| FLEXFA_FUSED_BLOCK_MASK | build block masks with one generated kernel: `auto` (on CUDA), `1` (also on the CPU under TRITON_INTERPRET=1, for tests), `0` (never) | auto |
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _flag_value(value: str) -> bool:
    return value.strip().lower() not in ("0", "false", "no", "off")


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return _flag_value(value)


def _user_cache_dir() -> Path:
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = str(Path.home() / "Library" / "Caches")
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flexfa"


class Config:
    """The settings; `flexfa.config` is the one instance."""

    def __init__(self) -> None:
        self._overrides: dict[str, Any] = {}

    def _get(self, key: str, compute):
        if key in self._overrides:
            return self._overrides[key]
        return compute()

    @property
    def cache_dir(self) -> Path:
        return Path(
            self._get(
                "cache_dir", lambda: os.environ.get("FLEXFA_CACHE_DIR") or str(_user_cache_dir())
            )
        )

    def cache_dir_token(self) -> str | None:
        """What decides `cache_dir`, without building a path (cheap enough for every call)."""
        return self._overrides.get("cache_dir") or os.environ.get("FLEXFA_CACHE_DIR")

    @property
    def verify_ir(self) -> bool:
        return self._get(
            "verify_ir",
            lambda: _flag("FLEXFA_VERIFY_IR", "PYTEST_CURRENT_TEST" in os.environ),
        )

    @property
    def dump_ir(self) -> Path | None:
        value = self._get("dump_ir", lambda: os.environ.get("FLEXFA_DUMP_IR") or None)
        return Path(value) if value else None

    @property
    def autotune(self) -> bool:
        return self._get("autotune", lambda: _flag("FLEXFA_AUTOTUNE", False))

    @property
    def log_compiles(self) -> bool:
        return self._get("log_compiles", lambda: _flag("FLEXFA_LOG_COMPILES", False))

    @property
    def fused_block_mask(self) -> str:
        """ "auto", "on" or "off" (see flexfa/codegen/triton/blockmask/fused.py)."""
        value = self._get("fused_block_mask", lambda: os.environ.get("FLEXFA_FUSED_BLOCK_MASK"))
        if value is None or str(value).strip().lower() in ("", "auto"):
            return "auto"
        return "on" if _flag_value(str(value)) else "off"

    @property
    def concurrent_compile(self) -> bool:
        """Compile independent kernels on a thread pool (Note [Concurrent compiles])."""
        return self._get("concurrent_compile", lambda: _flag("FLEXFA_CONCURRENT_COMPILE", True))

    @property
    def compile_workers(self) -> int:
        """Processes that compile kernels in the background (Note [Compile workers])."""

        def compute() -> int:
            value = os.environ.get("FLEXFA_COMPILE_WORKERS", "").strip()
            if value:
                try:
                    return max(0, int(value))
                except ValueError:
                    raise ValueError(
                        f"FLEXFA_COMPILE_WORKERS must be a number of processes, got {value!r}"
                    ) from None
            return min(4, max(1, (os.cpu_count() or 2) - 1))

        return self._get("compile_workers", compute)

    @property
    def direct_launch(self) -> bool:
        """Launch compiled Triton kernels directly after their first launch (Note [Direct
        launches]); read when a kernel's launcher is made."""
        return self._get("direct_launch", lambda: _flag("FLEXFA_DIRECT_LAUNCH", True))

    @property
    def fa4_disk_cache(self) -> bool:
        """Keep FA4 kernels compiled with flexfa's mods on disk (Note [FA4 kernels on disk])."""
        return self._get("fa4_disk_cache", lambda: _flag("FLEXFA_FA4_DISK_CACHE", True))

    @property
    def fa4_direct(self) -> bool:
        """Call FA4's compiled forward kernel directly once a call's arguments are known (Note
        [Direct FA4 launches] in flexfa/codegen/cute/direct.py)."""
        return self._get("fa4_direct", lambda: _flag("FLEXFA_FA4_DIRECT", True))

    @property
    def fa4_varlen(self) -> bool:
        """Packed calls on FA4's varlen kernels (Note [Packed calls on FA4's varlen path])."""
        return self._get("fa4_varlen", lambda: _flag("FLEXFA_FA4_VARLEN", True))

    @property
    def fa4_documents(self) -> bool:
        """Document masks on FA4's varlen kernels (Note [Document masks on FA4's varlen kernels]
        in flexfa/codegen/cute/plan.py); off by default: not measured faster (docs/cute.md)."""
        return self._get("fa4_documents", lambda: _flag("FLEXFA_FA4_DOCUMENTS", False))

    @property
    def triton_interpret(self) -> bool:
        return self._get("triton_interpret", lambda: _flag("TRITON_INTERPRET", False))

    @contextlib.contextmanager
    def override(self, **settings: Any) -> Iterator[None]:
        """Temporarily set settings, e.g. `with flexfa.config.override(autotune=False): ...`."""
        for key in settings:
            if not isinstance(getattr(type(self), key, None), property):
                raise AttributeError(f"unknown flexfa setting {key!r}")
        saved = dict(self._overrides)
        self._overrides.update(settings)
        try:
            yield
        finally:
            self._overrides = saved


config = Config()
