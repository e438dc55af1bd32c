"""Run one attention problem through a backend and through the reference, and compare.

`check_attention` is the whole three-way check (tests/tolerance.py) of one call: output, LSE, dq,
dk, dv and the gradients of captured tensors, for the kernel (any backend), the reference in the
kernel's dtype (eager) and the reference in float64 (truth). Score mods are passed as makers,
`dtype -> BuiltMod`, because the three runs need their own copies of learnable tensors (the truth
holds float64 copies of the same values).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

import flexfa
from flexfa.reference import reference_attention
from tests.e2e.layouts import describe, relayout
from tests.mods import BuiltMod, ModEntry, Shape
from tests.tolerance import ThreeWay

ModMaker = Callable[[torch.dtype], BuiltMod]

#: Triton tiles for the interpreter: 16 wide, so that tiny problems still have ragged tiles and
#: the kernels see several blocks.
INTERPRETER_TILES = {
    "block_m": 16,
    "block_n": 16,
    "bwd_block_m1": 16,
    "bwd_block_n1": 16,
    "bwd_block_m2": 16,
    "bwd_block_n2": 16,
}

_NO_SCORE_MOD = BuiltMod(fn=None)  # type: ignore[arg-type]  # score_mod=None


@dataclasses.dataclass(frozen=True)
class Problem:
    """Shapes and dtype of one attention call."""

    batch: int = 1
    heads_q: int = 2
    heads_kv: int = 2
    len_q: int = 17
    len_kv: int = 17
    head_dim: int = 16
    head_dim_v: int = 16
    dtype: torch.dtype = torch.float32
    batch_kv: int | None = None  # None: the same as batch; 1: K/V broadcast over the batch

    @property
    def enable_gqa(self) -> bool:
        return self.heads_q != self.heads_kv

    @property
    def shape(self) -> Shape:
        return Shape(self.batch, self.heads_q, self.len_q, self.len_kv)

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of learnable captured tensors on the kernel side (float32, or float64)."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32


def maker(entry: ModEntry | None, shape: Shape, seed: int = 0) -> ModMaker | None:
    """A catalog entry as a `dtype -> BuiltMod` maker (same values for every dtype)."""
    if entry is None:
        return None
    return lambda dtype: entry.build(shape, dtype=dtype, seed=seed)


def make_inputs(
    problem: Problem, seed: int, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """q, k, v and the cotangents dout, dlse, in the problem's dtype (values drawn in float64 on
    the CPU, so that every device gets the same values)."""
    g = torch.Generator().manual_seed(seed)
    p = problem

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=g, dtype=torch.float64).to(device=device, dtype=p.dtype)

    return {
        "q": randn(p.batch, p.heads_q, p.len_q, p.head_dim),
        "k": randn(p.batch_kv or p.batch, p.heads_kv, p.len_kv, p.head_dim),
        "v": randn(p.batch_kv or p.batch, p.heads_kv, p.len_kv, p.head_dim_v),
        "dout": randn(p.batch, p.heads_q, p.len_q, p.head_dim_v),
        "dlse": randn(p.batch, p.heads_q, p.len_q),
    }


def _grads(
    outputs: tuple[torch.Tensor, ...],
    cotangents: tuple[torch.Tensor, ...],
    inputs: list[torch.Tensor],
) -> list[torch.Tensor]:
    # An output that depends on no input (the LSE of a score_mod that ignores q and k) adds nothing.
    pairs = [(o, c) for o, c in zip(outputs, cotangents) if o.requires_grad]
    grads = torch.autograd.grad(
        [o for o, _ in pairs], inputs, [c for _, c in pairs], allow_unused=True
    )
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]


def _leaf(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return t.detach().to(dtype or t.dtype).clone().requires_grad_(True)


def check_attention(
    problem: Problem,
    *,
    score_mod: ModMaker | None = None,
    mask_mod: Callable[..., object] | None = None,
    block_size: int | tuple[int, int] | None = None,
    kernel_options: Mapping[str, Any] | None = None,
    backend: str = "tiled",
    scale: float | None = None,
    grad: bool = True,
    lse_grad: bool = True,
    seed: int = 0,
    atol: float | None = None,
    context: str = "",
    layouts: Mapping[str, str] | None = None,
    device: torch.device | str = "cpu",
    deterministic: bool = False,
) -> ThreeWay:
    """Compare `flexfa.attention(backend=...)` with the reference; raises AssertionError on failure.

    With `block_size` the kernel gets a BlockMask built by `flexfa.create_block_mask` at that tile
    size, otherwise the bare `mask_mod` (flexfa builds the BlockMask). The reference always uses the
    mask_mod alone: it checks the BlockMask as well as the kernel. Everything runs on `device`
    (the mods' captured tensors must be there too).

    `layouts` maps any of "q", "k", "v", "dout", "dlse" to a layout of tests/e2e/layouts.py: the
    inputs reach all three runs through the same differentiable relayout of their leaves, and the
    upstream gradients are handed to autograd in that layout (so the backward receives it).
    """
    p = problem
    data = make_inputs(p, seed, device)
    layouts = dict(layouts or {})
    for name in ("dout", "dlse"):
        if name in layouts:
            data[name] = relayout(data[name], layouts.pop(name))
    if set(layouts) - {"q", "k", "v"}:
        raise ValueError(f"layouts for unknown tensors: {sorted(set(layouts) - {'q', 'k', 'v'})}")

    def inputs(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        return [relayout(t, layouts.get(n, "contiguous")) for n, t in zip("qkv", leaves)]

    def build(dtype: torch.dtype) -> BuiltMod:
        # Each run gets its own copies of the learnable tensors (same values).
        return score_mod(dtype) if score_mod is not None else _NO_SCORE_MOD

    kernel_mod, eager_mod, truth_mod = (
        build(p.param_dtype),
        build(p.param_dtype),
        build(torch.float64),
    )

    if block_size is not None:
        block_mask: object = flexfa.create_block_mask(
            mask_mod if mask_mod is not None else flexfa.noop_mask,
            p.batch,
            p.heads_q,
            p.len_q,
            p.len_kv,
            device=device,
            BLOCK_SIZE=block_size,
        )
    else:
        block_mask = mask_mod

    # Kernel.
    q, k, v = (_leaf(data[n]) for n in "qkv")
    q_in, k_in, v_in = inputs([q, k, v])
    out, lse = flexfa.attention(
        q_in,
        k_in,
        v_in,
        score_mod=kernel_mod.fn,
        block_mask=block_mask,  # type: ignore[arg-type]
        scale=scale,
        enable_gqa=p.enable_gqa,
        return_lse=True,
        backend=backend,
        kernel_options=kernel_options,
        deterministic=deterministic,
    )
    lse_dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
    assert out.dtype == p.dtype, f"output dtype {out.dtype}, expected {p.dtype}"
    assert lse.dtype == lse_dtype, f"LSE dtype {lse.dtype}, expected {lse_dtype}"
    assert out.shape == (p.batch, p.heads_q, p.len_q, p.head_dim_v)
    assert lse.shape == (p.batch, p.heads_q, p.len_q)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "NaN in the kernel's output"

    # Eager torch in the kernel's dtype, and the float64 truth.
    qe, ke, ve = (_leaf(data[n]) for n in "qkv")
    out_e, lse_e = reference_attention(
        *inputs([qe, ke, ve]),
        eager_mod.fn,
        mask_mod,
        scale=scale,
        enable_gqa=p.enable_gqa,
        dtype=p.dtype,
    )
    qr, kr, vr = (_leaf(data[n], torch.float64) for n in "qkv")
    out_r, lse_r = reference_attention(
        *inputs([qr, kr, vr]), truth_mod.fn, mask_mod, scale=scale, enable_gqa=p.enable_gqa
    )

    if layouts or any(not data[n].is_contiguous() for n in ("dout", "dlse")):
        shown = {n: describe(t) for n, t in zip("qkv", (q_in, k_in, v_in))}
        shown.update({n: describe(data[n]) for n in ("dout", "dlse")})
        context = f"{context or repr(problem)} layouts {shown}"
    check = ThreeWay(p.dtype, atol=atol, context=context or repr(problem))
    check("out", out, out_e, out_r)
    check("lse", lse, lse_e, lse_r)
    if grad:
        names = ["dq", "dk", "dv", *(f"d_param{i}" for i in range(len(kernel_mod.params)))]
        cot_names = ("dout", "dlse") if lse_grad else ("dout",)
        runs = []
        for (o, l), inputs in (
            ((out, lse), [q, k, v, *kernel_mod.params]),
            ((out_e, lse_e), [qe, ke, ve, *eager_mod.params]),
            ((out_r, lse_r), [qr, kr, vr, *truth_mod.params]),
        ):
            outputs = (o, l) if lse_grad else (o,)
            cot = tuple(data[n].to(x.dtype) for n, x in zip(cot_names, outputs))
            runs.append(_grads(outputs, cot, inputs))
        for name, g_kernel, g_eager, g_truth in zip(names, *runs):
            assert not torch.isnan(g_kernel).any(), f"NaN in the kernel's {name}"
            check(name, g_kernel, g_eager, g_truth)
    check.assert_ok()
    return check


def finite_or_neg_inf(t: torch.Tensor) -> bool:
    """True when every entry is finite or -inf (what an LSE may hold)."""
    return bool(torch.all(torch.isfinite(t) | (t == -math.inf)))
