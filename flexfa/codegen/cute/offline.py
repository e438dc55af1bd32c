"""Compiling FA4's forward and backward with flexfa's generated hooks on a machine without a GPU.

FA4 and the CuTe DSL compile for a named arch when told so by the environment (`CUTE_DSL_ARCH`,
`FLASH_ATTENTION_ARCH`, and `FLASH_ATTENTION_NUM_SMS` for its scheduling heuristics), and FA4's
entry points accept torch fake tensors: under `FakeTensorMode` nothing is allocated or launched,
but every kernel of the call is compiled to PTX and a cubin. `CUTE_DSL_KEEP=ptx` with
`CUTE_DSL_DUMP_DIR` keeps the PTX files, `cubin` the cubins, which `cuobjdump --dump-sass` turns
into SASS where a cuobjdump is found (Triton's package carries one).

The CuTe DSL reads its arch once per process, so `compile_call` must run before anything else in
the process imports cutlass with another arch (the CLI and the tests run it in a fresh process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from flexfa.config import config

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
    sass: tuple[Path, ...] = ()


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


def _fake_lists(lists):
    """Block-sparse lists as (fake) CUDA tensors of the same shapes, inside FakeTensorMode."""
    if lists is None:
        return None
    fields = ("mask_cnt", "mask_idx", "full_cnt", "full_idx")
    return dataclasses.replace(
        lists,
        **{
            f: torch.empty(getattr(lists, f).shape, dtype=torch.int32, device="cuda")
            for f in fields
        },
    )


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
    block_sparse: bool = False,
    disk_cache: bool = False,
    seqlens: Sequence[int] | None = None,
) -> CompileReport:
    """Compile FA4's forward (and backward) for these mods and `arch`, keeping PTX in `out_dir`.

    The mods go through the same path as `flexfa.attention(..., backend="fa4")`: tracing, mask
    lowering (Note [Native masks from the IR]), the generated module, FA4's entry points.
    `disk_cache=True` also uses flexfa's disk cache of compiled FA4 kernels (Note [FA4 kernels on
    disk]): a kernel found there is loaded, not compiled, and leaves no PTX. `seqlens`: compile
    FA4's varlen kernels instead, for a packed call of sequences of these lengths (each with as
    many keys as queries; `seq_len` is then unused) whose mask is native in every sequence (Note
    [Packed calls on FA4's varlen path]).
    """
    number = configure_arch(arch)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ptx_dir = out / f"ptx_{arch}"
    ptx_dir.mkdir(exist_ok=True)
    os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"
    os.environ["CUTE_DSL_DUMP_DIR"] = str(ptx_dir)

    from torch._subclasses.fake_tensor import FakeTensorMode

    from flexfa.blockmask.bind import resolve_block_mask
    from flexfa.codegen.cute import backend, launch
    from flexfa.codegen.cute.plan import backward_head_dim
    from flexfa.frontend.bound import trace_call_score_mod

    score = trace_call_score_mod(score_mod, num_heads, torch.device("cpu"))
    if seqlens is None:
        bm = resolve_block_mask(mask_mod, 1, num_heads, seq_len, seq_len, torch.device("cpu"))
        mask = None if bm.mask.is_trivially_true else bm.mask
        call = backend.plan_call(
            score,
            mask,
            len_q=seq_len,
            len_kv=seq_len,
            needs_grad=backward,
            scale=head_dim**-0.5,
            block_mask=bm if block_sparse else None,
            arch_major=number // 10,
            split=not block_sparse,  # as a call that asks for the lists (Note [Prefix masks ...])
        )
    else:
        call = _plan_packed(score, mask_mod, tuple(seqlens), backward, head_dim)
        seq_len = sum(seqlens)
    captured = [*(score.tensors if score is not None else ()), *call.mask_tensors]
    grad_slots = call.grad_slots
    specs = [(a.shape, a.dtype) for a in (launch.captured_tensor(t) for t in captured)]
    seconds: dict[str, float] = {}
    # By default compile for real: a kernel loaded from disk leaves no PTX.
    with _hardware_info_without_gpu(), FakeTensorMode(), config.override(fa4_disk_cache=disk_cache):
        if call.sequences is not None:  # the offsets as (fake) CUDA tensors
            cu = torch.empty(len(seqlens) + 1, dtype=torch.int32, device="cuda")
            call = dataclasses.replace(
                call,
                sequences=dataclasses.replace(call.sequences, cu_seqlens_q=cu, cu_seqlens_k=cu),
            )
        shape = (1, num_heads, seq_len, head_dim)
        q, k, v = (torch.empty(shape, dtype=dtype, device="cuda") for _ in range(3))
        # Fake tensors: their addresses go to FA4 as Int64(0), typed as a real call's (Note
        # [Captured tensors by address]).
        tensors = [torch.empty(shape, dtype=dt, device="cuda") for shape, dt in specs]
        # A mask split by rows runs both parts on one kernel (Note [Prefix masks as two native
        # calls] in plan.py): compiled once, with the second part's window.
        fwd_lowering = call.lowering.split.second if call.lowering.split else call.lowering
        bwd_lowering = (
            call.bwd_lowering.split.second if call.bwd_lowering.split else call.bwd_lowering
        )
        t0 = time.perf_counter()
        o, lse = launch.forward(
            q, k, v, out=torch.empty_like(q), scale=call.scale, lowering=fwd_lowering,
            hooks=call.hooks, tensors=tensors, arch=number,
            block_sparse=_fake_lists(call.fwd_sparse), scalars=call.scalars,
            sequences=call.sequences,
        )  # fmt: skip
        seconds["forward"] = time.perf_counter() - t0
        padded = None
        if backward:
            grads = [
                torch.empty(score.tensors[s].shape or (1,), dtype=torch.float32, device="cuda")
                for s in grad_slots
            ]
            # The backward flexfa runs: zero-padded where FA4's is not verified (Note [Padded
            # backward] in backend.py; the padding itself costs no kernel of FA4's).
            padded = backward_head_dim(head_dim, head_dim, number // 10)
            if padded is not None:
                q = k = v = o = torch.empty((*shape[:3], padded), dtype=dtype, device="cuda")
            t0 = time.perf_counter()
            launch.backward(
                q, k, v, o, torch.empty_like(o), lse, None, scale=head_dim**-0.5,
                lowering=bwd_lowering, hooks=call.hooks, tensors=tensors + grads,
                deterministic=False, block_sparse=_fake_lists(call.bwd_sparse),
                scalars=call.scalars, sequences=call.sequences,
            )  # fmt: skip
            seconds["backward"] = time.perf_counter() - t0
    ptx = tuple(sorted(ptx_dir.rglob("*.ptx")))
    sass = disassemble(tuple(sorted(ptx_dir.rglob("*.cubin"))))
    lowering = call.lowering
    text = f"{lowering.kind}: {lowering.reason}"
    if call.bwd_lowering is not lowering:
        text += f"; backward {call.bwd_lowering.kind}: {call.bwd_lowering.reason}"
    if backward and padded is not None:
        text += f"; backward at head dim {padded}, zero-padded (Note [Padded backward])"
    text += "".join(
        f"; {name} block-sparse" for name, lists in (("forward", call.fwd_sparse),
        ("backward", call.bwd_sparse)) if lists is not None
    )  # fmt: skip
    if call.sequences is not None:
        text += f"; FA4's varlen kernels, {len(seqlens)} sequences (cu_seqlens)"
    return CompileReport(arch, ptx, seconds, text, sass)


def _plan_packed(score, mask_mod, seqlens: tuple[int, ...], backward: bool, head_dim: int):
    """`compile_call`'s plan of a packed call on FA4's varlen kernels; the offsets are filled in
    under FakeTensorMode."""
    from flexfa.codegen.cute import backend, launch
    from flexfa.codegen.cute.plan import lower_packed_mask
    from flexfa.frontend.trace import trace_mask_mod

    mask = None if mask_mod is None else trace_mask_mod(mask_mod)
    shapes = sorted({(n, n) for n in seqlens if n}, reverse=True)
    lowering = lower_packed_mask(mask, shapes)
    if not lowering.native:
        raise ValueError(f"the mask does not reach FA4's varlen kernels: {lowering.reason}")
    placeholder = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
    sequences = launch.Sequences(placeholder, placeholder, max(seqlens), max(seqlens))
    return backend.plan_packed_call(
        score, lowering, sequences, needs_grad=backward, scale=head_dim**-0.5
    )


def _cuobjdump() -> str | None:
    """A cuobjdump: on PATH, else the one Triton's package carries."""
    import shutil

    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else None


def disassemble(cubins: tuple[Path, ...]) -> tuple[Path, ...]:
    """SASS (`cuobjdump --dump-sass`) beside each cubin; none where no cuobjdump is found or it
    cannot read the cubin (an arch newer than the tool)."""
    import subprocess

    tool = _cuobjdump()
    if tool is None:
        return ()
    written = []
    for cubin in cubins:
        res = subprocess.run(
            [tool, "--dump-sass", str(cubin)], capture_output=True, text=True, timeout=300
        )
        if res.returncode == 0 and res.stdout.strip():
            path = cubin.with_suffix(".sass")
            path.write_text(res.stdout)
            written.append(path)
    return tuple(written)


def export(
    score_mod,
    mask_mod,
    *,
    arch: str,
    out_dir: str | Path,
    num_heads: int = 4,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
) -> list[Path]:
    """`python -m flexfa export ... --backend fa4`: the generated hooks (`mods.py`, `key.json`)
    and the PTX of FA4's forward and backward kernels compiled with them for `arch`, their cubins
    and SASS where a cuobjdump is found, with no GPU needed. Returns the paths written."""
    import json

    from flexfa.blockmask.bind import resolve_block_mask
    from flexfa.codegen.cute import module
    from flexfa.frontend.bound import trace_call_score_mod

    configure_arch(arch)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    score = trace_call_score_mod(score_mod, num_heads, torch.device("cpu"))
    mask = resolve_block_mask(mask_mod, 1, num_heads, 1, 1, torch.device("cpu")).mask
    mask = None if mask.is_trivially_true else mask
    slots = score.grad_slots() if score is not None else frozenset()
    (out / "mods.py").write_text(module.render(score, mask, slots).source)
    key = module.module_key(score, mask, slots)
    (out / "key.json").write_text(json.dumps(dataclasses.asdict(key), indent=1) + "\n")
    report = compile_call(
        score_mod, mask_mod, arch=arch, out_dir=out, num_heads=num_heads, head_dim=head_dim,
        dtype=dtype,
    )  # fmt: skip
    (out / f"compile_{arch}.json").write_text(
        json.dumps(
            {
                "lowering": report.lowering,
                "seconds": report.seconds,
                "ptx": [p.name for p in report.ptx],
                "sass": [p.name for p in report.sass],
            },
            indent=1,
        )
        + "\n"
    )
    return [
        out / "mods.py", out / "key.json", out / f"compile_{arch}.json", *report.ptx, *report.sass,
    ]  # fmt: skip
