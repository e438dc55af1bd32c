"""Packed variable-length batches: several sequences concatenated along the length dim.

`flexfa.attention(q, k, v, ..., cu_seqlens_q=..., cu_seqlens_kv=...)` takes q (1, Hq, total_q, E),
k and v (1, Hkv, total_kv, E|Ev) and (B + 1,) int32 offsets: sequence s holds queries
`cu_seqlens_q[s] : cu_seqlens_q[s + 1]` and keys `cu_seqlens_kv[s] : cu_seqlens_kv[s + 1]`.

# Note [Packed batches as mods]
# A packed call is an ordinary call on the concatenation whose mods are rewritten: with seq[t] the
# sequence of token t and pos[t] = t - (its sequence's start),
#     mask'(b, h, q, kv)         = seq_q[q] == seq_kv[kv] & mask_mod(seq_q[q], h, pos_q[q], pos_kv[kv])
#     score'(s, b, h, q, kv)     = score_mod(s, seq_q[q], h, pos_q[q], pos_kv[kv])
# so the user's mods see `b` = sequence index and positions relative to their sequence, exactly as
# for a padded batch, and every backend (forward and backward) runs packed calls unchanged. The
# four index tensors are derived once per (cu_seqlens_q, cu_seqlens_kv) state and cached with weak
# references (as page tables are, Note [Checking page tables]), so the rewritten mods keep hitting
# the trace and block-mask caches across calls. The offsets are validated on the host, from one
# copy of them (the only synchronization of a new batch), and `Packing` keeps that copy.
#
# Note [Packed batches without retracing]
# A new batch brings new index tensors, and the trace cache keys captured tensors by identity
# (Note [Trace cache]), so each new batch would trace mask' and score' again (hundreds of
# microseconds each). A packed mod therefore carries a `__flexfa_trace__` hook (Note [Mods that
# bring their trace] in flexfa/frontend/trace.py): it traces a *twin*, the same code closed over
# fixed placeholder tensors of the same dtype, rank and device, which hits the trace cache for
# every batch, and binds the batch's tensors to the twin's captures. A trace reads only the
# dtype, rank and device of a captured tensor, so the result is the trace of the packed mod.
#
# Note [Packed block masks]
# The generic analysis cannot decide the tiles where a sequence boundary crosses a tile (pos
# jumps there, so pos_q[q] >= pos_kv[kv] is bounded only loosely), and every such tile went
# through witnesses and refinement: ~1700 torch operations and a dozen synchronizations for 8
# sequences, 20-32 ms on an H200 (the fused kernel ran first and gave up on the same tiles). The
# packed mask knows its structure, so it carries a `__flexfa_block_mask__` builder (Note [Block
# mask builders] in flexfa/blockmask/build.py) that derives the tiles from the offsets and the
# analysis of the user's mask_mod on positions within each sequence: O(tiles) work in about 60
# vectorized operations, without synchronizing (Note [Tiles of a packed mask]). The hook lives
# here, where the packing is known; the tile logic in flexfa/blockmask/packed.py, beside the
# analysis it runs. The builder answers only for the tensors of its own packing: a trace with
# other tensors bound (torch.compile rebinds a described trace's captures) takes the general path.
# On a GPU that builder is one generated kernel (Note [Packed block masks in one kernel] in
# flexfa/codegen/triton/blockmask/packed_fused.py).
#
# Note [Packed positions in one kernel]
# seq and pos of a new batch took five torch operations (repeat_interleave, which is more than one
# launch on CUDA, a difference, an arange, a gather and another difference), each a launch that
# costs more than the work. Where the fused block-mask kernels run, one static Triton kernel
# writes both: a binary search of each token in the offsets (log2 B loads per token). Its first
# use compiles it in the background while the torch operations answer (Note [Concurrent
# compiles]). With the host copy of the offsets (one synchronization) and the packed BlockMask
# (one launch), a new batch cost three device operations before its attention kernels; a packed
# call now makes it two (Note [Positions written with the block lists]), and one with offsets
# given on the host (Note [Offsets on the host]).
#
# Note [Offsets on the host]
# The offsets of a packed batch are validated, and its lengths known, on the host: offsets on the
# GPU cost a copy to the host, which waits for every kernel queued before it (the one
# synchronization of a new batch). A data loader usually has them on the host already, so
# `cu_seqlens_q` and `cu_seqlens_kv` may be CPU tensors for a call on a GPU: their values are read
# where they are and they are copied to the GPU without waiting (a copy from pageable host memory
# is staged at once, CUDA's documented behaviour for asynchronous copies), so the batch costs no
# synchronization at all. `Packing.cu_q` and `cu_kv` are then those copies, which the kernels read.
#
# Note [Positions written with the block lists]
# A packed call that runs the concatenation builds the BlockMask of its packed mask, and on a GPU
# that is one launch of the packed block-list kernel (Note [Packed block masks in one kernel]). That kernel finds each
# tile's sequences by the same binary search in the offsets as the positions kernel, so it can
# write the positions too, in programs after those of its lists: one launch per new batch instead
# of two (on the H200's host a launch through Triton's launcher, with its argument checks, was
# about a fifth of a packed BlockMask's host time). So `packing(..., defer=True)` allocates
# seq_* and pos_* without writing them (`Packing.unwritten`), and its caller, `_packed` in
# flexfa/api.py, gives the call a BlockMask whose build (`deferred_block_mask`: before any backend
# that runs the concatenation runs, Note [Block masks built on first read]) then calls
# `Packing.fill()`, which writes them if nothing did; FA4's varlen path reads neither. Every other
# path writes them before they can be read: the builder hook fills them when its kernel did not
# run (the torch builder and the general path read them), `packing()` without `defer` fills a
# cached packing it returns, and on the CPU nothing is deferred.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from flexfa.blockmask.block_mask import BlockMask, DeferredBlockMask
from flexfa.blockmask.packed import Packing
from flexfa.frontend.trace import TracedMod, trace
from flexfa.mods import bind_heads
from flexfa.spec import PackedSequences  # noqa: F401  (flexfa.varlen.PackedSequences, as before)

_MAX_CACHED = 32
_packings: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()


def _write_positions(cu: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, total: int) -> None:
    """Write the sequence and position of every token, int32, without synchronizing (`total` is
    known): one kernel where the fused block-mask kernels run (Note [Packed positions in one
    kernel])."""
    from flexfa.blockmask.build import use_fused_kernel

    if use_fused_kernel(cu.device):
        from flexfa.codegen.triton import packing as kernels

        if kernels.positions(cu, seq, pos, total):
            return
    seq.copy_(torch.repeat_interleave(cu[1:] - cu[:-1], output_size=total))
    torch.sub(torch.arange(total, device=cu.device, dtype=torch.int32), cu[seq], out=pos)


def _check(name: str, cu: object, total: int, device: torch.device) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32 or cu.ndim != 1 or cu.numel() < 2:
        raise ValueError(
            f"{name} must be an int32 tensor of shape (B + 1,) with B >= 1, got {cu.dtype} of "
            f"shape {tuple(cu.shape)}"
        )
    if cu.device != device and cu.device.type != "cpu":
        raise ValueError(f"{name} is on {cu.device}, but q is on {device} (or pass it on the CPU)")
    return cu


def _check_values(name: str, offsets: list[int], total: int) -> tuple[int, ...]:
    """The sequence lengths of valid `offsets`."""
    first, last = offsets[0], offsets[-1]
    if first != 0 or last != total:
        raise ValueError(
            f"{name} must start at 0 and end at the packed length {total}, got {first} and {last}"
        )
    lengths = tuple(map(int.__sub__, offsets[1:], offsets))
    if min(lengths) < 0:
        raise ValueError(f"{name} must be non-decreasing (sequence lengths are >= 0)")
    return lengths


def packing(
    cu_seqlens_q: object,
    cu_seqlens_kv: object,
    total_q: int,
    total_kv: int,
    device: torch.device,
    *,
    defer: bool = False,
) -> Packing:
    """The validated `Packing` of these offsets (cached per tensor state, Note [Packed ...]).

    With `defer`, its positions may be left unwritten where the packed block-list kernel writes
    them with its lists: the caller builds the BlockMask of its packed mask, then calls
    `Packing.fill()`, before anything else reads them (Note [Positions written with the block
    lists])."""
    cu_q = _check("cu_seqlens_q", cu_seqlens_q, total_q, device)
    cu_kv = _check("cu_seqlens_kv", cu_seqlens_kv, total_kv, device)
    if cu_q.numel() != cu_kv.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_kv must describe the same number of sequences, got "
            f"{cu_q.numel() - 1} and {cu_kv.numel() - 1}"
        )
    key = (id(cu_q), cu_q._version, id(cu_kv), cu_kv._version, total_q, total_kv)
    hit = _packings.get(key)
    if hit is not None and hit[0]() is cu_q and hit[1]() is cu_kv:
        _packings.move_to_end(key)
        if not defer:
            hit[2].fill()
        return hit[2]
    # One copy to the host for both offsets (Note [Packed batches as mods]).
    if cu_kv is cu_q:
        offsets_q = offsets_kv = cu_q.tolist()
    else:
        both = torch.cat([cu_q, cu_kv]).tolist()
        offsets_q, offsets_kv = both[: cu_q.numel()], both[cu_q.numel() :]
    lengths_q = _check_values("cu_seqlens_q", offsets_q, total_q)
    lengths_kv = _check_values("cu_seqlens_kv", offsets_kv, total_kv)
    user_q, user_kv = cu_q, cu_kv
    # On q's device (Note [Offsets on the host]) and contiguous: the kernels read cu[s].
    cu_q = cu_q.to(device, non_blocking=True).contiguous()
    cu_kv = cu_q if user_kv is user_q else cu_kv.to(device, non_blocking=True).contiguous()
    seq_q = torch.empty(total_q, dtype=torch.int32, device=device)
    pos_q = torch.empty(total_q, dtype=torch.int32, device=device)
    if offsets_kv == offsets_q:
        # The same tokens on both sides: views, so that the mods still capture four tensors.
        seq_kv, pos_kv = seq_q.view(-1), pos_q.view(-1)
    else:
        seq_kv = torch.empty(total_kv, dtype=torch.int32, device=device)
        pos_kv = torch.empty(total_kv, dtype=torch.int32, device=device)
    found = Packing(
        seq_q, pos_q, seq_kv, pos_kv, cu_q, cu_kv, tuple(offsets_q), tuple(offsets_kv), lengths_q,
        lengths_kv, [True], _write_positions,
    )  # fmt: skip
    from flexfa.blockmask.packed import use_packed_kernel  # which would write them

    if not (defer and use_packed_kernel(device)):
        found.fill()
    _packings[key] = (weakref.ref(user_q), weakref.ref(user_kv), found)
    while len(_packings) > _MAX_CACHED:
        _packings.popitem(last=False)
    return found


def packed_mods(
    score_mod: Callable[..., Any] | None,
    block_mask: object,
    pack: Packing,
    num_heads: int,
) -> tuple[Callable[..., Any] | None, Callable[..., Any]]:
    """The score_mod and mask_mod of the concatenated call (Note [Packed batches as mods])."""
    if isinstance(block_mask, BlockMask):
        raise ValueError(
            "a packed call (cu_seqlens_q/cu_seqlens_kv) takes block_mask as a mask_mod or None: "
            "its mods see positions within each sequence, which a prebuilt BlockMask cannot"
        )
    if block_mask is not None and not callable(block_mask):
        raise TypeError(
            f"block_mask must be a mask_mod(b, h, q_idx, kv_idx) or None, got {type(block_mask).__name__}"
        )
    score_mod = bind_heads(score_mod, num_heads)
    score = None if score_mod is None else _Packed(_packed_score, score_mod, pack).make()
    return score, _Packed(_packed_mask, block_mask, pack).make()


def deferred_block_mask(
    mask_mod: Callable[..., Any], pack: Packing, num_heads: int, device: torch.device
) -> DeferredBlockMask:
    """The BlockMask of a packed call's mask (`packed_mods`' second), built when first read or
    when a backend runs the concatenation (Note [Block masks built on first read] in
    flexfa/blockmask/block_mask.py). Its build also writes the packed positions, if nothing did."""
    from flexfa.blockmask.bind import DEFAULT_BLOCK_SIZE, cached_block_mask
    from flexfa.frontend.trace import trace_mask_mod

    traced = trace_mask_mod(mask_mod, device=device)
    total_q, total_kv = pack.offsets_q[-1], pack.offsets_kv[-1]

    def build() -> BlockMask:
        # Its kernel writes the positions with the lists (Note [Positions written with the
        # block lists]); `fill` writes them where another builder ran.
        bm = cached_block_mask(traced, 1, num_heads, total_q, total_kv, device)
        pack.fill()
        return bm

    return DeferredBlockMask.of(
        q_len=total_q,
        kv_len=total_kv,
        block_size=DEFAULT_BLOCK_SIZE,
        mask=traced,
        batch=1,
        heads=num_heads if "h" in traced.variables else 1,
        device=device,
        build=build,
    )


def _packed_score(score_mod, seq_q, pos_q, seq_kv, pos_kv):
    def packed(score, b, h, q_idx, kv_idx):
        return score_mod(score, seq_q[q_idx], h, pos_q[q_idx], pos_kv[kv_idx])

    packed.__name__ = f"packed_{getattr(score_mod, '__name__', 'score_mod')}"
    return packed


def _packed_mask(mask_mod, seq_q, pos_q, seq_kv, pos_kv):
    if mask_mod is None:

        def packed(b, h, q_idx, kv_idx):
            return seq_q[q_idx] == seq_kv[kv_idx]

    else:

        def packed(b, h, q_idx, kv_idx):
            same = seq_q[q_idx] == seq_kv[kv_idx]
            return same & mask_mod(seq_q[q_idx], h, pos_q[q_idx], pos_kv[kv_idx])

    packed.__name__ = f"packed_{getattr(mask_mod, '__name__', 'sequences')}"
    return packed


@functools.lru_cache(maxsize=8)
def _placeholders(device: torch.device) -> tuple[torch.Tensor, ...]:
    """Stand-ins for seq_q, pos_q, seq_kv, pos_kv in twins (Note [Packed batches without
    retracing]); kept for the life of the process, so their identities stay theirs."""
    return tuple(torch.zeros(1, dtype=torch.int32, device=device) for _ in range(4))


# Note [Mask twins by the user's trace]
# Looking a packed mask's twin up in the trace cache fingerprints all it reads: its code, the
# placeholders and the user's mask_mod with all that reads, ~10 us of a packed BlockMask's ~90
# (2-core CPU), and the packed builder then fingerprinted the user's mask_mod again. The twin is
# the maker's fixed code around the user's mask_mod, so the user's trace, looked up once per call
# and shared with the builder, stands for the rest: a trace cache entry is one object for as long
# as what its mod reads is unchanged (a change is another key, another object), and the twin's
# entry keeps that object alive, so its id names it. The entries are few and their own (a mask_mod
# the trace cache cannot keep is traced anew at each call, and would otherwise push other traces
# out of it). Score twins keep their own lookup: a score_mod's trace is rebound to new scalar
# values, a new object per value.
_mask_twins: collections.OrderedDict[tuple, tuple[TracedMod | None, TracedMod]] = (
    collections.OrderedDict()
)
_MASK_TWINS_KEPT = 16
_mask_twins_lock = threading.Lock()
_UNTRACED = object()  # `_Packed.inner`: no trace for this device yet

# Note [One inner trace for every device]
# A packed call traces the user's mask_mod twice, once for the BlockMask's trace (no device) and
# once for its builder (the grid's device), each a trace-cache lookup that fingerprints the mod.
# A trace that captures no tensor holds nothing of a device (its IR is device-free, and a mod
# that made a tensor would have captured it), so `_Packed.inner` gives that trace for every device
# and traces again only a mod that captures tensors, whose devices the builder checks.


@dataclasses.dataclass(frozen=True, eq=False)
class _Packed:
    """What a packed mod is made of: a maker (`_packed_score` or `_packed_mask`), the user's mod
    and the packing. `make` returns the packed mod with its hooks attached."""

    maker: Callable[..., Callable[..., Any]]
    mod: Callable[..., Any] | None
    pack: Packing
    # The user's mod traced, by device (`inner`): once per packed call.
    _inners: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

    def make(self) -> Callable[..., Any]:
        p = self.pack
        fn = self.maker(self.mod, p.seq_q, p.pos_q, p.seq_kv, p.pos_kv)
        # The hooks hold this object, which holds no reference to `fn`: no reference cycle.
        fn.__flexfa_trace__ = self.trace
        if self.maker is _packed_mask:
            fn.__flexfa_block_mask__ = self.block_mask
        return fn

    def inner(self, device: torch.device | None) -> TracedMod | None:
        """The user's mask_mod traced for `device` (None: no mask), kept for this packed call."""
        key = str(device)
        found = self._inners.get(key, _UNTRACED)
        if found is _UNTRACED:
            other = next(iter(self._inners.values()), None)
            if self.mod is None:
                found = None
            elif other is not None and not other.tensors:
                found = other  # Note [One inner trace for every device]
            else:
                found = trace(self.mod, "mask_mod", device=device)
            self._inners[key] = found
        return found

    def trace(self, fn: Callable[..., Any], kind: str, device: torch.device | None):
        """The trace of `fn` from its twin's (Note [Packed batches without retracing])."""
        p = self.pack
        stand_ins = _placeholders(p.device)
        if self.maker is _packed_mask and kind == "mask_mod":
            # Note [Mask twins by the user's trace]
            inner = self.inner(device)
            key = (str(device), id(inner))
            with _mask_twins_lock:
                hit = _mask_twins.get(key)
                if hit is not None and hit[0] is inner:
                    _mask_twins.move_to_end(key)
            if hit is not None and hit[0] is inner:
                twin = hit[1]
            else:
                twin = trace(self.maker(self.mod, *stand_ins), kind, device=device)
                with _mask_twins_lock:
                    _mask_twins[key] = (inner, twin)  # `inner` kept alive: its id stays its own
                    while len(_mask_twins) > _MASK_TWINS_KEPT:
                        _mask_twins.popitem(last=False)
        else:
            twin = trace(self.maker(self.mod, *stand_ins), kind, device=device)
        real = dict(zip(map(id, stand_ins), (p.seq_q, p.pos_q, p.seq_kv, p.pos_kv)))
        tensors = tuple(real.get(id(t), t) for t in twin.tensors)
        return twin.rebound(tensors=tensors, fn=fn)

    def block_mask(self, traced, grid):
        """The BlockMask of the packed mask `traced` on `grid`, from the offsets (Note [Packed
        block masks]), or None when the general path must build it."""
        from flexfa.blockmask.packed import packed_block_mask

        bm = packed_block_mask(traced, grid, self.inner(grid.device), self.pack)
        self.pack.fill()  # if its kernel did not write them (Note [Positions written with ...])
        return bm
