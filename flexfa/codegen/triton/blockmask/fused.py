"""The analytic tier and the block lists in one generated Triton kernel (CUDA).

`build(mask, grid)` returns the BlockMask of `mask` on `grid`, or None when the mask needs what
only the general path has (`flexfa.blockmask.build`): an operation the kernel does not bound, or
tiles the analysis cannot decide. It computes the same states as the analysis, with far fewer
device operations.

# Note [Fused analysis]
# On a GPU the general path is bound by launches, not work: the analysis and the block lists of
# a causal mask take about 135 small torch operations, each a kernel launch, so a BlockMask took
# ~1.5 ms at any length. The fused path keeps what is O(Q_LEN + KV_LEN) in torch and moves
# everything that is O(tiles) into one kernel:
#
# - Lines (Note [Tile analysis]): nodes that vary with q_idx only, kv_idx only or q_idx - kv_idx
#   only are evaluated exactly along their line, as in the analysis. A bool of q_idx - kv_idx
#   (causal, sliding windows, ...) is passed as prefix sums of its values, and the kernel counts
#   the allowed positions of each tile's range of q_idx - kv_idx itself: O(1) per tile. Other
#   line nodes are summarized per block by `Line.abstract` (O(N) work) and passed as tensors
#   that broadcast over the tile grid.
# - Everything else (the TWO nodes: affine bounds, comparisons of two affine integers, three-valued
#   logic, comparisons of bounded values) is emitted as straight-line Triton code that mirrors
#   `flexfa.blockmask.intervals` one function at a time. Operations without such a mirror make
#   the whole mask take the general path.
# - The kernel has one program per q-block (it writes that row's kv-side lists) and one per
#   kv-block (its q-side lists). Each evaluates the abstract program on its own line of tiles, so
#   every tile is evaluated twice and no tile-state grid is ever stored; that is cheaper than a
#   second launch.
# - Tiles the analysis leaves undecided are counted in one int32; when it is not 0 the result is
#   discarded and the general path (witnesses, refinement, exact evaluation) runs instead. That
#   read is the only synchronization.
#
# The code: `fused_plan` decides how each node gets its value, `fused_emit` writes the kernel's
# body, this module evaluates lines, launches and assembles the BlockMask.
#
# Soundness is the analysis' (the kernel computes the same abstract values in the same float64
# arithmetic); tests/blockmask/test_fused.py checks the lists against the general path and the
# dense oracle on random masks, through Triton's interpreter.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import types

import torch

from flexfa.blockmask.block_mask import BlockMask
from flexfa.blockmask.fused_plan import (
    How,
    Input,
    IntervalInput,
    KernelLineInput,
    PrefixInput,
    TruthInput,
    load_in_bounds,
    plan_for,
)
from flexfa.blockmask.grid import TileGrid, TileSet
from flexfa.blockmask.intervals import Interval, Truth
from flexfa.blockmask.lines import Line, Sig
from flexfa.codegen.triton.blockmask.fused_emit import render
from flexfa.codegen.triton.emit import capture_values
from flexfa.frontend.trace import TracedMod
from flexfa.runtime import diskcache
from flexfa.runtime.launch import compiling_in_background, run_logged

log = logging.getLogger("flexfa")


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether Triton can be imported (asked once)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class _Args:
    """The kernel arguments after the fixed ones: tensors with their strides."""

    def __init__(self, grid: TileGrid) -> None:
        self.grid = grid
        self.values: list[object] = []
        self.names: list[str] = []

    def grid_tensor(self, t: torch.Tensor) -> str:
        """A tensor that broadcasts over [B, H, nq, nkv]; returns its parameter name."""
        while t.ndim < 4:
            t = t.unsqueeze(0)
        t = t.expand(self.grid.shape)
        if t.dtype == torch.bool:
            t = t.view(torch.int8)
        name = f"x{len(self.names) // 5}"
        self.names += [name, f"{name}_sb", f"{name}_sh", f"{name}_si", f"{name}_sj"]
        self.values += [t, *t.stride()]
        return name

    def prefix_tensor(self, t: torch.Tensor) -> str:
        """Prefix sums [b, h, U + 1] (b, h of size 1 broadcast)."""
        name = f"x{len(self.names) // 5}"
        sb = t.stride(0) if t.shape[0] > 1 else 0
        sh = t.stride(1) if t.shape[1] > 1 else 0
        # Padded to five names, so every input has one parameter block of the same size.
        self.names += [name, f"{name}_sb", f"{name}_sh", f"{name}_si", f"{name}_sj"]
        self.values += [t, sb, sh, 0, 0]
        return name


_modules: dict[str, types.ModuleType] = {}
_sources: dict[tuple, tuple[str, str]] = {}
_lock = threading.Lock()


def _kernel(source: str, digest: str, entry: str = "lists", kernel: str = "flexfa_block_lists"):
    """The kernel named `kernel` of `source` (whose sha256 is `digest`), cached by Note [Disk
    caches] as `entry`_<digest>."""
    with _lock:
        mod = _modules.get(digest)
        if mod is None:
            mod = diskcache.load_generated(
                "blockmask",
                f"{entry}_{digest[:24]}",
                lambda: source,
                f"{kernel}_{digest[:24]}",
            ).module
            _modules[digest] = mod
    return getattr(mod, kernel)


def prefix_sums(line: Line, node, device: torch.device) -> torch.Tensor:
    """The prefix sums of a bool of q_idx - kv_idx along its line, int32 [b, h, U + 1]."""
    values = line.value(node)
    prefix = torch.zeros(*values.shape[:-1], values.shape[-1] + 1, dtype=torch.int32, device=device)
    torch.cumsum(values, -1, dtype=torch.int32, out=prefix[..., 1:])
    return prefix


def clear_memory_cache() -> None:
    """Forget loaded kernels and rendered sources (the files on disk stay)."""
    with _lock:
        _modules.clear()
        _sources.clear()


@functools.lru_cache(maxsize=1)
def _versions() -> str:
    import triton

    from flexfa.codegen.triton.module import TEMPLATE_DIR
    from flexfa.version import __version__

    h = hashlib.sha256((TEMPLATE_DIR / "block_lists.py.jinja").read_bytes())
    return f"{__version__}:{triton.__version__}:{h.hexdigest()[:16]}"


def _pow2_at_least(n: int, cap: int) -> int:
    """The least power of two >= n (at least 16), or `cap` if that is smaller."""
    p = 16
    while p < n and p < cap:
        p *= 2
    return p


# Elements of the output buffer are addressed with int32 offsets in the kernel.
_MAX_ELEMENTS = 2**31 - 1
_CHUNK_CAP = 1024
_KLINE_CHUNK_CAP = 16


def build(mask: TracedMod, grid: TileGrid) -> BlockMask | None:
    """The BlockMask of `mask` on `grid` from one kernel (Note [Fused analysis]), or None when the
    general path must build it (the reason is logged at DEBUG level)."""
    plan = plan_for(mask, grid)
    if plan.reason is not None:
        log.debug("flexfa: block mask of %s takes the general path: %s", mask.name, plan.reason)
        return None
    P = grid.batch * grid.heads
    nq, nkv = grid.num_q_blocks, grid.num_kv_blocks
    # Note [Block lists in one buffer] in block_mask.py, and a flag of undecided tiles after them.
    sizes = BlockMask.buffer_sizes(grid.batch, grid.heads, nq, nkv)
    if sum(sizes) + 1 > _MAX_ELEMENTS:
        log.debug("flexfa: block mask of %s takes the general path: too many tiles", mask.name)
        return None
    args = _Args(grid)
    inputs: dict[int, tuple[Input, tuple[str, ...]]] = {}
    lines: dict[Sig, Line] = {}
    ts: TileSet | None = None
    for step in plan.steps:
        n = step.node
        if step.how not in (How.PREFIX, How.LINE, How.KLINE):
            continue
        sig = plan.static.sig[id(n)]
        if step.how is How.KLINE and all(
            load_in_bounds(ld, grid, sig, mask.tensors) for ld in plan.loads[id(n)]
        ):
            inputs[id(n)] = (KernelLineInput(), ())
            continue
        line = lines.get(sig)
        if line is None:
            line = lines[sig] = Line(sig, mask, grid)
        if step.how is How.PREFIX:
            prefix = prefix_sums(line, n, grid.device)
            inputs[id(n)] = (PrefixInput(), (args.prefix_tensor(prefix),))
            continue
        if ts is None:
            ts = TileSet.of_grid(grid)
        a = line.abstract(n, ts)
        if isinstance(a, Truth):
            names = tuple(args.grid_tensor(x) for x in (a.may_true, a.may_false, a.both))
            inputs[id(n)] = (TruthInput(), names)
            continue
        assert isinstance(a, Interval)
        tensors = [a.lo, a.hi]
        if a.nan is not None:
            tensors.append(a.nan)
        if a.contiguous is not None:
            tensors.append(a.contiguous)
        desc = IntervalInput(a.nan is not None, a.contiguous is not None, a.tight)
        inputs[id(n)] = (desc, tuple(args.grid_tensor(x) for x in tensors))
    oob: list[str] = []
    for line in lines.values():
        if line.evaluator.out_of_bounds is None:
            continue
        if ts is None:
            ts = TileSet.of_grid(grid)
        flag = line.out_of_bounds(ts)
        if flag is not None:
            oob.append(args.grid_tensor(flag))
    descs = tuple(inputs[id(s.node)][0] for s in plan.steps if id(s.node) in inputs)
    source_key = (mask.key, plan.shape_key, descs, len(oob), _versions())
    hit = _sources.get(source_key)
    if hit is None:
        source = render(mask, plan, inputs, tuple(oob), args.names)
        hit = _sources[source_key] = (source, hashlib.sha256(source.encode()).hexdigest())
    kernel = _kernel(*hit)

    total = sum(sizes)
    out = torch.zeros(total + 1, dtype=torch.int32, device=grid.device)
    # Lines evaluated in the kernel hold [CHUNK, block] values: fewer tiles per step then.
    kernel_lines = any(isinstance(d, KernelLineInput) for d in descs)
    bs = grid.block_size
    constexprs = dict(
        BLOCK_Q=bs.q,
        BLOCK_KV=bs.kv,
        BQ_P2=_pow2_at_least(bs.q, bs.q),
        BKV_P2=_pow2_at_least(bs.kv, bs.kv),
        CHUNK=_pow2_at_least(max(nq, nkv), _KLINE_CHUNK_CAP if kernel_lines else _CHUNK_CAP),
    )
    args_ = (out, grid.q_len, grid.kv_len, nq, nkv, grid.heads, P, *args.values)
    fast_key = (id(kernel), str(grid.device), *constexprs.values())
    label = f"block lists of {mask.name}"
    launch_args = (*args_, *capture_values(mask.tensors))
    warm = lambda: kernel.warmup(*launch_args, grid=(nq + nkv, P), **constexprs)
    if compiling_in_background(fast_key, label, kernel, warm):
        # Note [Concurrent compiles]: the general path builds the same lists meanwhile.
        log.debug(
            "flexfa: block mask of %s takes the general path: its kernel is compiling", mask.name
        )
        return None
    run_logged(fast_key, label, lambda: kernel[(nq + nkv, P)](*launch_args, **constexprs))
    if int(out[total].item()) != 0:
        log.debug("flexfa: block mask of %s takes the general path: undecided tiles", mask.name)
        return None
    return BlockMask.from_buffer(
        out,
        batch=grid.batch,
        heads=grid.heads,
        q_len=grid.q_len,
        kv_len=grid.kv_len,
        block_size=bs,
        mask=mask,
    )
