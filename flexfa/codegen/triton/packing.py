"""The sequence and position of every token of a packed batch in one Triton launch (Note [Packed
positions in one kernel] in flexfa/varlen.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flexfa.codegen.triton.launch import compiling_in_background, direct_default, launch_default

_BLOCK = 1024
_CONSTEXPRS = {"BLOCK": _BLOCK}


# Lengths change from batch to batch: no specialization on them, so no batch compiles again.
@triton.jit(do_not_specialize=["total", "num_seqs", "top", "steps"])
def flexfa_packed_positions(cu, seq, pos, total, num_seqs, top, steps, BLOCK: tl.constexpr):
    """seq[t] = the largest s < num_seqs with cu[s] <= t (binary search, steps top, top / 2, ...,
    1), pos[t] = t - cu[seq[t]], for the tokens t < total of this program's block."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = t < total
    s = tl.zeros([BLOCK], dtype=tl.int32)
    for k in range(steps):
        cand = s + (top >> k)
        inside = cand < num_seqs
        start = tl.load(cu + cand, mask=inside, other=0)
        s = tl.where(inside & (start <= t), cand, s)
    tl.store(seq + t, s, mask=ok)
    tl.store(pos + t, t - tl.load(cu + s), mask=ok)


def positions(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(seq, pos) of the tokens of offsets `cu` (int32, validated, summing to `total`), or None
    while the kernel compiles in the background or `cu` is not on the current device (the caller
    then computes them with torch)."""
    if cu.device.type == "cuda" and cu.device.index != torch.cuda.current_device():
        return None  # launches go to the current device
    num_seqs = cu.numel() - 1
    top = 1 << ((num_seqs - 1).bit_length() - 1) if num_seqs > 1 else 0
    steps = top.bit_length()
    seq = torch.empty(total, dtype=torch.int32, device=cu.device)
    pos = torch.empty(total, dtype=torch.int32, device=cu.device)
    grid = (triton.cdiv(total, _BLOCK),)
    args = (cu, seq, pos, total, num_seqs, top, steps)
    if direct_default(flexfa_packed_positions, _CONSTEXPRS).try_call(grid, args):
        return seq, pos
    from flexfa.blockmask.packed_fused import specialization

    fast_key = (id(flexfa_packed_positions), str(cu.device), specialization(args))
    label = "packed positions"
    warm = lambda: flexfa_packed_positions.warmup(*args, grid=grid, BLOCK=_BLOCK)
    if compiling_in_background(fast_key, label, flexfa_packed_positions, warm):
        return None
    launch_default(fast_key, label, flexfa_packed_positions, grid, args, _CONSTEXPRS)
    return seq, pos
