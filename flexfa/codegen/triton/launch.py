"""Launching generated kernels: a launch as data, and the first-launch compile log."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any

import torch

from flexfa.codegen.triton.params import KernelKey
from flexfa.config import config

log = logging.getLogger("flexfa")

_COMPILE_LOG_SECONDS = 1.0


@dataclasses.dataclass(frozen=True, eq=False)
class KernelLaunch:
    """One kernel launch as data: which kernel, grid, arguments, constexprs and options.

    `launch()` runs it; `flexfa.codegen.triton.offline.compile_launch` compiles the same launch for
    a GPU architecture without a GPU (tests and `python -m flexfa export --ptx` use that).
    """

    name: str
    kernel: Any
    grid: tuple[int, int]
    args: tuple
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    key: KernelKey
    label: str

    def arg_names(self) -> list[str]:
        return [n for n in self.kernel.arg_names if n not in self.constexprs]


_launched: set[tuple] = set()


def run_logged(fast_key: tuple, label: str, run) -> None:
    """Call `run()` (a kernel launch); the first time for `fast_key`, time it and log it at INFO
    level if it took long (a compile) or FLEXFA_LOG_COMPILES is set, else at DEBUG level."""
    if fast_key in _launched:
        run()
        return
    start = time.perf_counter()
    run()
    if torch.cuda.is_available() and not config.triton_interpret:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    _launched.add(fast_key)
    level = (
        logging.INFO if (elapsed > _COMPILE_LOG_SECONDS or config.log_compiles) else logging.DEBUG
    )
    log.log(
        level,
        "flexfa: %s kernel ready in %.2f s (compiled or loaded on first use)",
        label,
        elapsed,
    )


# Note [Concurrent compiles]
# The first backward compiles its kernels (preprocess, dK/dV, dQ) at their first launches, one
# after another, and a cold backward took the sum of their compile times. They are independent
# (no kernel's compile needs another's), so `warm_up` compiles every kernel of a list that has not
# been launched yet at once, on a small thread pool, with Triton's `warmup` (compile with the
# exact arguments of the launch, do not run); the launches that follow find their binaries in
# Triton's cache. Triton's frontend holds the GIL, but its MLIR/LLVM passes and ptxas release it,
# which is where most of a compile goes. A warm-up that fails only costs the time it took: the
# launch compiles again and reports any error itself.
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="flexfa-compile")
        return _pool


def warm_up(launches: list[KernelLaunch]) -> None:
    """Compile the kernels of `launches` not launched before, concurrently (Note [Concurrent
    compiles]). Does nothing under TRITON_INTERPRET or for fewer than two such kernels."""
    cold = [kl for kl in launches if _fast_key(kl) not in _launched]
    if len(cold) < 2 or config.triton_interpret or not torch.cuda.is_available():
        return
    device = torch.cuda.current_device()

    def compile_one(kl: KernelLaunch) -> None:
        with torch.cuda.device(device):
            kl.kernel.warmup(
                *kl.args, grid=kl.grid, num_warps=kl.num_warps, num_stages=kl.num_stages,
                **kl.constexprs,
            )  # fmt: skip

    start = time.perf_counter()
    futures = [_executor().submit(compile_one, kl) for kl in cold]
    for kl, future in zip(cold, futures):
        try:
            future.result()
        except Exception as e:  # the launch compiles it again and raises if it must
            log.debug("flexfa: concurrent compile of %s failed: %s", kl.label, e)
    log.log(
        logging.INFO if config.log_compiles else logging.DEBUG,
        "flexfa: %d kernels compiled concurrently in %.2f s",
        len(cold),
        time.perf_counter() - start,
    )


def _fast_key(kl: KernelLaunch) -> tuple:
    return (
        id(kl.kernel),
        kl.num_warps,
        kl.num_stages,
        kl.key.dtype,
        kl.key.config,
        kl.key.constexprs,
    )


def launch(kl: KernelLaunch) -> None:
    """Run a launch, logging the first launch of each specialization if it takes long (a compile)."""
    run = lambda: kl.kernel[kl.grid](
        *kl.args, num_warps=kl.num_warps, num_stages=kl.num_stages, **kl.constexprs
    )
    run_logged(_fast_key(kl), kl.label, run)
