"""Memory layouts a kernel must read correctly: what autograd and users really hand it.

`relayout(t, kind)` returns a tensor in the layout `kind`, built from `t` by differentiable views and
copies, so a test can put it between a leaf and the call: gradients still reach the leaf, and the
reference, given the same relayout of its own leaf, sees the same values.

- `contiguous`: `t` itself.
- `expanded`: stride 0 along the heads dimension (dim 1): every head holds head 0's values.
- `scalar`: stride 0 along every dimension, one value everywhere (what `x.sum()` gives as the
  gradient of `x`); the value is `t`'s mean, so that a constant cotangent stays O(1/sqrt(n)) and
  gradient sums over thousands of pairs stay O(1), where the three-way rule's atol is meant.
- `slice`: a narrow view of a tensor padded along its last dimension (rows farther apart than their
  length, as in `torch.cat([lse, other], -1)[..., :n]`).
- `step`: every other element of the last dimension (last stride 2).
- `permuted`: the dimensions stored in reverse order (`x.transpose(0, 2)` style).
- `offset`: contiguous, at a non-zero storage offset.
"""

from __future__ import annotations

import torch

LAYOUTS = ("contiguous", "expanded", "scalar", "slice", "step", "permuted", "offset")


def relayout(t: torch.Tensor, kind: str) -> torch.Tensor:
    """`t`'s values (for `expanded`/`scalar`: its first head / its mean) in layout `kind`."""
    if kind == "contiguous":
        return t
    if kind == "expanded":
        return t.narrow(1, 0, 1).expand(t.shape)
    if kind == "scalar":
        return t.mean().reshape([1] * t.ndim).expand(t.shape)
    if kind == "slice":
        pad = t.new_zeros(*t.shape[:-1], 3)
        return torch.cat([t, pad], -1)[..., : t.shape[-1]]
    if kind == "step":
        return torch.stack([t, torch.zeros_like(t)], -1)[..., 0]
    if kind == "permuted":
        dims = list(range(t.ndim))[::-1]
        return t.permute(dims).contiguous().permute(dims)
    if kind == "offset":
        flat = torch.cat([t.new_zeros(5), t.reshape(-1)])
        return flat[5:].view(t.shape)
    raise ValueError(f"unknown layout {kind!r}; expected one of {LAYOUTS}")


def describe(t: torch.Tensor) -> str:
    """Strides and storage offset, for failure messages."""
    return f"stride={tuple(t.stride())} offset={t.storage_offset()}"


TENSORS = ("q", "k", "v", "dout", "dlse")


def cycled(i: int) -> dict[str, str]:
    """A layout for each of q, k, v, dO and dLSE, different for each `i` (for parametrized tests)."""
    return {name: LAYOUTS[(i + 3 * j) % len(LAYOUTS)] for j, name in enumerate(TENSORS)}
