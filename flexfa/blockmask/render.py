"""Pictures of a BlockMask: text (`to_string`, `str(bm)`) and a PNG (`plot`, needs matplotlib)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from flexfa.blockmask.block_mask import TileState

if TYPE_CHECKING:
    from flexfa.blockmask.block_mask import BlockMask

_FULL, _PARTIAL, _EMPTY = "██", "░░", "  "


def _limits(grid_size: int | tuple[int, int], rows: int, cols: int) -> tuple[int, int]:
    if isinstance(grid_size, int) and not isinstance(grid_size, bool):
        max_rows = max_cols = grid_size
    elif isinstance(grid_size, (tuple, list)) and len(grid_size) == 2:
        max_rows, max_cols = grid_size
    else:
        raise ValueError(f"grid_size must be an int or a (rows, cols) pair, got {grid_size!r}")
    for name, v in (("rows", max_rows), ("cols", max_cols)):
        if not isinstance(v, int) or (v < 1 and v != -1):
            raise ValueError(f"grid_size {name} must be a positive int or -1, got {v!r}")
    return (rows if max_rows == -1 else max_rows), (cols if max_cols == -1 else max_cols)


def _cells(states: torch.Tensor, row_step: int, col_step: int) -> list[str]:
    """One line per cell row: a cell is full / empty if all its tiles are, else partial."""
    nq, nkv = states.shape
    pad_r, pad_c = -nq % row_step, -nkv % col_step
    # Padding (-1) is neutral: it counts as full for "all full" and as empty for "all empty".
    padded = torch.full((nq + pad_r, nkv + pad_c), -1, dtype=torch.int8)
    padded[:nq, :nkv] = states
    blocks = padded.view((nq + pad_r) // row_step, row_step, (nkv + pad_c) // col_step, col_step)
    neutral = blocks == -1
    all_full = ((blocks == int(TileState.FULL)) | neutral).all(dim=3).all(dim=1)
    all_empty = ((blocks == int(TileState.EMPTY)) | neutral).all(dim=3).all(dim=1)
    lines = []
    for full_row, empty_row in zip(all_full.tolist(), all_empty.tolist()):
        chars = [_FULL if f else (_EMPTY if e else _PARTIAL) for f, e in zip(full_row, empty_row)]
        lines.append("".join(chars).rstrip())
    return lines


def to_string(bm: BlockMask, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
    """See `BlockMask.to_string`."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive int, got {limit!r}")
    states = bm.tile_states().cpu()
    B, H, nq, nkv = states.shape
    max_rows, max_cols = _limits(grid_size, nq, nkv)
    row_step, col_step = -(-nq // max_rows), -(-nkv // max_cols)
    out: list[str] = []
    planes = [(b, h) for b in range(B) for h in range(H)]
    for n, (b, h) in enumerate(planes):
        if n == limit:
            out.append(
                f"... {len(planes) - limit} more (b, h) planes; pass limit= or index the "
                "BlockMask (bm[b, h])"
            )
            break
        if len(planes) > 1:
            label = ", ".join(
                f"{name}={i}" for name, i, size in (("b", b, B), ("h", h, H)) if size > 1
            )
            out.append(f"({label})")
        out.extend(_cells(states[b, h], row_step, col_step))
    if row_step > 1 or col_step > 1:
        out.append(
            f"(each cell: {row_step} x {col_step} tiles of {bm.block_size.q} x {bm.block_size.kv})"
        )
    return "\n".join(out)


def plot(bm: BlockMask, path: str | os.PathLike[str], *, b: int = 0, h: int = 0) -> None:
    """See `BlockMask.plot`."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import ListedColormap
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(
            "BlockMask.plot needs matplotlib: pip install flexfa[plot] (or pip install matplotlib)"
        ) from e
    states = bm.tile_states().cpu()
    for name, i, size in (("b", b, bm.batch), ("h", h, bm.heads)):
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"{name} must be a non-negative int, got {i!r}")
        if size > 1 and i >= size:
            raise IndexError(f"{name}={i} is out of range for a BlockMask with {size} of them")
    plane = states[b if bm.batch > 1 else 0, h if bm.heads > 1 else 0].numpy()
    nq, nkv = plane.shape
    colors = ["#ffffff", "#9ecae1", "#08519c"]  # empty, partial, full
    width = min(12.0, max(4.0, nkv / 8))
    height = min(12.0, max(4.0, width * nq / max(nkv, 1)))
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.imshow(plane, cmap=ListedColormap(colors), vmin=0, vmax=2, interpolation="nearest")
    ax.set_xlabel(f"kv block ({bm.block_size.kv} keys)")
    ax.set_ylabel(f"q block ({bm.block_size.q} queries)")
    ax.set_title(
        f"{bm.mask.name}: Q_LEN={bm.q_len}, KV_LEN={bm.kv_len}, sparsity {bm.sparsity():.1f}%"
    )
    ax.legend(
        handles=[
            Patch(facecolor=c, edgecolor="black", label=label)
            for c, label in zip(colors, ("empty", "partial", "full"))
        ],
        loc="upper right",
        bbox_to_anchor=(1.0, -0.08),
        ncol=3,
        frameon=False,
    )
    fig.savefig(os.fspath(path), format="png", dpi=100, bbox_inches="tight")
