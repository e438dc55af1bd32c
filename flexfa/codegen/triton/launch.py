"""Launching generated kernels: a launch as data, and the first-launch compile log."""

from __future__ import annotations

import dataclasses
import logging
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


def launch(kl: KernelLaunch) -> None:
    """Run a launch, logging the first launch of each specialization if it takes long (a compile)."""
    run = lambda: kl.kernel[kl.grid](
        *kl.args, num_warps=kl.num_warps, num_stages=kl.num_stages, **kl.constexprs
    )
    fast_key = (
        id(kl.kernel),
        kl.num_warps,
        kl.num_stages,
        kl.key.dtype,
        kl.key.config,
        kl.key.constexprs,
    )
    run_logged(fast_key, kl.label, run)
