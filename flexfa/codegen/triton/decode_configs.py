"""Launch configurations of the decode kernels: tile sizes, splits, warps and stages per call
(Note [Decode configs]); the kernels and their launches are in decode.py."""

from __future__ import annotations

import dataclasses
import functools

import torch

from flexfa.codegen.triton import configs as cfgs
from flexfa.codegen.triton.params import _check_positive, _check_pow2
from flexfa.spec import AttentionSpec

# A split gets at least this many KV tiles (fewer would spend more time merging than reading).
_MIN_TILES_PER_SPLIT = 4
_MAX_SPLITS = 128


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tile sizes and launch options of the decode kernels."""

    block_m: int  # rows (query head, query) per program
    block_n: int  # keys per step
    num_splits: int  # programs per (b, KV head, row tile)
    num_warps: int = 4
    num_stages: int = 3
    fused_merge: bool = False  # Note [Fused merge]
    # Walk every block without the lists where all are full (Note [Dense decode]).
    dense: bool = False

    def __post_init__(self) -> None:
        _check_pow2("block_m", self.block_m)
        _check_pow2("block_n", self.block_n)
        for name in ("num_splits", "num_warps", "num_stages"):
            _check_positive(name, getattr(self, name))


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so that tests see the merge
    return torch.cuda.get_device_properties(device).multi_processor_count


def _next_pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


def row_tile(spec: AttentionSpec, capability: tuple[int, int] | None) -> int:
    """Rows (query head, query) per decode program: the GQA group's rows rounded up to a power of
    two (at least 16, at most 128; 32 in the interpreter), or kernel_options['decode_block_m']."""
    chosen = spec.kernel_options.get("decode_block_m")
    if chosen is not None:
        _check_pow2("kernel_options['decode_block_m']", chosen)
        return chosen
    rows = spec.group_size * spec.len_q
    return min(_next_pow2(rows), 128 if capability is not None else 32)


def default_config(
    spec: AttentionSpec,
    capability: tuple[int, int] | None,
    max_blocks: int,
    tiles: int,
    *,
    dense_lists: bool = False,
) -> DecodeConfig:
    """Tile sizes and splits for a call (Note [Decode configs]); `dense_lists`: every tile of the
    call is full (Note [Dense decode])."""
    opts = spec.kernel_options
    block_m = row_tile(spec, capability)
    sparse_kv = spec.block_mask.block_size.kv
    one_byte = spec.k_dtype.itemsize == spec.v_dtype.itemsize == 1
    dense = opts.get("decode_dense", "auto")
    if dense not in (True, False, "auto"):
        raise ValueError(
            f"kernel_options['decode_dense'] must be True, False or 'auto', got {dense!r}"
        )
    hopper = capability is not None and capability[0] >= 9
    if dense == "auto":
        # Note [Dense decode]: measured on sm_90, whose shared memory holds its deeper pipeline;
        # row tiles under 64 rows of a paged cache keep the listed walk.
        dense = capability is None or (hopper and (block_m >= 64 or spec.paged is None))
    # A contiguous 16-bit cache whose every tile is full, walked dense on sm_90 and later: its row
    # tiles run one program per SM (Note [Decode configs]).
    whole = hopper and dense and dense_lists and spec.paged is None and not one_byte
    if capability is None:
        block_n, warps, stages = 16, 4, 1
    else:
        # Note [Decode configs]: fp8 K/V take tiles of twice the keys, the same bytes per tile;
        # so do row tiles under 64 rows of a whole cache.
        page = spec.paged.page_size if spec.paged is not None else 128
        block_n = 128 if (one_byte and page % 128 == 0) or (whole and block_m < 64) else 64
        warps = 4 if block_m <= 64 else 8
        # fp8 tiles on Hopper: a deeper pipeline (5 stages; Note [Decode configs]).
        stages = 5 if one_byte and capability[0] >= 9 else 3
    block_n = cfgs._largest_pow2_divisor(sparse_kv, opts.get("decode_block_n", block_n))
    tiles_per_block = sparse_kv // block_n
    # Note [Decode configs]: on sm_90 and later, row tiles under 64 rows run 4 stages deep where
    # they walk dense (no page table) or hold fp8, else 3; two programs per SM, as the larger
    # tiles. Older GPUs run 2 stages (Note [Block ids a tile ahead] in decode.py). A whole cache
    # runs 64-row tiles 4 stages deep and smaller ones with 128 keys 3 deep, one program per SM.
    one_per_sm = whole and (block_m == 64 or (block_m < 64 and block_n == 128))
    if one_per_sm:
        stages = 4 if block_m == 64 else 3
    elif hopper and block_m < 64:
        stages = 4 if (dense and dense_lists and spec.paged is None) or one_byte else 3
    elif capability is not None and not hopper:
        stages = 2
    splits = opts.get("decode_splits")
    if splits is None:
        # Note [Decode configs]: a few programs per SM (two on sm_90 and later, and for tiles of
        # 64 rows or more; one for the tiles of a whole cache above), but each split keeps a few
        # KV tiles.
        programs = spec.batch * spec.heads_kv * tiles
        per_sm = 1 if one_per_sm else 2 if block_m >= 64 or hopper else 4
        want = max(1, round(per_sm * _num_sms(spec.device) / programs))
        most = max(1, (max_blocks * tiles_per_block) // _MIN_TILES_PER_SPLIT)
        splits = max(1, min(want, most, _MAX_SPLITS))
    merge = opts.get("decode_merge", "fused")  # Note [Fused merge]
    if merge not in ("fused", "separate"):
        raise ValueError(
            f"kernel_options['decode_merge'] must be 'fused' or 'separate', got {merge!r}"
        )
    return DecodeConfig(
        block_m=block_m,
        block_n=block_n,
        num_splits=int(splits),
        num_warps=int(opts.get("decode_num_warps", warps)),
        num_stages=int(opts.get("decode_num_stages", stages)),
        fused_merge=merge == "fused",
        dense=dense,
    )


# Note [Decode configs]
# Decoding reads every K/V byte once and computes little, so what matters is enough loads in
# flight: enough programs (about four per SM: splits = round(4 * SMs / (B * Hkv * row tiles))) and
# a pipeline a few tiles deep in each. On an H200 (132 SMs) with B * Hkv = 64, 8 splits beat 5 by
# 25% at Lq=16 and matched them at Lq=1 and 4; 2 splits lost 35-60% (docs/performance.md).
# Row tiles of 64 rows or more (Lq=16 with a GQA group of 4) hold more registers, two programs per
# SM, and there one wave of about two programs per SM was best: at Lq=16, 32k keys, 4 splits (256
# programs on 132 SMs) took 269-274 us against 291-300 for 8 and 321-333 for 6 (bench/decode.py
# --sweep, three H200 runs), so such tiles aim at two programs per SM rather than four. A split
# shorter than a few KV tiles costs more in its partial output and the merge than it saves, hence
# _MIN_TILES_PER_SPLIT.
# An fp8 KV cache (Note [fp8 K/V] in flexfa/spec.py) holds half the bytes per key, so its tiles
# have 128 keys rather than 64: the same bytes per load and in flight per pipeline stage as a 16-bit
# cache, and half as many loop iterations. Its registers are those of a 16-bit cache with 128-key
# tiles, which measured within 1-4% of 64-key tiles (docs/performance.md); the K/V tiles are
# converted to q's dtype after they reach registers. Paged caches whose pages are not a multiple of
# 128 keys keep 64-key tiles, which look up one page id per tile rather than one per key.
# On the H200 fp8 tiles want a deeper pipeline than 16-bit ones: at Lq=1, B=8, Hkv=8, 128-key fp8
# tiles took 595 us at 128k keys with 5 stages against 696 with 3, and 311 against 359 at 64k (7 and
# 8 stages were no better than 5; 64-key fp8 tiles took 720 us at 128k with 5 stages against 974
# with 3), while a bfloat16 cache lost 11% with 5 (1093 against 984 us). So sm90 and later run fp8
# tiles with 5 stages (5 x 32 KB of K and V in flight fits Hopper's shared memory).
# All of the above was measured when the listed walk's pipeline kept one tile in flight whatever
# the stages (Note [Dense decode] in decode.py). Row tiles under 64 rows that walk dense (every
# tile full, no page table) run 4 stages deep, 104.4 KB for a 16-bit cache and 106.5 KB for fp8 on
# sm_90, so two programs share an SM, and their splits aim at two programs per SM like the 64-row
# tiles: 4 splits at B * Hkv = 64 on an H200, which measured 0-4% faster than the listed walk's 8
# (16-bit, 4k-128k keys) and 3% faster for fp8 at 64k keys, a tie at 128k; 8 splits with 3 stages
# made a second wave (16-26% slower), as did fp8's 5 stages with any split count.
# Since the walks through block lists and page tables load their ids a tile ahead (Note [Block
# ids a tile ahead] in decode.py) their pipelines honour the stages too, and on sm_90 they take the
# same launch shape: two programs per SM. On an H200 (`python bench/decode.py --lkv
# 4096,32768,131072 --lq 1,4,16 --systems sdpa,flexfa,paged --masked --variants ...`, 64-key pages
# in random order, Lq=1 and 4) the paged listed walk with 3 stages took 257-259 us at 32k keys and
# 966-974 at 128k with 4 splits, 308-321 and 1156-1226 with 8 (a second wave at 71.7 KB), 259-264
# and 981-992 with 4 stages and 4 splits; the masked steps of Lq=1 (ALiBi + sliding window 4096,
# and a document mask) took 50.2-50.5 and 40.9-41.4 us in CUDA graphs with 4 splits against
# 55.4 and 45.4-45.7 with 8. fp8 tiles on those walks run 4 stages (106.5 KB), as on the dense
# walk: paged fp8 took 390-391 us at 64k keys and 758-763 at 128k against 399-404 and 774-781
# before. GPUs before sm_90 run 2 stages: the depth the listed walk had, and shared memory that
# holds 64-row tiles on sm_86 and sm_89.
# 64-row tiles of a contiguous 16-bit cache walking dense (Lq=16 with a GQA group of 4, every tile
# full) run 4 stages deep on sm_90 and later: 147.5 KB of shared memory, so one program per SM, and
# their splits aim at one program per SM (2 at B * Hkv = 64 on an H200). There, in one process
# each (`python bench/decode_host.py --lkv 4096,32768,131072 --lq 1,4,16 --variants ...` and
# `python bench/decode.py --lkv 4096,32768,131072 --lq 16 --systems sdpa,flexfa,paged --variants
# ...`, two runs), they took 259-262 us at 32k keys and 960-975 at 128k against 264-269 and
# 979-1008 at 3 stages and two programs per SM. Paged caches lost with that launch (267-272 us at
# 32k, 1121-1288 at 128k, against 265 and 983) and keep the other. Row tiles of 16 rows padded to
# 64 (kernel_options {"decode_block_m": 64}) with either launch stayed within 1% of the defaults
# for Lq=1 and 4, so smaller row groups keep their 16-row tiles.
# 16-row and 32-row tiles of such a cache (Lq=1, 4 and 8 with a GQA group of 4) run one program per
# SM as well, with 128-key tiles 3 stages deep (139.3 KB of shared memory for 16-row tiles on sm_90,
# so one program fits; two programs of 64-key tiles 4 stages deep held 104.4 KB each): on an H200
# (B=8, Hq=32, Hkv=8, D=128, bf16; `python bench/decode_host.py --lkv 4096,32768,131072 --lq 1,4
# --rounds 5 --variants '[{}, {"decode_block_n": 64}]'`, the second the launch before, best of five
# interleaved rounds; GPU time in CUDA graphs) Lq=1 took 48.7 us at 4k keys, 252.0 at 32k and 937.4
# at 128k against 49.9, 253.0 and 947.8, Lq=4 49.3, 252.1 and 938.7 against 50.6, 254.6 and 952.3;
# the eager step at 128k keys went from 0.99x to 1.00x SDPA (935.5 against 937.2 us), and an earlier
# run timed the same launch at 956.5 against 970.6 (SDPA 959.7). With 64-key tiles at that launch (2
# splits, 4 stages) Lq=4 lost at 128k keys (978.6 us), so only 128-key tiles take it: a BlockMask of
# 64-key blocks, or kernel_options {"decode_block_n": 64}, keeps the launch measured for those.
# 32-row tiles (Lq=8) with that launch took 257.7 us at 32k keys and 979.6 at 128k against 264.9 and
# 1000.4 with 64-key tiles 4 stages deep, two programs per SM (`--lkv 32768,131072 --lq 8 --rounds 3
# --variants '[{}, {"decode_block_m": 32, "decode_block_n": 128, "decode_num_stages": 3,
# "decode_splits": 2}]'`, another H200).
# Loading the dense walk's K and V tiles by TMA (2-D tensor descriptors made per call) was also
# timed on the H200: the same GPU time within 0.5% at every Lq and length above, and 30-60 us more
# host time per call for the descriptors Triton's launcher encodes, so the pointer loads stay.
