"""Autotuning: benchmark a small config space on the real inputs, remember the winner on disk.

Off by default (compiling every candidate takes seconds each); turn it on per call with
`kernel_options={"autotune": True}` or for a process with FLEXFA_AUTOTUNE=1. Results are stored in
`FLEXFA_CACHE_DIR/triton/tuning.json` and reused by every later call and process with the same key
(module, GPU, dtype, head dims, block sizes and the power-of-two bucket of the lengths), tuned or
not. A config pinned in `kernel_options` always wins. A damaged tuning file is ignored with a
warning and rewritten (docs/cache.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable

import torch

from flexfa.codegen.triton import configs as cfgs
from flexfa.codegen.triton.params import BwdConfig, FwdConfig

log = logging.getLogger("flexfa")


def fwd_candidates(
    capability: tuple[int, int], head_dim: int, dtype: torch.dtype
) -> list[FwdConfig]:
    if dtype == torch.float32:
        return [FwdConfig(64, 32, 4, 2), FwdConfig(32, 64, 4, 2), FwdConfig(64, 64, 4, 1)]
    if head_dim <= 64:
        return [
            FwdConfig(128, 128, 4, 3),
            FwdConfig(128, 64, 4, 3),
            FwdConfig(128, 128, 8, 3),
            FwdConfig(64, 128, 4, 3),
        ]
    if head_dim <= 128:
        return [
            FwdConfig(128, 64, 8, 3),
            FwdConfig(128, 64, 4, 3),
            FwdConfig(128, 128, 8, 2),
            FwdConfig(64, 64, 4, 3),
        ]
    return [FwdConfig(64, 32, 4, 3), FwdConfig(64, 64, 4, 2), FwdConfig(128, 32, 8, 2)]


def bwd_candidates(
    capability: tuple[int, int], head_dim: int, dtype: torch.dtype
) -> list[BwdConfig]:
    if dtype == torch.float32:
        return [BwdConfig(32, 32, 32, 32, 4, 1), BwdConfig(32, 64, 64, 32, 4, 1)]
    if head_dim <= 64:
        return [
            BwdConfig(64, 64, 64, 64, 4, 3),
            BwdConfig(64, 128, 128, 64, 8, 3),
            BwdConfig(32, 128, 128, 32, 4, 3),
        ]
    if head_dim <= 128:
        return [
            BwdConfig(64, 128, 128, 64, 8, 3),
            BwdConfig(64, 64, 64, 64, 4, 3),
            BwdConfig(64, 128, 128, 64, 8, 2),
        ]
    return [BwdConfig(32, 64, 64, 32, 4, 2), BwdConfig(64, 64, 64, 64, 8, 1)]


def bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tuning_key(module_digest: str, device: torch.device, spec) -> str:
    """The key tuned results are stored under."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    fields = (
        module_digest,
        name,
        spec.dtype_name if spec.kv_fp8 else str(spec.dtype),  # Note [fp8 K/V]
        spec.head_dim,
        spec.head_dim_v,
        spec.group_size,
        spec.block_mask.block_size.q,
        spec.block_mask.block_size.kv,
        bucket(spec.len_q),
        bucket(spec.len_kv),
    )
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:32]


def _time(fn: Callable[[], None]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def pick(candidates: list, run: Callable[[object], None], label: str):
    """Benchmark `run(config)` for each candidate that compiles and runs; return the fastest."""
    best, best_ms = None, float("inf")
    for cand in candidates:
        try:
            ms = _time(lambda cand=cand: run(cand))
        except Exception as e:  # a config can exceed shared memory or registers on this GPU
            log.info("flexfa: autotune %s skips %s (%s)", label, cand, type(e).__name__)
            continue
        log.info("flexfa: autotune %s %s: %.3f ms", label, cand, ms)
        if ms < best_ms:
            best, best_ms = cand, ms
    return best


def fit(candidate, block_size):
    """Fit one candidate to the block mask (None if it cannot fit)."""
    probe = cfgs.KernelConfigs(
        candidate if isinstance(candidate, FwdConfig) else FwdConfig(),
        candidate if isinstance(candidate, BwdConfig) else BwdConfig(),
    )
    fitted = cfgs.fit_to_block_mask(probe, block_size)
    if fitted is None:
        return None
    return fitted.fwd if isinstance(candidate, FwdConfig) else fitted.bwd


def unique(configs: list) -> list:
    seen, out = set(), []
    for c in configs:
        if c is not None and dataclasses.astuple(c) not in seen:
            seen.add(dataclasses.astuple(c))
            out.append(c)
    return out
