"""The memory layout of outputs: the output follows q's (as torch FlexAttention's does).

# Note [Output layout]
# torch FlexAttention gives `out` the stride order of `q`: for q viewed from a (B, L, H, E) tensor
# with `transpose(1, 2)`, out is (B, L, H, Ev) in memory too, so the usual `out.transpose(1, 2)
# .reshape(B, L, H * Ev)` that follows is free. flexfa uses the same rule: dims are filled from the
# smallest stride of q to the largest (equal strides keep the inner dim inner), and the head dim is
# moved innermost if that rule would not put it there (kernels write rows of the head dim).
"""

from __future__ import annotations

import torch


def fill_order(strides: tuple[int, ...]) -> list[int]:
    """Dims from innermost to outermost by stride (ties: the later dim is the inner one)."""
    outer_first = sorted(range(len(strides)), key=lambda d: strides[d], reverse=True)
    return list(reversed(outer_first))


def _strides(shape: tuple[int, ...], order: list[int]) -> list[int]:
    strides = [0] * len(shape)
    step = 1
    for dim in order:
        strides[dim] = step
        step *= shape[dim]
    return strides


def empty_like_query(
    q: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None
) -> torch.Tensor:
    """An uninitialized tensor of `shape` (q's, with another head dim) in q's stride order.

    >>> q = torch.randn(2, 5, 3, 8).transpose(1, 2)  # (B, H, L, E) over a (B, L, H, E) buffer
    >>> empty_like_query(q, (2, 3, 5, 16)).transpose(1, 2).is_contiguous()
    True
    """
    order = fill_order(q.stride())
    strides = _strides(shape, order)
    last = len(shape) - 1
    if strides[last] != 1:
        order.remove(last)
        strides = _strides(shape, [last, *order])
    return torch.empty_strided(shape, strides, dtype=dtype or q.dtype, device=q.device)


def row_major(t: torch.Tensor) -> torch.Tensor:
    """`t` with the row-major strides of its shape, copied only when they differ.

    torch calls a tensor contiguous whatever the strides of its size-1 dims, and `.contiguous()`
    keeps those strides; kernels that check strides (FA4's argument checks, Note [Aux tensor
    layouts] in flexfa/codegen/cute/launch.py) need the canonical ones.

    >>> t = torch.zeros(1, 1, 2)[..., :1]
    >>> t.is_contiguous(), t.stride(), row_major(t).stride()
    (True, (2, 2, 1), (1, 1, 1))
    """
    expected = _strides(tuple(t.shape), list(reversed(range(t.ndim))))
    if list(t.stride()) == expected:
        return t
    return t.clone(memory_format=torch.contiguous_format)
