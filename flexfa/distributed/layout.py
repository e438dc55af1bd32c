"""Which global positions of the sequence each rank holds: the balancers.

A `Layout` lists, for every rank of a group, the contiguous pieces of the global sequence it holds,
in the order they are concatenated in its local tensor. `shard_sequence`, `unshard_sequence` and
`context_parallel_attention` all derive the same layout from `balance`, the sequence length and the
world size, so they agree without communicating.

# Note [Balancers]
# Attention under a causal mask costs more for late queries than for early ones, so contiguous
# shards ("none") leave the first ranks idle while the last one works: with W ranks the last one
# does (2W - 1) / W times the average. "head_tail" cuts the sequence into 2W equal chunks and gives
# rank r chunks r and 2W - 1 - r: every rank then holds one cheap and one expensive chunk, and the
# causal work is equal up to one chunk's diagonal. `Document(lengths)` serves packed documents: it
# cuts the sequence into W contiguous shards of (nearly) equal work, the work of a query being the
# number of keys it may see (its position inside its document plus one under a causal mask, the
# document's length otherwise). Its shards have unequal lengths; the ring and the all-gather handle
# that (the all-gather pads to the longest shard).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Document:
    """The `balance=` for packed documents: shards of equal work under a document mask.

    Args:
        lengths: the documents' lengths in sequence order; they must sum to the sequence length.
        causal: whether the mask is causal inside each document (the work of a query is then its
            position in its document plus one) or full (the document's length).

    >>> from flexfa.distributed import Document
    >>> Document([6, 2, 4]).layout(12, 2).pieces
    (((0, 5),), ((5, 7),))
    """

    lengths: tuple[int, ...]
    causal: bool = True

    def __post_init__(self) -> None:
        lengths = tuple(self.lengths) if isinstance(self.lengths, Sequence) else None
        if lengths is None or torch.is_tensor(self.lengths):
            lengths = tuple(int(n) for n in torch.as_tensor(self.lengths).reshape(-1).tolist())
        if not lengths or any(isinstance(n, bool) or int(n) != n or n < 1 for n in lengths):
            raise ValueError(
                f"Document lengths must be positive ints, one per document, got {self.lengths!r}"
            )
        object.__setattr__(self, "lengths", tuple(int(n) for n in lengths))

    def layout(self, length: int, world_size: int) -> Layout:
        total = sum(self.lengths)
        if total != length:
            raise ValueError(
                f"balance=Document(...) has documents of total length {total}, but the sequence "
                f"has length {length}"
            )
        if length < world_size:
            raise ValueError(
                f"sequence length {length} cannot be split across world size {world_size}: "
                "every rank needs at least one position"
            )
        work = torch.cat(
            [
                torch.arange(1, n + 1, dtype=torch.float64)
                if self.causal
                else torch.full((n,), float(n), dtype=torch.float64)
                for n in self.lengths
            ]
        )
        prefix = torch.cat([work.new_zeros(1), work.cumsum(0)])  # prefix[i]: work of 0..i-1
        goals = prefix[-1] * torch.arange(1, world_size, dtype=torch.float64) / world_size
        cuts = [0]
        for r, goal in enumerate(goals.tolist()):
            i = int(torch.searchsorted(prefix, goal))
            if i > 0 and goal - prefix[i - 1] < prefix[min(i, length)] - goal:
                i -= 1
            # Every rank keeps at least one position, the ones after it too.
            i = max(i, cuts[-1] + 1)
            i = min(i, length - (world_size - 1 - r))
            cuts.append(i)
        cuts.append(length)
        pieces = tuple(((a, b - a),) for a, b in itertools.pairwise(cuts))
        return Layout(length, world_size, pieces)


@dataclasses.dataclass(frozen=True)
class Layout:
    """`pieces[r]`: the (global start, length) pieces rank r holds, in local order."""

    length: int
    world_size: int
    pieces: tuple[tuple[tuple[int, int], ...], ...]

    def local_length(self, rank: int) -> int:
        return sum(n for _, n in self.pieces[rank])

    @property
    def max_local_length(self) -> int:
        return max(self.local_length(r) for r in range(self.world_size))

    @property
    def equal(self) -> bool:
        return len({self.local_length(r) for r in range(self.world_size)}) == 1

    def chunks(self, rank: int) -> tuple[tuple[int, int, int], ...]:
        """(local start, global start, length) of each piece of `rank`."""
        out, local = [], 0
        for start, n in self.pieces[rank]:
            out.append((local, start, n))
            local += n
        return tuple(out)

    def global_index(self, rank: int) -> torch.Tensor:
        """The global position of every local position of `rank` (int64)."""
        return torch.cat([torch.arange(s, s + n) for s, n in self.pieces[rank]])


def resolve_layout(balance: object, length: int, world_size: int) -> Layout:
    """The layout `balance` gives a sequence of `length` over `world_size` ranks."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"the sequence length must be a positive int, got {length!r}")
    if isinstance(balance, Document):
        return balance.layout(length, world_size)
    if balance == "none":
        if length % world_size:
            raise ValueError(
                f"sequence length {length} cannot be split evenly across world size {world_size} "
                f"with balance='none' (it needs a multiple of {world_size})"
            )
        c = length // world_size
        return Layout(length, world_size, tuple(((r * c, c),) for r in range(world_size)))
    if balance == "head_tail":
        if length % (2 * world_size):
            raise ValueError(
                f"sequence length {length} cannot be split evenly across world size {world_size} "
                f"with balance='head_tail' (it needs a multiple of 2 * {world_size} = "
                f"{2 * world_size})"
            )
        c = length // (2 * world_size)
        return Layout(
            length,
            world_size,
            tuple(((r * c, c), ((2 * world_size - 1 - r) * c, c)) for r in range(world_size)),
        )
    if balance == "document":
        raise ValueError(
            "balance='document' needs the documents' lengths: pass "
            "balance=flexfa.distributed.Document(lengths)"
        )
    raise ValueError(
        f"balance must be 'none', 'head_tail' or flexfa.distributed.Document(lengths), got "
        f"{balance!r}"
    )
