"""The exact tier on CUDA: one generated Triton kernel classifies a list of tiles.

The mask_mod is rendered as a device function by flexfa's Triton emitter
(`flexfa.codegen.triton.emit.emit_mod`); the kernel below runs one program per listed tile, calls
it on sub-tiles of `ROWS x COLS` pairs, and reduces "some pair allowed" and "every pair allowed"
to the tile's state. Memory is the list of tiles and one byte per tile; nothing else is stored.

Generated modules are cached in memory and on disk under `<cache>/blockmask/`, keyed by the mask's
IR digest, the kernel and emitter sources and the versions (as Note [Compile cache] in
flexfa/codegen/triton/module.py describes for the attention kernels), by the rules of
Note [Disk caches] in flexfa/runtime/diskcache.py.

Loads are guarded as everywhere in flexfa (Note [Loads out of bounds]), but this kernel does not
report out-of-bounds reads at allowed pairs; the CPU tier does.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import threading
import types

import torch

from flexfa.blockmask.grid import TileGrid, TileList
from flexfa.frontend.trace import TracedMod
from flexfa.runtime import diskcache
from flexfa.runtime.launch import runtime_ready

# The kernel; `{mask_fn}`, `{capture_params}` and `{capture_args}` are filled from the emitted
# mask function (names only: no logic is generated here).
_KERNEL = '''

@triton.jit
def flexfa_classify_tiles(
    tile_b, tile_h, tile_i, tile_j, states,
    Lq, Lkv,{capture_params}
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
    ROWS: tl.constexpr, COLS: tl.constexpr,
):
    """One program per listed tile: 2 if mask_mod allows every in-range pair, 0 if none, else 1."""
    t = tl.program_id(0)
    b = tl.load(tile_b + t)
    h = tl.load(tile_h + t)
    q0 = tl.load(tile_i + t) * BLOCK_Q
    kv0 = tl.load(tile_j + t) * BLOCK_KV
    seen_true = tl.zeros([ROWS, COLS], dtype=tl.int32)
    seen_false = tl.zeros([ROWS, COLS], dtype=tl.int32)
    for r in range(0, BLOCK_Q, ROWS):
        rows = r + tl.arange(0, ROWS)
        q_idx = q0 + rows
        row_ok = (rows < BLOCK_Q) & (q_idx < Lq)
        for c in range(0, BLOCK_KV, COLS):
            cols = c + tl.arange(0, COLS)
            kv_idx = kv0 + cols
            ok = row_ok[:, None] & ((cols < BLOCK_KV) & (kv_idx < Lkv))[None, :]
            allowed = {mask_fn}(b, h, q_idx[:, None], kv_idx[None, :]{capture_args})
            allowed = tl.where(allowed, 1, 0) + tl.zeros([ROWS, COLS], dtype=tl.int32)
            seen_true = tl.maximum(seen_true, tl.where(ok, allowed, 0))
            seen_false = tl.maximum(seen_false, tl.where(ok, 1 - allowed, 0))
    any_true = tl.max(tl.max(seen_true, 1), 0)
    any_false = tl.max(tl.max(seen_false, 1), 0)
    state = tl.where(any_false == 0, 2, tl.where(any_true == 0, 0, 1))
    tl.store(states + t, state.to(tl.int8))
'''

_ROWS, _COLS = 32, 64


def available() -> bool:
    """Whether Triton can be imported (the CUDA exact tier falls back to torch otherwise)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class _Key:
    mask: str
    kernel: str
    flexfa_version: str
    triton_version: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self)).encode()).hexdigest()


_modules: dict[str, types.ModuleType] = {}
_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _sources_digest() -> str:
    from flexfa.codegen.triton import module

    h = hashlib.sha256(_KERNEL.encode())
    h.update(module.templates_digest().encode())
    return h.hexdigest()[:16]


def _render(mask: TracedMod) -> str:
    from flexfa.codegen.triton import emit, module
    from flexfa.version import __version__

    fn = emit.emit_mod(mask, f"mask_mod_{mask.name}")
    names = [f"mm_{p}" for p in fn.params]
    prelude = (
        module.jinja_environment()
        .get_template("prelude.py.jinja")
        .render(flexfa_version=__version__)
    )
    kernel = _KERNEL.format(
        mask_fn=fn.name,
        capture_params="".join(f"\n    {n}," for n in names),
        capture_args="".join(f", {n}" for n in names),
    )
    return prelude + "\n\n" + fn.source + kernel


def load_kernel(mask: TracedMod):
    """The `flexfa_classify_tiles` kernel for `mask` (rendered, written and imported once)."""
    import triton

    from flexfa.version import __version__

    key = _Key(mask.key, _sources_digest(), __version__, triton.__version__)
    digest = key.digest
    with _lock:
        mod = _modules.get(digest)
        if mod is None:
            mod = diskcache.load_generated(
                "blockmask",
                digest[:24],
                lambda: _render(mask),
                f"flexfa_blockmask_{digest[:24]}",
                key=dataclasses.asdict(key),
            ).module
            _modules[digest] = mod
    return mod.flexfa_classify_tiles


def _pow2_at_most(n: int, cap: int) -> int:
    p = 1
    while p < n and p < cap:
        p *= 2
    return p


def classify_tiles(mask: TracedMod, grid: TileGrid, tiles: TileList) -> torch.Tensor:
    """Tile states int8 [T] of the listed tiles (see `flexfa.blockmask.exact.classify_tiles`)."""
    states = torch.empty(len(tiles), dtype=torch.int8, device=grid.device)
    if not len(tiles):
        return states
    kernel = load_kernel(mask)
    args: list = [
        t.to(device=grid.device, dtype=torch.int32) for t in (tiles.b, tiles.h, tiles.i, tiles.j)
    ]
    args += [states, grid.q_len, grid.kv_len]
    from flexfa.codegen.triton.emit import capture_values

    args += capture_values(mask.tensors)
    bs = grid.block_size
    runtime_ready()  # Note [Triton's start-up]
    kernel[(len(tiles),)](
        *args,
        BLOCK_Q=bs.q,
        BLOCK_KV=bs.kv,
        ROWS=_pow2_at_most(bs.q, _ROWS),
        COLS=_pow2_at_most(bs.kv, _COLS),
    )
    return states
