"""Compiling FA4's forward and backward with flexfa's generated hooks on a machine without a GPU.

FA4 and the CuTe DSL compile for a named arch when told so by the environment (`CUTE_DSL_ARCH`,
`FLASH_ATTENTION_ARCH`, and `FLASH_ATTENTION_NUM_SMS` for its scheduling heuristics), and FA4's
entry points accept torch fake tensors: under `FakeTensorMode` nothing is allocated or launched,
but every kernel of the call is compiled to PTX and a cubin. `CUTE_DSL_KEEP=ptx` with
`CUTE_DSL_DUMP_DIR` keeps the PTX files.

The CuTe DSL reads its arch once per process, so `compile_call` must run before anything else in
the process imports cutlass with another arch (the CLI and the tests run it in a fresh process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path

import torch

ARCHES = {"sm_90a": 90, "sm_100a": 100}
# SM counts FA4's heuristics assume when there is no GPU to ask (H100/H200 and B200).
_NUM_SMS = {90: 132, 100: 148}


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What `compile_call` produced: PTX files and seconds spent per pass."""

    arch: str
    ptx: tuple[Path, ...]
    seconds: dict[str, float]
    lowering: str


def configure_arch(arch: str) -> int:
    """Point the CuTe DSL and FA4 at `arch` ("sm_90a" or "sm_100a"); returns FA4's arch number."""
    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {sorted(ARCHES)}, got {arch!r}")
    number = ARCHES[arch]
    current = os.environ.get("CUTE_DSL_ARCH")
    import sys

    if "cutlass" in sys.modules and current not in (None, arch):
        raise RuntimeError(
            f"the CuTe DSL was already set up for {current} in this process; compile for {arch} "
            "in a new process"
        )
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ["FLASH_ATTENTION_ARCH"] = str(number)
    os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", str(_NUM_SMS[number]))
    return number


class _NoGpuHardwareInfo:
    """Stands in for `cutlass.utils.HardwareInfo` without a GPU: FA4's persistent schedulers ask
    it for the SM count while compiling; the answer is FLASH_ATTENTION_NUM_SMS."""

    def __init__(self, device_id: int = 0) -> None:
        self.device_id = device_id

    def get_device_multiprocessor_count(self) -> int:
        return int(os.environ["FLASH_ATTENTION_NUM_SMS"])


@contextlib.contextmanager
def _hardware_info_without_gpu():
    import cutlass.utils

    if torch.cuda.is_available():
        yield
        return
    saved = cutlass.utils.HardwareInfo
    cutlass.utils.HardwareInfo = _NoGpuHardwareInfo
    try:
        yield
    finally:
        cutlass.utils.HardwareInfo = saved


def compile_call(
    score_mod,
    mask_mod,
    *,
    arch: str,
    out_dir: str | Path,
    num_heads: int = 4,
    head_dim: int = 128,
    seq_len: int = 1024,
    dtype: torch.dtype = torch.bfloat16,
    backward: bool = True,
) -> CompileReport:
    """Compile FA4's forward (and backward) for these mods and `arch`, keeping PTX in `out_dir`.

    The mods go through the same path as `flexfa.attention(..., backend="fa4")`: tracing, mask
    lowering (Note [Native masks from the IR]), the generated module, FA4's entry points.
    """
    number = configure_arch(arch)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ptx_dir = out / f"ptx_{arch}"
    ptx_dir.mkdir(exist_ok=True)
    os.environ["CUTE_DSL_KEEP"] = "ptx"
    os.environ["CUTE_DSL_DUMP_DIR"] = str(ptx_dir)

    from torch._subclasses.fake_tensor import FakeTensorMode

    from flexfa.api import _trace_score_mod
    from flexfa.blockmask.bind import resolve_block_mask
    from flexfa.codegen.cute import backend, launch

    score = _trace_score_mod(score_mod, num_heads, torch.device("cpu"))
    bm = resolve_block_mask(mask_mod, 1, num_heads, seq_len, seq_len, torch.device("cpu"))
    mask = None if bm.mask.is_trivially_true else bm.mask
    lowering = backend.mask_lowering(mask, seq_len, seq_len)
    grad_slots = score.grad_slots() if score is not None else frozenset()
    hooks = backend.hooks_for(score, None if lowering.native else mask, grad_slots)
    captured = [*(score.tensors if score is not None else ())]
    if mask is not None and not lowering.native:
        captured += mask.tensors
    seconds: dict[str, float] = {}
    with _hardware_info_without_gpu(), FakeTensorMode():
        shape = (1, num_heads, seq_len, head_dim)
        q, k, v = (torch.empty(shape, dtype=dtype, device="cuda") for _ in range(3))
        aux = [
            torch.empty(a.shape, dtype=a.dtype, device="cuda")
            for a in (launch.aux_tensor(t) for t in captured)
        ]
        t0 = time.perf_counter()
        o, lse, o_fa4 = launch.forward(
            q, k, v, scale=head_dim**-0.5, lowering=lowering, hooks=hooks, aux_tensors=aux,
            arch=number,
        )  # fmt: skip
        seconds["forward"] = time.perf_counter() - t0
        if backward:
            grads = [
                torch.empty(score.tensors[s].shape or (1,), dtype=torch.float32, device="cuda")
                for s in sorted(grad_slots)
            ]
            t0 = time.perf_counter()
            launch.backward(
                q, k, v, o_fa4, torch.empty_like(o), lse, None, scale=head_dim**-0.5,
                lowering=lowering, hooks=hooks, aux_tensors=aux + grads, deterministic=False,
            )  # fmt: skip
            seconds["backward"] = time.perf_counter() - t0
    ptx = tuple(sorted(ptx_dir.rglob("*.ptx")))
    return CompileReport(arch, ptx, seconds, f"{lowering.kind}: {lowering.reason}")
