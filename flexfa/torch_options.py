"""torch FlexAttention's `kernel_options` keys, read by flexfa.

A call moved from `torch.nn.attention.flex_attention` keeps its `kernel_options`: the keys that
choose tile sizes and launch options become flexfa's (`BLOCK_M` -> `block_m`, `BLOCK_M1` ->
`bwd_block_m1`, ...); keys that only steer torch's own code generation (`PRESCALE_QK`,
`ROWS_GUARANTEED_SAFE`, `FORCE_USE_FLEX_ATTENTION`, ...) have no flexfa meaning and are dropped with
a warning naming them, once per set of keys. flexfa's own keys pass through unchanged.

>>> translate({"BLOCK_M": 64, "num_warps": 4})
{'block_m': 64, 'num_warps': 4}
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

RENAMED = {
    "BLOCK_M": "block_m",
    "BLOCK_N": "block_n",
    "BLOCK_M1": "bwd_block_m1",
    "BLOCK_N1": "bwd_block_n1",
    "BLOCK_M2": "bwd_block_m2",
    "BLOCK_N2": "bwd_block_n2",
    "fwd_num_warps": "num_warps",
    "fwd_num_stages": "num_stages",
    "bwd_num_warps": "bwd_num_warps",
    "bwd_num_stages": "bwd_num_stages",
}
DROPPED = frozenset(
    {
        "PRESCALE_QK",
        "ROWS_GUARANTEED_SAFE",
        "BLOCKS_ARE_CONTIGUOUS",
        "WRITE_DQ",
        "FORCE_USE_FLEX_ATTENTION",
        "OUTPUT_LOGSUMEXP",
        "OUTPUT_MAX",
        "USE_TMA",
        "BACKEND",
        "SPARSE_Q_BLOCK_SIZE",
        "SPARSE_KV_BLOCK_SIZE",
        "waves_per_eu",
        "kpack",
        "matrix_instr_nonkdim",
    }
)
_warned: set[frozenset[str]] = set()


def translate(options: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """flexfa's kernel_options for `options`, which may use torch FlexAttention's keys."""
    if not options or not any(k in RENAMED or k in DROPPED for k in options):
        return options
    out: dict[str, Any] = {}
    dropped = []
    for key, value in options.items():
        if key in DROPPED:
            dropped.append(key)
        else:
            out[RENAMED.get(key, key)] = value
    if dropped and frozenset(dropped) not in _warned:
        _warned.add(frozenset(dropped))
        warnings.warn(
            f"flexfa: kernel_options {sorted(dropped)} steer torch FlexAttention's own code "
            "generation and mean nothing to flexfa; they are ignored",
            stacklevel=4,
        )
    return out
