"""How the gradient of a captured tensor's load is added up, read from its index expressions.

Pure IR analysis, no code: the Triton emitter (emit.py, `_scatter_lines`) writes the lines of
the strategy chosen here, and the tile planner (plan.py) sizes the backward's tiles by it.

>>> import flexfa, torch
>>> from flexfa.ir.nodes import Op, toposort
>>> table = torch.zeros(8, 257)
>>> def relbias(score, b, h, q_idx, kv_idx):
...     return score + table[h, torch.clamp(q_idx - kv_idx, -128, 128) + 128]
>>> traced = flexfa.trace_score_mod(relbias)
>>> load = next(n for n in toposort([traced.output]) if n.op is Op.LOAD)
>>> scatter_strategy(load)
<ScatterStrategy.DIAGONAL: 'diagonal'>

# Note [Scatter-add of captured gradients]
# d loss / d capture[idx] sums `grad * d_load` over every (q, kv) pair whose load read capture[idx].
# One float atomic per pair serializes wherever many pairs share an index: a clamped relative
# distance sends every pair of every far tile to one entry (on an H200 that made a learnable
# relative bias 190x slower than a frozen one). So contributions are summed in registers first,
# and the way is chosen per load from its index expressions (`scatter_strategy`, static; the
# generated lines are `_scatter_lines` in emit.py, the run-time helpers in
# templates/prelude.py.jinja):
#   TILE      reads neither q_idx nor kv_idx (b, h, constants): the tile's sum, one atomic.
#   ROW       reads q_idx only: sums along the tile's kv axis, one atomic per query; COLUMN the same
#             for kv_idx. `Q_AXIS` says which tile axis runs over queries (dQ kernel 0, dK/dV 1).
#   DIAGONAL  every path from q_idx/kv_idx into the index passes through `q_idx - kv_idx` or a
#             comparison of the two (relative positions, clamped, T5 log buckets with their sign
#             test `kv_idx > q_idx`; `reads_only_distance`): the index is a function
#             of the distance d, constant along the tile's diagonals. It is evaluated once per
#             diagonal (q_idx := d, kv_idx := 0, a vector of 2 * max(rows, cols)); where all
#             diagonals give one offset (far tiles of a clamped distance) the tile's sum takes one
#             atomic, otherwise `flexfa_diagonal_sums` skews the tile with `tl.gather` (Triton
#             3.2 and later, and its interpreter) so that each diagonal is a column, and each
#             diagonal sum takes one atomic (rows + cols - 1 per tile).
#   BLOCKED   q_idx and kv_idx reach the index only through `q_idx // c` (or `q_idx >> k`) with c a
#             power of two, or directly (c = 1), and one of them through a c > 1 (a 2-D table
#             indexed by (q_idx // 64, kv_idx // 64), Swin-style windows; `block_sizes`): the index
#             is constant over aligned blocks of cq x ckv pairs, and tiles start at multiples of
#             their power-of-two sides, so `flexfa_block_sums` sums the tile per block (a reshape
#             and two sums) and the index is evaluated once per block (`flexfa_block_starts`):
#             one atomic per block with a nonzero sum, no run-time test. Packed batches read
#             positions from tensors, so their indices never take this way.
#   GENERAL   anything else (gathers through other tensors, packed-batch positions, an index
#             computed from the score, q_idx // c for c not a power of two):
#             `flexfa_scatter_tile` looks at the tile's live offsets at run time: all equal -> one
#             atomic of the tile's sum; two values -> two atomics; one offset per row (column) ->
#             one atomic per row (column); one per 16 x 16 sub-block (tiles are multiples of 16)
#             -> one atomic per sub-block; otherwise one per pair. Each test is a few reductions
#             of an int32 tile, cheap next to the tile's matmuls, and runs only where the previous
#             one failed. Only indices that change within 16 x 16 sub-blocks along both axes reach
#             the per-pair atomics; those spread over many entries, so contend little.
# Pairs outside `live` contribute 0 and are left out of every test.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence

from flexfa.ir.nodes import Node, Op, toposort

_POSITIONS = ("q_idx", "kv_idx")


class ScatterStrategy(enum.Enum):
    """How the gradient of one load of a captured tensor is added up (Note [Scatter-add of
    captured gradients])."""

    TILE = "tile"  # the index reads neither q_idx nor kv_idx: one atomic per tile
    ROW = "row"  # q_idx only: summed along the tile's kv axis, one atomic per query
    COLUMN = "column"  # kv_idx only: summed along the q axis, one atomic per key
    DIAGONAL = "diagonal"  # q_idx - kv_idx only: one atomic per tile diagonal
    BLOCKED = "blocked"  # q_idx // c, kv_idx // c': one atomic per block of the tile
    GENERAL = "general"  # anything else: decided per tile at run time


def _variables(nodes: Sequence[Node]) -> frozenset[str]:
    return frozenset(n.arg for n in toposort(list(nodes)) if n.op is Op.VAR)


def index_axes(load: Node) -> frozenset[str]:
    """Which of q_idx / kv_idx a load's indices depend on (decides how its gradient scatters)."""
    return _variables(load.srcs[1:]) & frozenset(_POSITIONS)


def _reach(nodes: Sequence[Node], stop: Callable[[Node], bool]) -> Iterator[Node]:
    """Every node `nodes` read, once each, without looking past a node for which `stop` holds."""
    seen: set[int] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        yield n
        if not stop(n):
            stack.extend(n.srcs)


def _is_distance(node: Node) -> bool:
    """`q_idx - kv_idx`, `kv_idx - q_idx`, or a comparison of the two (`kv_idx > q_idx`, as in
    T5's buckets): values of the distance alone, which keep their value when q_idx := q_idx -
    kv_idx and kv_idx := 0."""
    if node.op not in (Op.SUB, Op.LT, Op.LE, Op.EQ, Op.NE):
        return False
    names = tuple(s.arg if s.op is Op.VAR else None for s in node.srcs)
    return names in (("q_idx", "kv_idx"), ("kv_idx", "q_idx"))


def _is_position(node: Node) -> bool:
    return node.op is Op.VAR and node.arg in _POSITIONS


def reads_only_distance(nodes: Sequence[Node]) -> bool:
    """Whether every path from q_idx or kv_idx into `nodes` passes through a `q_idx - kv_idx` (or
    `kv_idx - q_idx`) node, so that their values are a function of the distance alone and do not
    change when q_idx := q_idx - kv_idx and kv_idx := 0."""
    found = False
    for n in _reach(nodes, _is_distance):
        if _is_distance(n):
            found = True
        elif _is_position(n):
            return False
    return found


# Note [Far tiles decided at their corners]
# A DIAGONAL index is a function f of the distance d = q_idx - kv_idx, and a tile spans the
# distances [dmin, dmax] (its corners). Most tiles of a clamped relative table are far: f takes
# one value on all of them. Deciding that from the vector of f on every diagonal takes its
# evaluation (2 * max(rows, cols) values) and two block-wide reductions per tile. When f is
# monotone in d, f is constant on [dmin, dmax] exactly when f(dmin) == f(dmax): two scalar
# evaluations decide it, and the vector is evaluated only for the tiles that need per-diagonal
# sums. `distance_direction` proves monotonicity structurally, from operations that keep order
# exactly (integer and float addition, multiplication or division by a constant of known sign,
# floor division and shifts by a positive constant, min, max, floor, ceil, casts other than to
# bool) and from the distance nodes themselves (a comparison of q_idx and kv_idx is a step in
# d). Transcendental functions are left out: their approximations need not keep order to the
# last bit, and a difference of one bit at a cast would put a diagonal's sum at another entry.
_SAME_ORDER = frozenset({Op.FLOOR, Op.CEIL, Op.CAST})


def _combine(a: int | None, b: int | None) -> int | None:
    """The direction of the sum of two functions of those directions (None: unknown)."""
    if a is None or b is None:
        return None
    if a == 0 or a == b:
        return b
    return a if b == 0 else None


def _constant_sign(node: Node) -> int | None:
    if node.op is not Op.CONST or isinstance(node.arg, bool):
        return None
    value = node.const_value()
    return (value > 0) - (value < 0) if isinstance(value, int | float) else None


def distance_direction(node: Node, memo: dict[int, int | None] | None = None) -> int | None:
    """+1 if `node` is a non-decreasing function of d = q_idx - kv_idx over a tile (b, h and
    lifted scalars held), -1 if non-increasing, 0 if it does not read the positions, None when
    that is not proved (Note [Far tiles decided at their corners])."""
    memo = {} if memo is None else memo
    key = id(node)
    if key not in memo:
        memo[key] = _direction(node, memo)
    return memo[key]


def _direction(n: Node, memo: dict[int, int | None]) -> int | None:
    op = n.op
    if op in (Op.CONST, Op.SCALAR):
        return 0
    if op is Op.VAR:
        return None if n.arg in (*_POSITIONS, "score") else 0
    if _is_distance(n):
        d_first = n.srcs[0].arg == "q_idx"  # q - kv (d), or kv - q (-d)
        if op is Op.SUB:
            return 1 if d_first else -1
        if op in (Op.LT, Op.LE):  # q < kv is d < 0: true below some d, a falling step
            return -1 if d_first else 1
        return None  # == and != are not monotone
    srcs = [distance_direction(s, memo) for s in n.srcs]
    if op is Op.CAST and n.dtype.is_bool and not n.srcs[0].dtype.is_bool:
        return None  # x != 0: not monotone
    if op in _SAME_ORDER or op is Op.NEG:
        return None if srcs[0] is None else (-srcs[0] if op is Op.NEG else srcs[0])
    if op in (Op.ADD, Op.MIN, Op.MAX):
        return _combine(srcs[0], srcs[1])
    if op is Op.SUB:
        return _combine(srcs[0], None if srcs[1] is None else -srcs[1])
    if op in (Op.MUL, Op.TRUEDIV, Op.FLOORDIV, Op.SHR):
        if srcs[0] == 0 and srcs[1] == 0:
            return 0
        if op is Op.MUL and srcs[0] == 0:  # c * f
            sign, f = _constant_sign(n.srcs[0]), srcs[1]
        else:  # f * c, f / c, f // c, f >> c
            sign, f = _constant_sign(n.srcs[1]), srcs[0]
        if sign is None or f is None or (op is not Op.MUL and sign <= 0):
            return None
        return f * sign
    return None


def monotone_in_distance(nodes: Sequence[Node]) -> bool:
    """Whether every node of `nodes` is proved monotone in the distance (each in either
    direction; Note [Far tiles decided at their corners])."""
    memo: dict[int, int | None] = {}
    return all(distance_direction(n, memo) is not None for n in nodes)


def _block_of(node: Node) -> tuple[str, int] | None:
    """(variable, c) for `q_idx // c` or `kv_idx >> k` (c = 2**k), c a power of two."""
    if node.op not in (Op.FLOORDIV, Op.SHR) or len(node.srcs) != 2:
        return None
    var, by = node.srcs
    if not _is_position(var) or by.op is not Op.CONST:
        return None
    value = by.const_value()
    if type(value) is not int:
        return None
    if node.op is Op.SHR:
        c = 1 << value if 0 <= value < 31 else 0
    else:
        c = value
    return (var.arg, c) if c >= 1 and c & (c - 1) == 0 else None


def block_sizes(nodes: Sequence[Node]) -> tuple[int, int]:
    """(cq, ckv): powers of two such that `nodes` keep their values over every block of cq aligned
    queries by ckv aligned keys, read from how q_idx and kv_idx reach them: only through
    `q_idx // c` (or `>> k`) gives that c (the smallest, if several), any other way 1."""
    sizes = {"q_idx": 0, "kv_idx": 0}  # 0: not reached
    for n in _reach(nodes, lambda n: _block_of(n) is not None):
        block = _block_of(n)
        if block is not None:
            var, c = block
            sizes[var] = c if not sizes[var] else min(sizes[var], c)
        elif _is_position(n):
            sizes[n.arg] = 1
    return max(sizes["q_idx"], 1), max(sizes["kv_idx"], 1)


def scatter_strategy(load: Node) -> ScatterStrategy:
    """The accumulation of a load's gradient, chosen from its index expressions (static)."""
    indices = load.srcs[1:]
    variables = _variables(indices)
    if "score" in variables:
        return ScatterStrategy.GENERAL  # an index computed from the score varies over any tile
    axes = variables & frozenset(_POSITIONS)
    if not axes:
        return ScatterStrategy.TILE
    if axes == {"q_idx"}:
        return ScatterStrategy.ROW
    if axes == {"kv_idx"}:
        return ScatterStrategy.COLUMN
    if reads_only_distance(indices):
        return ScatterStrategy.DIAGONAL
    if max(block_sizes(indices)) > 1:
        return ScatterStrategy.BLOCKED
    return ScatterStrategy.GENERAL
