"""The sequence and position of every token of a packed batch in one Triton launch (Note [Packed
positions in one kernel] in flexfa/varlen.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flexfa.runtime.launch import compiling_in_background, direct_default, launch_default

BLOCK = 1024  # tokens per program
_CONSTEXPRS = {"BLOCK": BLOCK}


@triton.jit
def flexfa_packed_seq(cu, t, num_seqs, top, steps):
    """The sequence of tokens `t`: the largest s < num_seqs with cu[s] <= t (a binary search,
    steps top, top / 2, ..., 1; `search` gives top and steps)."""
    s = t * 0
    for k in range(steps):
        cand = s + (top >> k)
        inside = cand < num_seqs
        start = tl.load(cu + cand, mask=inside, other=0)
        s = tl.where(inside & (start <= t), cand, s)
    return s


@triton.jit
def flexfa_packed_positions_block(
    cu, seq, pos, total, num_seqs, top, steps, block, BLOCK: tl.constexpr
):
    """seq[t] and pos[t] = t - cu[seq[t]] for the tokens t < total of block `block`."""
    t = block * BLOCK + tl.arange(0, BLOCK)
    ok = t < total
    s = flexfa_packed_seq(cu, t, num_seqs, top, steps)
    tl.store(seq + t, s, mask=ok)
    tl.store(pos + t, t - tl.load(cu + s), mask=ok)


# Lengths change from batch to batch: no specialization on them, so no batch compiles again.
@triton.jit(do_not_specialize=["total", "num_seqs", "top", "steps"])
def flexfa_packed_positions(cu, seq, pos, total, num_seqs, top, steps, BLOCK: tl.constexpr):
    """The positions of the tokens of this program's block (`flexfa_packed_positions_block`)."""
    flexfa_packed_positions_block(
        cu, seq, pos, total, num_seqs, top, steps, tl.program_id(0), BLOCK
    )


def search(num_seqs: int) -> tuple[int, int]:
    """(top, steps) of `flexfa_packed_seq` for `num_seqs` sequences."""
    top = 1 << ((num_seqs - 1).bit_length() - 1) if num_seqs > 1 else 0
    return top, top.bit_length()


def blocks(total: int) -> int:
    """The position blocks of `total` tokens."""
    return -(-total // BLOCK)  # not triton.cdiv: a constexpr function, slow on the host


def positions(cu: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, total: int) -> bool:
    """Write the positions of the tokens of offsets `cu` (int32, validated, summing to `total`)
    into `seq` and `pos`; False (nothing written) while the kernel compiles in the background or
    `cu` is not on the current device (the caller then computes them with torch)."""
    if cu.device.type == "cuda" and cu.device.index != torch.cuda.current_device():
        return False  # launches go to the current device
    num_seqs = cu.numel() - 1
    top, steps = search(num_seqs)
    grid = (blocks(total),)
    args = (cu, seq, pos, total, num_seqs, top, steps)
    if direct_default(flexfa_packed_positions, _CONSTEXPRS).try_call(grid, args):
        return True
    from flexfa.codegen.triton.blockmask.packed_fused import specialization

    fast_key = (id(flexfa_packed_positions), str(cu.device), specialization(args))
    label = "packed positions"
    warm = lambda: flexfa_packed_positions.warmup(*args, grid=grid, BLOCK=BLOCK)
    if compiling_in_background(fast_key, label, flexfa_packed_positions, warm):
        return False
    launch_default(fast_key, label, flexfa_packed_positions, grid, args, _CONSTEXPRS)
    return True
