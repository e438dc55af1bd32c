"""The decode path of the Triton backend: short queries against a long (or paged) KV cache.

# Note [Decode kernels]
# With few queries per head (decoding, speculative decoding: Lq of 1 to ~64) the attention kernel
# has one program per (q tile, batch, query head): B * Hq programs that each read all of their KV
# head's keys, so each K/V tile is read G times (once per query head of a GQA group) and a GPU of
# 132 SMs runs only B * Hq programs. The decode kernels (templates/decode.py.jinja) fix both:
#   - rows: the G * Lq (query head, query) pairs of one KV head are the rows of one tile, so a K/V
#     tile is loaded once and multiplied against the whole group;
#   - splits (FlashDecoding): the KV blocks of a (b, KV head, row tile) are split among
#     `num_splits` programs, each writing a normalized partial output and its LSE; a second small
#     kernel merges them (the merge of flexfa/merge.py, in base 2). With one split the first kernel
#     writes the output directly.
# Block sparsity: rows of one tile may belong to different query heads and q-blocks, so the
# kernel walks *union lists* per (b, KV head, row tile): a KV block is listed when some row's tile
# is non-empty, as full when every row's tile is full (computed from the BlockMask's tile states,
# cached per BlockMask). On union-partial blocks the mask_mod decides per pair, which is exact when
# the tile states come from the mask (`BlockMask.tiles_from_mask`); for hand-built block lists the
# kernel reads each row's own tile state instead (ROW_STATES). Mods get `h` per row.
# The path runs when no gradient is needed and Lq <= MAX_LEN_Q (or always for paged K/V, which
# only these kernels read); kernel_options {"decode": False} turns it off, True forces it.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref

import torch

from flexfa.blockmask.block_mask import BlockList, BlockMask, TileState
from flexfa.codegen.triton import configs as cfgs
from flexfa.codegen.triton import emit
from flexfa.codegen.triton.decode_configs import (
    DecodeConfig,
    _next_pow2,
    _num_sms,
    default_config,
    row_tile,
)
from flexfa.codegen.triton.module import load_module
from flexfa.codegen.triton.params import KernelKey, ModuleKey
from flexfa.codegen.triton.plan import plan_key
from flexfa.layout import empty_like_query
from flexfa.runtime.launch import DirectLaunch, KernelLaunch, current_raw_stream, launch
from flexfa.runtime.persist import persistent
from flexfa.spec import AttentionSpec

#: The longest query the decode path takes by default (longer ones use the attention kernel).
MAX_LEN_Q = 64


def applies(spec: AttentionSpec) -> bool:
    """Whether a call takes the decode path (Note [Decode kernels])."""
    if spec.paged is not None:
        return True
    wanted = spec.kernel_options.get("decode", "auto")
    if wanted not in (True, False, "auto"):
        raise ValueError(f"kernel_options['decode'] must be True, False or 'auto', got {wanted!r}")
    if spec.needs_grad or spec.max_scores or wanted is False:
        return False  # the decode kernels write no max_scores
    return wanted is True or (spec.len_q <= MAX_LEN_Q and spec.len_kv > spec.len_q)


# -- union lists ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class UnionLists:
    """kv-side lists per (b, KV head, row tile) and the tile states they came from."""

    partial: BlockList  # [B', Hkv', tiles, kv-blocks]
    full: BlockList
    states: torch.Tensor  # int8 [B', H', q-blocks, kv-blocks], the BlockMask's
    has_partial: bool
    has_full: bool
    max_blocks: int  # most blocks (partial + full) any row tile walks
    dense: bool  # every row tile lists every KV block as full (Note [Dense decode])


_union_cache: weakref.WeakKeyDictionary[BlockMask, dict[tuple, UnionLists]] = (
    weakref.WeakKeyDictionary()
)


def union_lists(bm: BlockMask, heads_kv: int, group: int, len_q: int, block_m: int) -> UnionLists:
    """The union lists of `bm` for row tiles of `block_m` rows (cached per BlockMask)."""
    per_mask = _union_cache.setdefault(bm, {})
    key = (heads_kv, group, len_q, block_m)
    found = per_mask.get(key)
    if found is not None:
        return found
    states = bm.tile_states()
    Bs, Hs, _, nkv = states.shape
    rows = group * len_q
    tiles = -(-rows // block_m)
    dev = states.device
    # Padding rows repeat the last row: neutral for "any row" and "every row".
    r = torch.arange(tiles * block_m, device=dev).clamp(max=rows - 1)
    qb = (r % len_q) // bm.block_size.q
    if Hs == 1:
        st = states[:, :, qb]  # [Bs, 1, R, nkv]
    else:
        h = torch.arange(heads_kv, device=dev)[:, None] * group + (r // len_q)[None, :]
        st = states[:, h, qb.expand_as(h)]  # [Bs, Hkv, R, nkv]
    st = st.reshape(Bs, st.shape[1], tiles, block_m, nkv)
    live = (st != int(TileState.EMPTY)).any(3)
    full = (st == int(TileState.FULL)).all(3)
    partial_list = BlockList.from_dense(live & ~full)
    full_list = BlockList.from_dense(full)
    counts = torch.stack(
        [
            partial_list.count.amax(),
            full_list.count.amax(),
            (partial_list.count + full_list.count).amax(),
            full_list.count.amin(),
        ]
    ).tolist()
    found = UnionLists(
        partial=partial_list,
        full=full_list,
        states=states,
        has_partial=counts[0] > 0,
        has_full=counts[1] > 0,
        max_blocks=int(counts[2]),
        dense=counts[0] == 0 and counts[3] == nkv,
    )
    per_mask[key] = found
    return found


# -- plans ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """What decode launches depend on beyond tensors: module, config, constexprs (cached)."""

    key: ModuleKey
    module: object
    config: DecodeConfig
    precision: str
    head_dim_pad: int
    head_dim_v_pad: int


_plans: dict[tuple, DecodePlan] = {}


@functools.lru_cache(maxsize=8)
def _capability(device: torch.device) -> tuple[int, int] | None:
    return cfgs.device_capability(device)


# Note [fp8 K/V in float16 dots]
# On the H200 the fp8 decode took as long as the bfloat16 one (docs/performance.md), though it
# reads half the bytes. Its PTX for sm_90 (Triton compiled without a GPU, by a one-off script: bench/fp8_ptx.py in git history) shows
# why: converting a K/V element from float8_e4m3fn to bfloat16 takes half a `cvt.rn.f16x2.e4m3x2`
# (two elements) and a whole `cvt.bf16.f16`, 1.5 conversions per element, for 128 + 256 of them
# per K and V tile and thread; at Hopper's conversion rate that is about as many elements per
# clock as the memory delivers bytes. So with a bfloat16 q (`F16_DOT`) the dots run in float16:
# K and V need only the first conversion, and p goes to float16 instead of bfloat16 (as cheap,
# and more precise). q is converted once per program, each row scaled by a power of 2 that puts
# its largest |q| in (2**13, 2**14]: float16 then holds every bfloat16 value of the row exactly
# down to 2**-28 of its largest (smaller ones lose at most 2**-38 of it, far below bfloat16's own
# rounding), cannot overflow, and the scores are scaled back exactly through sm_scale. Float16 q
# needs none of this; its dots were float16 already. Whether this makes the fp8 decode faster is
# for the next GPU run to measure.
#
# Note [Fused merge]
# With splits, each split writes its normalized partial output and base-2 LSE, then takes a ticket
# (an atomic add on a per-(b, KV head, row tile) counter, acquire-release, after a barrier so that
# all of the program's stores come first); the program that draws the last ticket merges the splits
# and sets the counter back to 0. This saves the merge kernel's launch (host time matters at 4k
# keys) and its gap on the GPU. The counters live in one zeroed buffer per (device, stream), so
# calls on different streams never share them; a call captured in a CUDA graph gets its own from
# the graph's pool. It is the default since it ran on the H200 (tests/e2e/test_decode.py, eager and
# replayed in a CUDA graph): at Lq=1, B=8, Hq=32, Hkv=8, D=128 it took 61 us per eager call at 4k
# keys against 69 with the merge kernel (both launched directly, Note [Direct launches]), 258
# against 262 at 32k and 966 against 972 at 128k, and the same GPU time in a CUDA graph
# (docs/performance.md, `bench/decode_host.py`). kernel_options {"decode_merge": "separate"} runs
# the merge as its own kernel.


def _plan(
    spec: AttentionSpec,
    mask,
    lists: UnionLists,
    tiles: int,
    capability: tuple[int, int] | None,
    force_compiled: bool,
) -> DecodePlan:
    base = plan_key(spec, mask, capability, force_compiled)
    page = spec.paged.page_size if spec.paged is not None else 0
    key = (
        None
        if base is None
        else (base, spec.len_q, spec.len_kv, spec.batch, lists.max_blocks, page)
    )
    found = _plans.get(key) if key is not None else None
    if found is not None:
        return found
    module_key, module = load_module(
        spec.score_mod, mask, frozenset(), force_compiled=force_compiled
    )
    if spec.dtype == torch.float32:
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    else:
        precision = "ieee"
    found = DecodePlan(
        key=module_key,
        module=module,
        config=default_config(spec, capability, lists.max_blocks, tiles, dense_lists=lists.dense),
        precision=precision,
        head_dim_pad=_next_pow2(spec.head_dim),
        head_dim_v_pad=_next_pow2(spec.head_dim_v),
    )
    if key is not None:
        _plans[key] = found
    return found


def _list_args(bl: BlockList) -> list:
    def bs(t: torch.Tensor, dim: int) -> int:
        return 0 if t.shape[dim] == 1 else t.stride(dim)

    return [bl.count, bl.index], [
        bs(bl.count, 0), bs(bl.count, 1), bl.count.stride(2),
        bs(bl.index, 0), bs(bl.index, 1), bl.index.stride(2),
    ]  # fmt: skip


@dataclasses.dataclass(eq=False)
class _Prepared:
    """Everything of a call's launches that its tensors' addresses do not change (cached)."""

    plan: DecodePlan
    config: DecodeConfig
    rows: int
    tiles: int
    part_size: int  # float32 elements of the partial outputs (0 with one split)
    lists_args: list  # block lists, tile states and their strides
    mask_args: list  # the mask_mod's captured tensors
    constexprs: dict
    merge_constexprs: dict
    label: str
    # After the first (logged) launch, the kernels are called directly (Note [Decode host time]).
    direct: tuple[DirectLaunch, DirectLaunch | None] | None = None
    # The compiled kernels of a repeated call's spec (Note [Decode launches by spec]).
    by_spec: dict[int, _SpecLaunches] = dataclasses.field(default_factory=dict)
    last_spec: AttentionSpec | None = None


# Note [Decode host time]
# A decode step is short (tens of microseconds at 4k keys), so the host must not add much: per
# BlockMask and call shape a `_Prepared` holds the plan, lists and constexprs, and after the first
# (logged) launch the kernels are called without building `KernelLaunch` records, through
# `DirectLaunch` (Note [Direct launches] in launch.py), which also skips most of Triton's own
# per-call work. A repeated inference call finds its `_Prepared` by its spec's identity
# (`_by_spec`), builds the merge kernel's arguments only when that kernel runs, and does not enter
# `no_grad` when gradients are off already: on the 2-core CPU its host work went from 16.2-19.0 to
# 14.2-15.8 us (`python bench/host_overhead.py`, four rounds interleaved with the code before),
# 20.7-23.0 to 18.7-20.2 with ALiBi and a sliding window. (A repeated inference call, Note
# [Repeated inference calls] in flexfa/api.py, passes the same AttentionSpec object every time;
# `_by_spec` keeps the last few, so their ids stay theirs.)
_prepared: weakref.WeakKeyDictionary[BlockMask, dict[tuple, _Prepared]] = (
    weakref.WeakKeyDictionary()
)
_by_spec: dict[int, tuple[AttentionSpec, _Prepared]] = {}
_BY_SPEC_KEPT = 16


def _prepare(
    spec: AttentionSpec,
    config_override: DecodeConfig | None,
    capability: tuple[int, int] | None,
    force_compiled: bool,
) -> _Prepared:
    bm = spec.block_mask
    mask = None if spec.mask.is_trivially_true else spec.mask
    G, Lq = spec.group_size, spec.len_q
    rows = G * Lq
    probe_m = row_tile(spec, capability)
    probe = union_lists(bm, spec.heads_kv, G, Lq, probe_m)
    plan = _plan(spec, mask, probe, -(-rows // probe_m), capability, force_compiled)
    cfg = config_override or plan.config
    lists = union_lists(bm, spec.heads_kv, G, Lq, cfg.block_m)
    tiles = -(-rows // cfg.block_m)
    splits = cfg.num_splits
    st = lists.states
    st_strides = [
        0 if st.shape[0] == 1 else st.stride(0),
        0 if st.shape[1] == 1 else st.stride(1),
        st.stride(2),
        st.stride(3),
    ]
    (pc, pi), p_strides = _list_args(lists.partial)
    (fc, fi), f_strides = _list_args(lists.full)
    paged = spec.paged
    bs = bm.block_size
    constexprs = dict(
        HEAD_DIM=spec.head_dim,
        HEAD_DIM_V=spec.head_dim_v,
        HEAD_DIM_PAD=plan.head_dim_pad,
        HEAD_DIM_V_PAD=plan.head_dim_v_pad,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        SPARSE_Q=bs.q,
        SPARSE_KV=bs.kv,
        EVEN_N=paged is None and spec.len_kv % bs.kv == 0,
        HAS_PARTIAL=lists.has_partial,
        HAS_FULL=lists.has_full,
        NUM_SPLITS=splits,
        PAGED=paged is not None,
        PAGE_SIZE=paged.page_size if paged is not None else 1,
        ROW_STATES=not bm.tiles_from_mask,
        FUSED_MERGE=cfg.fused_merge and splits > 1,
        INPUT_PRECISION=plan.precision,
        F16_DOT=spec.kv_fp8 and spec.dtype == torch.bfloat16,  # Note [fp8 K/V in float16 dots]
        DENSE=lists.dense and cfg.dense,
    )
    merge_constexprs = dict(
        HEAD_DIM_V=spec.head_dim_v,
        HEAD_DIM_V_PAD=plan.head_dim_v_pad,
        BLOCK_M=cfg.block_m,
        NUM_SPLITS=splits,
    )
    part = spec.batch * spec.heads_kv * splits * rows if splits > 1 else 0
    return _Prepared(
        plan=plan,
        config=cfg,
        rows=rows,
        tiles=tiles,
        part_size=part,
        lists_args=[pc, pi, fc, fi, *p_strides, *f_strides, st, *st_strides],
        mask_args=emit.capture_values(mask.tensors) if mask is not None else [],
        constexprs=constexprs,
        merge_constexprs=merge_constexprs,
        label=_label(spec, mask),
    )


# Note [Dense decode]
# A decode step with no mask, or with a mask that keeps every tile of the call (full union lists
# from block 0 on, nothing partial), can walk the KV blocks below kv_len without reading its lists
# (`DENSE`): the lists are full and ascending, so it visits the same tiles in the same order and
# gives the same bits. What that changed was Triton's software pipeline. In the listed walk each
# tile's address depended on a block id loaded in the loop, and the pipeliner kept one K/V tile in
# flight ahead of the one in use whatever `num_stages` said: compiled for sm_90 (B=8, Hq=32, Hkv=8,
# D=128, bf16), the kernel held 38.9 KB of shared memory at 2, 3 and 4 stages for Lq=1 and
# 81.9 KB for Lq=16. The dense walk honours the stages: 38.9 / 71.7 / 104.4 KB and 81.9 / 114.7 /
# 147.5 KB. (The listed and paged walks now load their ids a tile ahead and honour the stages as
# well: Note [Block ids a tile ahead].) On the H200 (`python bench/decode_host.py --lq 1,4,16
# --lkv 4096,32768,131072 --variants '[{"decode_dense": false}, {}]'`, docs/performance.md)
# that made the 64-row tiles of Lq=16 faster (32k keys: 284 -> 267 us, 128k: 1076 -> 994), where
# two programs of 114.7 KB still share an SM, but the 16-row tiles of Lq=1 and 4 slower (32k:
# 259 -> 301 us, 128k: 966 -> 1146):
# their 8 splits are sized for four programs per SM, and at 71.7 KB only three fit, so a second
# wave runs. Measured with stages and splits matched (the eighth decode run in
# docs/performance.md), the dense walk of 16-row tiles with 4 stages (104.4 KB) and 4 splits (two
# programs per SM) took 48.5 us at 4k keys in two runs against 50.1-50.6 listed (SDPA 49.5), and
# tied it at 32k and 128k (256.2 / 257.8 and 967.1 / 966.4 us); fp8 tiles the same way took 302 us
# at 64k keys against 309-312, and tied at 128k. So "auto" (the default of
# kernel_options["decode_dense"]) takes the dense walk on sm_90 and later everywhere but for row
# tiles under 64 rows of a paged cache (whose listed walk measured as fast: Note [Decode
# configs]), and tiles under 64 rows whose walk is dense take that launch shape (but for those of
# a contiguous 16-bit cache whose every tile is full, which now run 128-key tiles one program per
# SM: Note [Decode configs]). Older GPUs keep the listed walk 2 stages deep, 38.9 KB
# (Lq=1) and 81.9 KB (Lq=16) as before: 3 stages of 64-row tiles (114.7 KB) exceed the ~100 KB of
# shared memory of sm_86 and sm_89.


# Note [Block ids a tile ahead]
# A walk through block lists, or through a page table, finds each tile's address from ids it loads
# in the loop: the block id from the list, then the page id from the table. Written the plain way
# (load the ids, then the tile), Triton's pipeliner (3.6 and 3.9 alike) turns the id loads into
# asynchronous copies of their own, one buffer deep, and waits for every copy in flight at the top
# of each step: one K/V tile in flight whatever `num_stages` says (compiled for sm_90, B=8, Hq=32,
# Hkv=8, D=128, bf16, 64-key pages: 81.9 KB at 3 and 4 stages for Lq=16, `cp.async.wait_group 0`).
# So `flexfa_decode_inner` loads the next tile's block id and page id at the end of each step and
# carries them into the next: the loads are plain, their values are first used a step later, and
# the pipeliner schedules the K/V copies as on the dense walk (114.7 KB at 3 stages, the wait
# leaving two groups in flight). The same tiles in the same order, so the same bits. On an H200
# paged decode at Lq=16 went from 288 to 264-265 us at 32k keys and from 1097 to 976-983 at 128k
# (contiguous: 261-265 and 970-974), within 1% of the contiguous cache at every Lq of 1-16 at 32k
# and 128k keys, with the launch shapes of Note [Decode configs] (docs/performance.md).
def prepared(
    spec: AttentionSpec,
    config_override: DecodeConfig | None = None,
    capability: tuple[int, int] | None = None,
    force_compiled: bool = False,
) -> _Prepared:
    """The cached `_Prepared` of a call (Note [Decode host time])."""
    plain = config_override is None and capability is None and not force_compiled
    if plain:
        last = _by_spec.get(id(spec))
        if last is not None and last[0] is spec:
            return last[1]
    if capability is None and not force_compiled:
        capability = _capability(spec.device)
    paged = spec.paged
    key: tuple | None = (
        spec.score_mod.key if spec.score_mod is not None else None,
        spec.dtype,
        spec.k_dtype,
        spec.v_dtype,
        spec.device,
        spec.batch,
        spec.heads_q,
        spec.heads_kv,
        spec.len_q,
        spec.len_kv,
        spec.head_dim,
        spec.head_dim_v,
        None if paged is None else (paged.page_size, paged.num_pages),
        config_override,
        capability,
        force_compiled,
    )
    try:
        key = (*key, tuple(sorted(spec.kernel_options.items())))  # type: ignore[misc]
        hash(key)
    except TypeError:
        key = None
    per_mask = _prepared.setdefault(spec.block_mask, {})
    found = per_mask.get(key) if key is not None else None
    if found is None:
        found = persistent(  # Note [Caches under CUDA graphs]
            spec.device, lambda: _prepare(spec, config_override, capability, force_compiled)
        )
        if key is not None:
            per_mask[key] = found
    if plain and key is not None:
        if len(_by_spec) >= _BY_SPEC_KEPT:
            _by_spec.clear()
        _by_spec[id(spec)] = (spec, found)  # the spec is kept: its id stays its own
    return found


# Whether the current CUDA stream captures, from torch's C function where it has it (as Inductor
# reads it; the stream itself: `current_raw_stream` in launch.py). `torch.cuda.current_stream`
# builds a Python Stream object, which cost about 12 us of a decode step's host time on the H200's
# host (a cProfile of 500 4k steps).
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or (
    torch.cuda.is_current_stream_capturing
)


# Note [Decode scratch per stream]
# The splits' partial outputs and LSEs live only while their call's kernels run: the split kernel
# writes them and the merge (fused, or its own kernel) reads them, on the caller's stream. Launches
# on one stream run in order, so the calls on a stream can share that memory, as they share the
# fused merge's counters (Note [Fused merge]): both come from buffers kept per (device, stream),
# grown on demand, and the views of each call layout are kept, so a repeated call neither
# allocates nor slices for them (a `torch.empty` and a slice per call before; on the H200's host
# the step's three `torch.empty` calls took 7.8 us, docs/performance.md). A buffer replaced by a
# larger one is marked as used by the caller's stream, so that its memory is not handed out again
# while that stream's earlier calls may still read it. A call captured in a CUDA graph gets its
# own from the graph's pool, the counters zeroed by a captured memset at each replay: a capture
# stream lives only as long as the capture, and flexfa's cache builder may not synchronize during
# one. Off the GPU (Triton's interpreter) the buffers are kept per thread instead of per stream.
_counters: dict[tuple, torch.Tensor] = {}  # (device, stream): int32, left at 0 by the kernels
_partials: dict[tuple, torch.Tensor] = {}  # (device, stream): float32
_scratch_views: dict[tuple, tuple] = {}  # (device, stream, sizes): (out_part, lse_part, counters)
_VIEWS_KEPT = 64


def _grown(buffers: dict, key: tuple, size: int, dtype: torch.dtype) -> torch.Tensor:
    """The buffer kept under `key` = (device, stream), grown to at least `size` elements (new ones
    zeroed); growing one drops the views kept of that stream's buffers."""
    old = buffers.get(key)
    if old is not None and old.numel() >= size:
        return old
    device = key[0]
    buf = buffers[key] = persistent(  # Note [Caches under CUDA graphs]
        device, lambda: torch.zeros(max(size, 1024), dtype=dtype, device=device)
    )
    if old is not None and device.type == "cuda":
        old.record_stream(torch.cuda.current_stream(device))  # calls in flight may read it
    for k in [k for k in _scratch_views if k[:2] == key]:
        del _scratch_views[k]
    return buf


def _buffers(spec: AttentionSpec, prep: _Prepared, q, lse, stream: int | None) -> tuple:
    """A call's partial outputs and LSE, and the fused merge's counters (`lse` where unused; Note
    [Decode scratch per stream]); `stream`: the current CUDA stream (None: read it here)."""
    if not prep.part_size:
        return lse, lse, lse  # never touched with one split
    device = q.device
    part_out = prep.part_size * prep.plan.head_dim_v_pad
    count = spec.batch * spec.heads_kv * prep.tiles if prep.config.fused_merge else 0
    if device.type != "cuda":
        stream = threading.get_ident()  # the interpreter: one thread's calls run in order
    elif _capturing():  # a call of its own, from the graph's pool
        buf = torch.empty(part_out + prep.part_size, dtype=torch.float32, device=device)
        counters = torch.zeros(count, dtype=torch.int32, device=device) if count else lse
        return buf, buf[part_out:], counters
    elif stream is None:
        stream = current_raw_stream()
    key = (device, stream, part_out, prep.part_size, count)
    views = _scratch_views.get(key)
    if views is None:
        where = (device, stream)
        counters = _grown(_counters, where, count, torch.int32) if count else None
        buf = _grown(_partials, where, part_out + prep.part_size, torch.float32)
        if len(_scratch_views) >= _VIEWS_KEPT:
            _scratch_views.clear()
        views = _scratch_views[key] = (buf, buf[part_out : part_out + prep.part_size], counters)
    if views[2] is None:
        return views[0], views[1], lse  # no fused merge: the counters are never touched
    return views


def _score_args(spec: AttentionSpec) -> list:
    if spec.score_mod is None:
        return []
    return emit.mod_values(spec.score_mod, tuple(t.contiguous() for t in spec.score_mod.tensors))


def _call_args(
    spec: AttentionSpec, prep: _Prepared, q, k, v, out, lse, stream: int | None = None
) -> tuple[list, list | None]:
    """The arguments of the split kernel and of the merge kernel (None: no merge kernel runs);
    `stream`: the current CUDA stream, where the call runs on a GPU (`_buffers`)."""
    out_part, lse_part, counters = _buffers(spec, prep, q, lse, stream)
    paged = spec.paged
    if paged is not None:
        page_args = [paged.page_table, paged.page_table.stride(0), paged.kv_lens]
    else:
        page_args = [lse, 0, lse]  # never read
    G = spec.group_size
    args = [
        q, k, v, out, lse, out_part, lse_part, counters,
        *q.stride(), *spec.kv_strides(k), *spec.kv_strides(v), *out.stride(), lse.stride(0),
        lse.stride(1), *prep.lists_args, *page_args,
        spec.len_q, spec.len_kv, spec.heads_kv, G, spec.scale,
        *_score_args(spec), *prep.mask_args,
    ]  # fmt: skip
    if not prep.part_size or prep.config.fused_merge:
        return args, None
    merge_args = [
        out_part, lse_part, out, lse,
        *out.stride(), lse.stride(0), lse.stride(1), spec.len_q, spec.heads_kv, G,
    ]  # fmt: skip
    return args, merge_args


def launches(
    spec: AttentionSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    config_override: DecodeConfig | None = None,
    *,
    capability: tuple[int, int] | None = None,
    force_compiled: bool = False,
) -> list[KernelLaunch]:
    """The decode launches of a call (split kernel, then the merge when there are splits).

    `capability` and `force_compiled` are for compiling without a GPU, as in offline.py."""
    prep = prepared(spec, config_override, capability, force_compiled)
    args, merge_args = _call_args(spec, prep, q, k, v, out, lse)
    plan, cfg = prep.plan, prep.config
    grid = (cfg.num_splits, spec.batch * spec.heads_kv, prep.tiles)
    result = [
        _launch(
            plan, spec, "decode", plan.module.flexfa_decode, grid, args, prep.constexprs, cfg,
            f"decode {prep.label}",
        )
    ]  # fmt: skip
    if cfg.num_splits > 1 and not cfg.fused_merge:
        merge_cfg = dataclasses.replace(cfg, num_warps=4, num_stages=1)
        result.append(
            _launch(
                plan, spec, "decode_merge", plan.module.flexfa_decode_merge,
                (spec.batch * spec.heads_kv, prep.tiles), merge_args, prep.merge_constexprs,
                merge_cfg, f"decode merge {prep.label}",
            )
        )  # fmt: skip
    return result


def _label(spec: AttentionSpec, mask) -> str:
    sm = spec.score_mod.name if spec.score_mod else "none"
    mm = mask.name if mask else "none"
    return f"(score_mod={sm}, mask_mod={mm}, {spec.dtype_name}, D={spec.head_dim})"


def _launch(plan, spec, name, kernel, grid, args, constexprs, cfg, label) -> KernelLaunch:
    return KernelLaunch(
        name=name,
        kernel=kernel,
        grid=grid,
        args=tuple(args),
        constexprs=constexprs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        key=KernelKey.for_spec(plan.key, name, spec, cfg, constexprs),
        label=label,
    )


def run(
    spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and LSE of a call through the decode kernels (no autograd: inference only)."""
    if torch.is_grad_enabled():  # a decode step under no_grad skips entering it again
        with torch.no_grad():
            return _run(spec, q, k, v)
    return _run(spec, q, k, v)


def _run(
    spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (spec.batch, spec.heads_q, spec.len_q, spec.head_dim_v)
    prep = prepared(spec)
    strides = _strides_of(spec, q, k, v)
    entry = prep.by_spec.get(id(spec))
    if entry is not None and (entry.spec is not spec or entry.strides != strides):
        entry = None
    if entry is not None:  # Note [Decode arguments by spec]
        out = torch.empty_strided(shape, entry.out_strides, dtype=q.dtype, device=q.device)
    else:
        out = empty_like_query(q, shape)  # Note [Output layout]
    lse = torch.empty(spec.batch, spec.heads_q, spec.len_q, dtype=torch.float32, device=q.device)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if prep.direct is None:
        kls = launches(spec, q, k, v, out, lse)
        for kl in kls:
            launch(kl)
        direct = [DirectLaunch(kl.kernel, kl.constexprs, kl.num_warps, kl.num_stages) for kl in kls]
        prep.direct = (direct[0], direct[1] if len(direct) > 1 else None)
        return out, lse
    # Note [Decode host time]: the same kernels, called directly.
    stream = current_raw_stream() if q.is_cuda else None
    if entry is not None:
        args, merge_args = entry.call_args(spec, prep, q, k, v, out, lse, stream)
    else:
        args, merge_args = _call_args(spec, prep, q, k, v, out, lse, stream)
    grid = (prep.config.num_splits, spec.batch * spec.heads_kv, prep.tiles)
    split, merge = prep.direct
    if entry is not None:  # Note [Decode launches by spec]
        known = entry.kernels.get(tuple([args[i].data_ptr() & 15 for i in entry.positions]))
        if known is not None:
            split.call_compiled(known[0], grid, args, stream)
            if merge is not None:
                merge.call_compiled(known[1], (grid[1], grid[2]), merge_args, stream)
            return out, lse
    split(grid, args)
    if merge is not None:
        merge((grid[1], grid[2]), merge_args)
    if prep.last_spec is not spec:  # a spec seen once is not kept
        prep.last_spec = spec
        return out, lse
    compiled = (split.compiled_for(args), merge.compiled_for(merge_args) if merge else None)
    if compiled[0] is None or (merge is not None and compiled[1] is None):
        return out, lse
    if entry is None:
        if len(prep.by_spec) >= _BY_SPEC_KEPT:
            prep.by_spec.clear()
        entry = prep.by_spec[id(spec)] = _SpecLaunches.of(spec, prep, strides, args, merge_args)
    entry.kernels[tuple([args[i].data_ptr() & 15 for i in entry.positions])] = compiled
    return out, lse


# Note [Decode launches by spec]
# A repeated inference call passes the same AttentionSpec object (Note [Repeated inference calls]
# in flexfa/api.py), whose key holds q's, k's and v's shapes, strides and dtypes, and the traced
# mods and the BlockMask by identity: every integer argument of its launches (strides, lengths,
# list strides) and every tensor's dtype are the same from call to call. What can change is where
# the tensors are: q, k and v are the caller's, and the page table, the captured tensors and the
# lists are the spec's own objects, whose storage a caller may still swap. So from the second call
# with a spec, `_Prepared.by_spec` keeps, per those tensors' address alignments (mod 16, what
# Triton specializes on), the compiled kernels the direct launch found, and later calls launch
# them without the argument fingerprint (Note [Direct launches]), which took 18 us of a 4k decode
# step's host time on the H200's host. The tensors flexfa allocates for the call (out, LSE, the
# partial outputs and the merge's counters) come from torch's caching allocator at offsets fixed
# per `_Prepared`, so their alignment does not change.
# Note [Decode arguments by spec]
# The same entry keeps its calls' arguments: a split kernel takes about 40 (the call's tensors,
# their strides, the lengths, the lists and their strides, the mods' values), and building them
# with the output's layout (Note [Output layout]) was about a third of a repeated 4k decode step's
# host work on the 2-core CPU. Given the spec, they depend on the strides of the caller's q, k and
# v (and of the page table) alone: the rest is the spec's, its `_Prepared`'s, or flexfa's own
# allocations of fixed layout. So the entry keeps the arguments of the call that made it, less
# that call's tensors, with those strides and the output's; a later call with the same spec and
# strides copies them and puts its own q, k, v, output, LSE, partial outputs, counters and the
# score_mod's values (its captured tensors are made contiguous anew) in their places. A call with
# other strides (a spec passed around by hand) builds every argument, as before.
@dataclasses.dataclass(eq=False)
class _SpecLaunches:
    """The compiled kernels of one spec's calls, by the alignments of its caller's tensors, and
    the arguments of those calls less their tensors (Note [Decode arguments by spec])."""

    spec: AttentionSpec  # kept: its id stays its own
    positions: tuple[int, ...]  # of the tensors flexfa did not allocate, in the split's arguments
    strides: tuple  # q's, k's and v's (and the page table's) strides, which `args` hold
    out_strides: tuple[int, ...]
    args: list  # the split kernel's arguments, None where a call's tensors go
    merge_args: list | None  # the merge kernel's, likewise (None: no merge kernel runs)
    score_at: tuple[int, int]  # where the score_mod's values are in `args`
    lse_at: tuple[int, ...]  # where `args` take the call's LSE beyond its own place
    kernels: dict[tuple, tuple] = dataclasses.field(default_factory=dict)

    @staticmethod
    def of(
        spec: AttentionSpec, prep: _Prepared, strides: tuple, args: list, merge_args: list | None
    ) -> _SpecLaunches:
        """The entry of `spec` from one of its calls' arguments (`_call_args`'s), whose q, k and
        v (as the caller gave them) had these `_strides_of`."""
        out, lse = args[3], args[4]
        # q, k, v, out, LSE, partials and counters are the call's; so is the LSE where it stands
        # for arguments never read (the page table's of a contiguous cache).
        template = [None] * 8 + [_LSE if a is lse else a for a in args[8:]]
        end = len(args) - len(prep.mask_args)
        return _SpecLaunches(
            spec,
            _caller_tensors(args),
            strides,
            out.stride(),
            template,
            None if merge_args is None else [None] * 4 + merge_args[4:],
            (end - len(_score_args(spec)), end),
            tuple(i for i, a in enumerate(template) if a is _LSE),
        )

    def call_args(self, spec: AttentionSpec, prep: _Prepared, q, k, v, out, lse, stream):
        """`_call_args` of a call of `spec` whose q, k and v have this entry's `strides`, on
        `stream` (`_buffers`)."""
        out_part, lse_part, counters = _buffers(spec, prep, q, lse, stream)
        args = self.args.copy()
        args[:8] = q, k, v, out, lse, out_part, lse_part, counters
        for i in self.lse_at:
            args[i] = lse
        if spec.score_mod is not None:  # its tensors may be made contiguous anew
            args[self.score_at[0] : self.score_at[1]] = _score_args(spec)
        if self.merge_args is None:
            return args, None
        merge_args = self.merge_args.copy()
        merge_args[:4] = out_part, lse_part, out, lse
        return args, merge_args


_LSE = object()  # `_SpecLaunches.args`: the call's LSE goes here


def _strides_of(spec: AttentionSpec, q, k, v) -> tuple:
    """What of a call's tensors `_SpecLaunches.args` depend on, besides its spec."""
    paged = spec.paged
    page = paged.page_table.stride() if paged is not None else None
    return q.stride(), k.stride(), v.stride(), page


def _caller_tensors(args: list) -> tuple[int, ...]:
    """The positions of q, k, v and of every tensor after the counters (page table, captured
    tensors, lists) in the split kernel's arguments: args[3:8] are flexfa's own allocations."""
    return (0, 1, 2, *[i for i in range(8, len(args)) if type(args[i]) is torch.Tensor])


def clear_caches() -> None:
    """Forget decode plans (tests)."""
    _plans.clear()
    _prepared.clear()
    _by_spec.clear()
    _counters.clear()
    _partials.clear()
    _scratch_views.clear()
    _num_sms.cache_clear()
    _capability.cache_clear()
