"""Read the kernels flexfa generates: `export_source` (Python) and `python -m flexfa export` (CLI).

The generated module holds, in order: a notation header, helper functions, the mods as
`@triton.jit` functions named after yours (`score_mod_<name>`, its derivative
`score_mod_<name>_bwd`, `mask_mod_<name>`), then the forward and backward kernels that call them.

>>> import flexfa
>>> src = flexfa.export_source(flexfa.mods.softcap(30.0), flexfa.masks.causal)
>>> "def score_mod_softcap(" in src and "def mask_mod_causal(" in src
True
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flexfa.blockmask.block_mask import BlockMask
from flexfa.frontend.trace import TracedMod, trace_mask_mod, trace_score_mod
from flexfa.mods import HeadsDependentMod, bind_heads


@dataclasses.dataclass(frozen=True)
class ExportedModule:
    """A generated module: its source text, the key it is cached under, and where the cache keeps it
    (None when the disk cache is not usable)."""

    source: str
    key: Any
    path: Path | None

    def write(self, directory: str | Path) -> list[Path]:
        """Write `kernels.py` and `key.json` into `directory`; returns the paths written."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        src = out / "kernels.py"
        src.write_text(self.source)
        meta = out / "key.json"
        meta.write_text(json.dumps(dataclasses.asdict(self.key), indent=1) + "\n")
        return [src, meta]


def _trace_pair(
    score_mod: Callable[..., Any] | None,
    mask_mod: Callable[..., Any] | BlockMask | None,
    num_heads: int | None,
) -> tuple[TracedMod | None, TracedMod | None]:
    if isinstance(score_mod, HeadsDependentMod):
        if num_heads is None:
            raise ValueError(
                f"score_mod {score_mod.__name__} depends on the number of heads: pass num_heads="
            )
        score_mod = bind_heads(score_mod, num_heads)
    score = trace_score_mod(score_mod) if score_mod is not None else None
    if score is not None and score.is_identity:
        score = None
    if isinstance(mask_mod, BlockMask):
        mask: TracedMod | None = mask_mod.mask
    else:
        mask = trace_mask_mod(mask_mod) if mask_mod is not None else None
    if mask is not None and mask.is_trivially_true:
        mask = None
    return score, mask


def export_module(
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | BlockMask | None = None,
    *,
    num_heads: int | None = None,
    grad_captures: bool | None = None,
) -> ExportedModule:
    """The Triton module flexfa generates for these mods (see `export_source`)."""
    from flexfa.codegen.triton.module import load_module, module_dir
    from flexfa.runtime.diskcache import source_of

    score, mask = _trace_pair(score_mod, mask_mod, num_heads)
    if score is None:
        slots: frozenset[int] = frozenset()
    elif grad_captures is None:
        slots = score.grad_slots()
    elif grad_captures:
        slots = frozenset(c.slot for c in score.captures if c.dtype.is_float)
    else:
        slots = frozenset()
    key, module = load_module(score, mask, slots)
    directory = module_dir(key)
    path = directory / "kernels.py" if directory is not None else None
    return ExportedModule(source=source_of(module), key=key, path=path)


def export_source(
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | BlockMask | None = None,
    *,
    num_heads: int | None = None,
    grad_captures: bool | None = None,
) -> str:
    """The generated Triton source for a score_mod and a mask (forward and backward kernels).

    Args:
        score_mod: as for `flexfa.attention` (None for plain softmax attention).
        mask_mod: a mask_mod or a BlockMask (None for no mask).
        num_heads: the number of query heads, for mods that depend on it (`flexfa.mods.alibi`).
        grad_captures: whether the backward scatters gradients into the score_mod's captured
            float tensors; by default, for those that require grad.

    The text is what flexfa compiles: shapes, dtypes and tile sizes are compile-time constants
    chosen at launch, so one source serves every shape.
    """
    return export_module(
        score_mod, mask_mod, num_heads=num_heads, grad_captures=grad_captures
    ).source


def compile_ptx(
    score_mod: Callable[..., Any] | None,
    mask_mod: Callable[..., Any] | None,
    *,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seq_len: int = 4096,
    arch: int = 90,
) -> dict[str, str]:
    """PTX of each kernel for `sm_<arch>`, compiled here without a GPU (name -> PTX text)."""
    q = torch.empty(1, num_heads, seq_len, head_dim, dtype=dtype, requires_grad=True)
    kernels = compile_call(q, q, q, score_mod, mask_mod, arch=arch)
    return {name: k.asm["ptx"] for name, k in kernels.items()}


def compile_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Callable[..., Any] | None = None,
    block_mask: Any = None,
    *,
    arch: int = 90,
    with_backward: bool = True,
    **kwargs: Any,
) -> dict:
    """Compile every Triton kernel `flexfa.attention(q, k, v, ...)` would launch, for
    `sm_<arch>`, without a GPU: q, k, v may be CPU tensors, nothing runs. Returns {launch name:
    CompiledKernel}; keyword arguments are those of `flexfa.attention`."""
    from flexfa.api import build_spec
    from flexfa.codegen.triton.offline import compile_spec

    spec = build_spec(q, k, v, score_mod, block_mask, **kwargs)
    return compile_spec(spec, arch=arch, with_backward=with_backward)
