"""Kernel configs: defaults per (architecture, head dim, dtype), user pins, autotuning.

A config must fit the BlockMask: each kernel tile covers part of exactly one block, so a tile size
must divide the block size along its axis (`fit_to_block_mask`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch

from flexfa.blockmask.block_mask import BlockSize
from flexfa.codegen.triton.params import BwdConfig, FwdConfig
from flexfa.config import config
from flexfa.runtime import diskcache

log = logging.getLogger("flexfa")

# Options a user may pass in `kernel_options` for the triton backend.
FWD_OPTIONS = {
    "block_m": "block_m",
    "block_n": "block_n",
    "num_warps": "num_warps",
    "num_stages": "num_stages",
}
BWD_OPTIONS = {
    "bwd_block_m1": "block_m1",
    "bwd_block_n1": "block_n1",
    "bwd_block_m2": "block_m2",
    "bwd_block_n2": "block_n2",
    "bwd_num_warps": "num_warps",
    "bwd_num_stages": "num_stages",
    "bwd_dq_num_warps": "dq_num_warps",
}
OTHER_OPTIONS = frozenset({"autotune", "bwd_dq"})
# The decode path's (flexfa/codegen/triton/decode.py).
DECODE_OPTIONS = frozenset(
    {
        "decode",
        "decode_splits",
        "decode_block_m",
        "decode_block_n",
        "decode_num_warps",
        "decode_num_stages",
        "decode_merge",
        "decode_dense",
    }
)
KNOWN_OPTIONS = frozenset(FWD_OPTIONS) | frozenset(BWD_OPTIONS) | OTHER_OPTIONS | DECODE_OPTIONS


@dataclasses.dataclass(frozen=True)
class KernelConfigs:
    fwd: FwdConfig
    bwd: BwdConfig


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device; None for the CPU (Triton's interpreter)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def default_configs(
    capability: tuple[int, int] | None,
    head_dim: int,
    dtype: torch.dtype,
    *,
    has_partial: bool = True,
) -> KernelConfigs:
    """A good starting point without tuning (measured on H100 for sm90; conservative elsewhere).

    `capability` is the GPU's (major, minor), or None for the interpreter on the CPU;
    `has_partial` whether the BlockMask has partial tiles (the mask_mod is evaluated somewhere).

    # Note [Forward tiles on sm90]
    # bench/config_sweep.py on an H100 (B=2, H=16, N=8192, D=128, bf16): with no mask, 128 x 64
    # tiles and 4 warps took 2.17 ms against 2.73 ms for 8 warps and 2.45 ms for 128 x 128 with
    # 8 warps and 2 stages; with a causal mask the latter was fastest (1.30 ms against 1.47 and
    # 1.53 ms). Masks with partial tiles get the larger tile, dense ones the smaller.
    """
    if capability is None:
        # The interpreter runs on the CPU: small tiles keep its numpy work short.
        return KernelConfigs(FwdConfig(32, 32, 4, 1), BwdConfig(32, 32, 32, 32, 4, 1))
    major, _ = capability
    d = max(head_dim, 16)
    if dtype == torch.float32:
        return KernelConfigs(FwdConfig(64, 32, 4, 2), BwdConfig(32, 32, 32, 32, 4, 1))
    if major >= 9:
        if d <= 64:
            return KernelConfigs(FwdConfig(128, 128, 4, 3), BwdConfig(64, 64, 64, 64, 4, 3))
        if d <= 128:
            fwd = FwdConfig(128, 128, 8, 2) if has_partial else FwdConfig(128, 64, 4, 3)
            return KernelConfigs(fwd, BwdConfig(64, 128, 128, 64, 8, 3))
        return KernelConfigs(FwdConfig(64, 32, 4, 3), BwdConfig(32, 64, 64, 32, 4, 2))
    if d <= 128:
        return KernelConfigs(FwdConfig(128, 64, 4, 3), BwdConfig(64, 64, 64, 64, 4, 2))
    return KernelConfigs(FwdConfig(64, 32, 4, 2), BwdConfig(32, 32, 32, 32, 4, 1))


def for_pairwise_access(
    configs: KernelConfigs, *, staged_loads: bool, gathers: bool, scatters: bool
) -> KernelConfigs:
    """Smaller tiles and pipelines for mods that read or scatter per (q, kv) pair.

    `staged_loads`: a per-pair load goes through Triton's software pipeliner; `gathers`: per-pair
    loads that `flexfa_gather` reads itself (Note [Per-pair gathers] in emit.py); `scatters`: a
    captured gradient is scattered per pair.

    # Note [Shared memory of per-pair loads and scatters]
    # A load whose index depends on both q_idx and kv_idx (bias[h, q_idx - kv_idx + c]) is a
    # [rows, cols] gather inside the KV loop, and Triton's software pipeliner stages it through
    # shared memory once per stage, on top of the K/V buffers. Measured on an H100 with Triton 3.6:
    # the forward at D=64 with 128 x 128 tiles and 3 stages needed 245 KB (the limit is 227 KB),
    # and the dQ kernel's per-pair gradient scatter at 128 x 64, 3 stages, D=128 needed 233 KB.
    # So with staged per-pair loads the KV tile is at most 64 columns and at most 2 stages deep,
    # and with per-pair scatters the dQ tile is at most 64 rows. Gathers that `flexfa_gather`
    # reads on CUDA take no shared memory and leave the stages alone, but each thread holds the
    # offsets and values of its part of the tile on top of the scores: at 128 x 128 the forward
    # of a T5 bucketed bias spilled 136 bytes per thread (Triton 3.6, sm_90, D=128), at 128 x 64
    # none, so the forward's KV tile stays at most 64 columns for them too; and with 4 warps (the
    # default at D <= 64) that forward still spilled 104 bytes for T5 and 32 for a clamped relative
    # bias, with 8 none, so it gets 8 warps.
    # A per-pair scatter in the dQ kernel runs fastest with 4 warps, whatever the backward's
    # (`dq_num_warps`): H200, bf16, causal, `bench/captured_grads.py --backend triton` learnable
    # fwd+bwd at B1 Hq32 Hkv8 N8192 D128 (8 warps by default) relative bias 13.45 -> 12.49 ms,
    # T5 20.93 -> 19.94, 2-D blocks 12.10 -> 12.02; at B2 H16 N4096 D64, against 8 warps (which
    # compile without the spills 4 warps have: 160 bytes per thread for the relative bias), 2.56
    # -> 1.94, 4.75 -> 3.47, 2.34 -> 1.75. Halving its tile either way, or the dK/dV kernel's
    # rows, was slower or no faster in the same run.
    """
    fwd, bwd = configs.fwd, configs.bwd
    if staged_loads or gathers:
        fwd = dataclasses.replace(fwd, block_n=min(fwd.block_n, 64))
    if gathers:
        fwd = dataclasses.replace(fwd, num_warps=max(fwd.num_warps, 8))
    if staged_loads:
        fwd = dataclasses.replace(fwd, num_stages=min(fwd.num_stages, 2))
        bwd = dataclasses.replace(bwd, num_stages=min(bwd.num_stages, 2))
    if scatters:
        bwd = dataclasses.replace(bwd, block_m2=min(bwd.block_m2, 64), dq_num_warps=4)
    return KernelConfigs(fwd, bwd)


def apply_options(base: KernelConfigs, options: Mapping[str, Any]) -> KernelConfigs:
    """Override fields from `kernel_options` (unknown keys raise ValueError)."""
    unknown = set(options) - KNOWN_OPTIONS - {"step_columns"}
    if unknown:
        raise ValueError(
            f"unknown kernel_options {sorted(unknown)}; the triton backend accepts {sorted(KNOWN_OPTIONS)}"
        )
    fwd = {FWD_OPTIONS[k]: v for k, v in options.items() if k in FWD_OPTIONS}
    bwd = {BWD_OPTIONS[k]: v for k, v in options.items() if k in BWD_OPTIONS}
    return KernelConfigs(dataclasses.replace(base.fwd, **fwd), dataclasses.replace(base.bwd, **bwd))


def _largest_pow2_divisor(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def fit_to_block_mask(configs: KernelConfigs, block_size: BlockSize) -> KernelConfigs | None:
    """Shrink tile sizes so they divide the BlockMask's block sizes; None if impossible (< 16)."""
    bq, bkv = block_size.q, block_size.kv

    def fit(value: int, block: int) -> int:
        return _largest_pow2_divisor(block, value)

    fwd = dataclasses.replace(
        configs.fwd, block_m=fit(configs.fwd.block_m, bq), block_n=fit(configs.fwd.block_n, bkv)
    )
    bwd = dataclasses.replace(
        configs.bwd,
        block_m1=fit(configs.bwd.block_m1, bq),
        block_n1=fit(configs.bwd.block_n1, bkv),
        block_m2=fit(configs.bwd.block_m2, bq),
        block_n2=fit(configs.bwd.block_n2, bkv),
    )
    sizes = (fwd.block_m, fwd.block_n, bwd.block_m1, bwd.block_n1, bwd.block_m2, bwd.block_n2)
    if min(sizes) < 16:
        return None
    return KernelConfigs(fwd, bwd)


def supports_block_size(block_size: BlockSize) -> str | None:
    """None if Triton tiles can divide these block sizes, else the reason."""
    for name, value in (("q", block_size.q), ("kv", block_size.kv)):
        if value % 16:
            return f"the BlockMask's {name} block size {value} is not a multiple of 16"
    return None


# -- tuned results on disk -----------------------------------------------------------------------


# In the "triton" cache (Note [Disk caches] in flexfa/runtime/diskcache.py).
TUNING_FILE = "tuning.json"

_tuned_files: dict[str, dict] = {}  # cache location -> contents, read once per process


def _tuned() -> dict:
    token = str(config.cache_dir)
    cached = _tuned_files.get(token)
    if cached is None:
        cached = _tuned_files[token] = diskcache.read_json("triton", TUNING_FILE) or {}
    return cached


def load_tuned(key: str) -> KernelConfigs | None:
    """Tuned configs stored under `key` in the cache's triton/tuning.json (read once); an entry
    that does not make valid configs is ignored with a warning."""
    entry = _tuned().get(key)
    if entry is None:
        return None
    try:
        return KernelConfigs(FwdConfig(**entry["fwd"]), BwdConfig(**entry["bwd"]))
    except (KeyError, TypeError, ValueError) as e:
        diskcache.warn(
            f"flexfa: ignored the tuning result {key} in {TUNING_FILE}: not valid configs ({e})",
            once=("tuning", key),
        )
        return None


def store_tuned(key: str, configs: KernelConfigs) -> None:
    """Add a tuning result (re-reading the file first: other processes may have added theirs)."""
    data = diskcache.read_json("triton", TUNING_FILE) or {}
    data[key] = {"fwd": dataclasses.asdict(configs.fwd), "bwd": dataclasses.asdict(configs.bwd)}
    _tuned_files[str(config.cache_dir)] = data
    diskcache.write_json("triton", TUNING_FILE, data)
