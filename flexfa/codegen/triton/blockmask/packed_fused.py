"""The BlockMask of a packed mask in one generated Triton kernel (CUDA).

`build` returns the same BlockMask as the vectorized torch builder of flexfa/blockmask/packed.py
(Note [Tiles of a packed mask]), or None when that builder must make it.

# Note [Packed block masks in one kernel]
# The torch builder of a packed mask is about 60 vectorized operations with no synchronization,
# but on a GPU each is a launch, and a BlockMask took ~2 ms for 8 sequences: the launches, not the
# work. The fused path (Note [Fused analysis]) already solves this for ordinary masks, and its
# emitter writes the analysis of a mask_mod on any rectangle (q_lo..q_hi, kv_lo..kv_hi) of a plane
# (b, h) as Triton code. So one kernel does what the torch builder does, per tile:
#   - the sequences of the first and last tokens of its q-block and kv-block, found by a binary
#     search in the offsets (log2 B loads each, from the cache), give lo, hi and `single`;
#   - the sub-rectangles of lo and hi, from the offsets cu_q and cu_kv, in relative positions, are
#     bounded by the emitted analysis with b = the sequence;
#   - the tile is full, empty or partial by the same rules, and the program appends it to its
#     row's (or column's) lists, as the fused kernel does (one program per q-block, one per
#     kv-block, and the heads along the grid's second axis).
# It writes every element of its output (zeros past each list's count), so the output needs no
# zero fill: a build is that one launch and an uninitialized allocation. Its programs after those
# of the lists write the packing's positions while nothing else has (Note [Positions written with
# the block lists] in flexfa/varlen.py).
#
# It takes only masks the torch builder trusts without a check (no captured tensor is read, and
# the analysis is exact logic, Note [Tiles of a packed mask]) and whose every node the kernel
# bounds with no per-tile tensor: comparisons of affine integers, bools of q_idx - kv_idx (prefix
# sums of the line of the relative grid, kept per mask and grid), q- and kv-lines evaluated in
# the kernel, and logic over them. Lines that the analysis summarizes per grid tile (`How.LINE`)
# cannot serve sub-rectangles at other offsets, so masks that have one take the torch builder,
# as does everything on the CPU outside Triton's interpreter. The kernel's bounds are the
# analysis' (Note [Fused analysis]), q- and kv-lines exact over the sub-rectangle's own positions:
# as tight as the torch builder's, and sound for the same reasons; tests/blockmask/test_packed.py
# compares the two builders' lists through the interpreter.
#
# Its first use compiles the kernel in the background while the torch builder answers (Note
# [Concurrent compiles]), so no call waits for the compile.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import logging
from typing import TYPE_CHECKING, Any

import torch

from flexfa.blockmask.block_mask import BlockMask
from flexfa.blockmask.fused_plan import How, KernelLineInput, PrefixInput, load_in_bounds, plan_for
from flexfa.blockmask.grid import TileGrid
from flexfa.blockmask.lines import Line, Sig
from flexfa.codegen.triton import packing as positions
from flexfa.codegen.triton.blockmask import fused
from flexfa.codegen.triton.blockmask.fused_emit import emit_body, render_module
from flexfa.codegen.triton.emit import capture_values
from flexfa.frontend.trace import TracedMod
from flexfa.runtime.launch import compiling_in_background, direct_default, launch_default

if TYPE_CHECKING:
    from flexfa.blockmask.packed import Packing

log = logging.getLogger("flexfa")

_TEMPLATE = "packed_lists.py.jinja"


@dataclasses.dataclass(frozen=True, eq=False)
class Kernel:
    """What a mask's packed kernel needs beyond the packing: the kernel, its arguments after the
    fixed ones (prefix sums with their strides, then the captures), and whether it evaluates
    lines over each tile's block (fewer tiles per step then). `reason` (kernel None): why the
    kernel cannot take the mask."""

    kernel: Any
    args: tuple
    kernel_lines: bool
    reason: str | None = None


_kernels: collections.OrderedDict[tuple, Kernel] = collections.OrderedDict()
_KERNELS_KEPT = 8
_sources: dict[tuple, tuple[str, str]] = {}


@functools.lru_cache(maxsize=1)
def _versions() -> str:
    from flexfa.codegen.triton.module import TEMPLATE_DIR

    h = hashlib.sha256((TEMPLATE_DIR / _TEMPLATE).read_bytes())
    return f"{fused._versions()}:{h.hexdigest()[:16]}"


def _source(key: tuple, render) -> tuple[str, str]:
    hit = _sources.get(key)
    if hit is None:
        source = render()
        hit = _sources[key] = (source, hashlib.sha256(source.encode()).hexdigest())
    return hit


def _unsupported(reason: str) -> Kernel:
    return Kernel(None, (), False, reason)


def _names(names: list[str] | tuple[str, ...], indent: str) -> str:
    return "".join(f"\n{indent}{n}," for n in names)


def _make(inner: TracedMod | None, rel: TileGrid) -> Kernel:
    """The kernel of `inner` (None: no mask) on sequences of the relative grid `rel`."""
    if inner is None:
        source = _source(
            ("none", _versions()),
            lambda: render_module(
                _TEMPLATE, "", params="", args="", capture_params="", capture_call_args="", body=""
            ),
        )
        return Kernel(fused._kernel(*source, "packed", "flexfa_packed_lists"), (), False)
    plan = plan_for(inner, rel)
    if plan.reason is not None:
        return _unsupported(plan.reason)
    args = fused._Args(rel)
    inputs: dict[int, tuple[object, tuple[str, ...]]] = {}
    lines: dict[Sig, Line] = {}
    for step in plan.steps:
        n, sig = step.node, plan.static.sig[id(step.node)]
        if step.how is How.LINE:
            return _unsupported("a line summarized per tile")
        if step.how is How.KLINE:
            if not all(load_in_bounds(ld, rel, sig, inner.tensors) for ld in plan.loads[id(n)]):
                return _unsupported("a line that may read out of bounds")
            inputs[id(n)] = (KernelLineInput(), ())
        elif step.how is How.PREFIX:
            line = lines.get(sig)
            if line is None:
                line = lines[sig] = Line(sig, inner, rel)
            if line.evaluator.out_of_bounds is not None:
                return _unsupported("a line that may read out of bounds")
            prefix = fused.prefix_sums(line, n, rel.device)
            inputs[id(n)] = (PrefixInput(), (args.prefix_tensor(prefix),))
    descs = tuple(inputs[id(s.node)][0] for s in plan.steps if id(s.node) in inputs)

    def render() -> str:
        body = emit_body(inner, plan, inputs, (), line_b="b_col")
        return render_module(
            _TEMPLATE,
            body.functions,
            params=_names(args.names, "    "),
            args=_names(args.names, "        "),
            capture_params=_names(body.captures, "    "),
            capture_call_args=_names(body.captures, "        "),
            body="\n    ".join(body.lines),
            root=body.root,
        )

    source = _source((inner.key, plan.shape_key, descs, _versions()), render)
    kernel = fused._kernel(*source, "packed", "flexfa_packed_lists")
    kernel_lines = any(isinstance(d, KernelLineInput) for d in descs)
    return Kernel(kernel, (*args.values, *capture_values(inner.tensors)), kernel_lines)


def kernel_for(inner: TracedMod | None, rel: TileGrid) -> Kernel:
    """`_make`, kept per mask, captured tensors and relative grid."""
    if inner is None:
        key: tuple = (None, rel.device)
    else:
        key = (inner.key, tuple((id(t), t._version) for t in inner.tensors), rel)
    found = _kernels.get(key)  # its tensors are alive: their ids are theirs
    if found is None:
        found = _kernels[key] = _make(inner, rel)
        while len(_kernels) > _KERNELS_KEPT:
            _kernels.popitem(last=False)
    else:
        _kernels.move_to_end(key)
    return found


def clear_memory_cache() -> None:
    """Forget kernels, their inputs and rendered sources (the files on disk stay)."""
    _kernels.clear()
    _sources.clear()


def specialization(args: tuple) -> tuple:
    """What Triton specializes a kernel on among `args` (ints equal to 1 or divisible by 16,
    pointers aligned to 16 bytes), for launch keys: lengths and offsets change from batch to
    batch, and a launch whose specialization was not compiled yet must not wait for it (Note
    [Concurrent compiles])."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a.data_ptr() % 16 == 0)
        elif isinstance(a, int):
            out.append((a == 1, a % 16 == 0))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _constexprs(bs: Any, chunk: int) -> dict[str, int]:
    """The kernel's constexprs for tiles of `bs` (a BlockSize) and `chunk` tiles per step (kept:
    the same dict object each time, read only)."""
    return dict(
        BLOCK_Q=bs.q,
        BLOCK_KV=bs.kv,
        BQ_P2=fused._pow2_at_least(bs.q, bs.q),
        BKV_P2=fused._pow2_at_least(bs.kv, bs.kv),
        CHUNK=chunk,
        POS_BLOCK=positions.BLOCK,
    )


def build(
    traced: TracedMod, inner: TracedMod | None, grid: TileGrid, pack: Packing, rel: TileGrid
) -> BlockMask | None:
    """The BlockMask of the packed mask `traced` on `grid` from one kernel (Note [Packed block
    masks in one kernel]), or None when the torch builder must make it. `inner` is the user's
    mask_mod, traced (None: no mask), `rel` the grid of its analysis."""
    name = traced.name
    dev = grid.device
    if dev.type == "cuda" and dev.index != torch.cuda.current_device():
        log.debug(
            "flexfa: packed block mask of %s takes the torch builder: not the current GPU", name
        )
        return None  # launches go to the current device
    k = kernel_for(inner, rel)
    if k.kernel is None:
        log.debug("flexfa: packed block mask of %s takes the torch builder: %s", name, k.reason)
        return None
    H, nq, nkv = grid.heads, grid.num_q_blocks, grid.num_kv_blocks
    sizes = BlockMask.buffer_sizes(1, H, nq, nkv)
    if sum(sizes) > fused._MAX_ELEMENTS:
        log.debug("flexfa: packed block mask of %s takes the torch builder: too many tiles", name)
        return None
    bs = grid.block_size
    cap = fused._KLINE_CHUNK_CAP if k.kernel_lines else fused._CHUNK_CAP
    constexprs = _constexprs(bs, fused._pow2_at_least(max(nq, nkv), cap))
    out = torch.empty(sum(sizes), dtype=torch.int32, device=grid.device)
    # The positions too, while nothing wrote them (Note [Positions written with the block lists])
    write = pack.unwritten[0]
    pos_q = grid.q_len if write else 0
    pos_kv = grid.kv_len if write and pack.kv_own_positions else 0
    top, steps = positions.search(pack.num_seqs)
    args = (
        out, pack.seq_q, pack.pos_q, pack.seq_kv, pack.pos_kv, pack.cu_q, pack.cu_kv, grid.q_len,
        grid.kv_len, rel.q_len, rel.kv_len, nq, nkv, H, pack.num_seqs, top, steps, pos_q, pos_kv,
        *k.args,
    )  # fmt: skip
    launch_grid = (nq + nkv + positions.blocks(pos_q) + positions.blocks(pos_kv), H)
    kernel = k.kernel
    if not direct_default(kernel, constexprs).try_call(launch_grid, args, new_ints=True):
        fast_key = (id(kernel), str(grid.device), *constexprs.values(), specialization(args))
        label = f"packed block lists of {name}"
        warm = lambda: kernel.warmup(*args, grid=launch_grid, **constexprs)
        if compiling_in_background(fast_key, label, kernel, warm):
            log.debug("flexfa: packed block mask of %s takes the torch builder: compiling", name)
            return None
        launch_default(fast_key, label, kernel, launch_grid, args, constexprs)
    pack.unwritten[0] = False
    return BlockMask.from_buffer(
        out,
        batch=1,
        heads=H,
        q_len=grid.q_len,
        kv_len=grid.kv_len,
        block_size=bs,
        mask=traced,
    )
