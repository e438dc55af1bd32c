"""What the CuTe and Triton code-generation tests share: the GPU test cases and their mod
builders and their check against the reference, and the golden snapshots of generated modules."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import torch

import flexfa
from flexfa import masks as fm
from flexfa import mods as fmods
from flexfa.reference import reference_attention
from tests.tolerance import ThreeWay


@dataclasses.dataclass(frozen=True)
class GpuCase:
    """One attention call of a GPU test at real sizes."""

    name: str
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_kv: int
    head_dim: int
    dtype: torch.dtype
    build: Callable  # (case, device) -> (score_mod | None, mask_mod | None, learnable params)

    def __str__(self) -> str:
        return (
            f"{self.name}-B{self.batch}-H{self.heads_q}/{self.heads_kv}-L{self.len_q}x{self.len_kv}"
            f"-D{self.head_dim}-{str(self.dtype).removeprefix('torch.')}"
        )

    @property
    def gqa(self) -> bool:
        return self.heads_q != self.heads_kv

    def qkv(self, dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Random q, k, v of this case's shapes, requiring grad."""
        shape_q = (self.batch, self.heads_q, self.len_q, self.head_dim)
        shape_kv = (self.batch, self.heads_kv, self.len_kv, self.head_dim)
        q = torch.randn(shape_q, device=dev, dtype=self.dtype, requires_grad=True)
        k = torch.randn(shape_kv, device=dev, dtype=self.dtype, requires_grad=True)
        v = torch.randn(shape_kv, device=dev, dtype=self.dtype, requires_grad=True)
        return q, k, v


def check_against_reference(case, q, k, v, score_mod, mask_mod, params, out, lse) -> None:
    """The kernel's `out` and `lse` for `case`, and the gradients a random dO gives q, k, v and
    the learnable `params`, against the float64 reference and the reference in the case's dtype
    (three-way rule); rows that see nothing (case "empty_rows", rows below 100) give output 0,
    LSE -inf and zero gradients; every gradient is finite."""
    do = torch.randn_like(out)
    inputs = (q, k, v, *params)
    grads = torch.autograd.grad(out, inputs, do)

    check = ThreeWay(case.dtype, context=str(case))
    for dtype, label in ((torch.float64, "ref"), (case.dtype, "eager")):
        o, l = reference_attention(q, k, v, score_mod, mask_mod, enable_gqa=case.gqa, dtype=dtype)
        g = torch.autograd.grad(o, inputs, do.to(o.dtype))
        if label == "ref":
            ref = (o, l, g)
        else:
            eager = (o, l, g)
    check("out", out, eager[0], ref[0])
    check("lse", lse, eager[1].float(), ref[1], atol=1e-3)
    names = ("dq", "dk", "dv", *(f"dparam{i}" for i in range(len(params))))
    for name, a, e, r in zip(names, grads, eager[2], ref[2]):
        check(name, a, e, r)
    check.assert_ok()
    if case.name == "empty_rows":
        assert torch.isneginf(lse[:, :, :100]).all()
        assert (out[:, :, :100] == 0).all()
        assert (grads[0][:, :, :100] == 0).all()
    for g in grads:
        assert torch.isfinite(g).all()


# -- mod builders of GpuCase: (case, device) -> (score_mod, mask_mod, learnable params) ----------
def causal(case, dev):
    return None, fm.causal, ()


def alibi_causal(case, dev):
    return fmods.alibi.bind(case.heads_q), fm.causal, ()


def softcap_window(case, dev):
    return fmods.softcap(20.0), fm.sliding_window(300), ()


def document_causal(case, dev):
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(50, 700, (64,), generator=g)
    ids = torch.repeat_interleave(torch.arange(64), lengths)[: case.len_q]
    ids = torch.stack([ids, ids.roll(37)]).sort(-1).values[: case.batch].to(dev)
    return None, fm.and_masks(fm.causal, fm.document(ids)), ()


def relative_bias(case, dev):
    g = torch.Generator().manual_seed(4)
    table = (0.5 * torch.randn(case.heads_q, 2 * 256 + 1, generator=g)).to(dev).requires_grad_()
    return fmods.relative_bias(table), fm.causal, (table,)


def no_mask(case, dev):
    return None, None, ()


def empty_rows(case, dev):
    # Rows below 100 see nothing: output 0, LSE -inf, zero gradients.
    return None, lambda b, h, q, kv: (q >= 100) & (kv <= q), ()


# -- golden snapshots -------------------------------------------------------------------------------
def golden_cases(**relative_bias_masks) -> dict[str, tuple]:
    """The (score_mod, mask_mod) pairs of the golden snapshots: ALiBi under a causal mask,
    softcapping under a document mask, and a learnable relative bias under each mask of
    `relative_bias_masks`, named relative_bias_<key>."""
    table = torch.zeros(8, 33, requires_grad=True)

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(q_idx - kv_idx, -16, 16) + 16]

    doc = torch.zeros(2, 64, dtype=torch.int32)
    return {
        "alibi_causal": (flexfa.mods.alibi.bind(8), flexfa.masks.causal),
        **{f"relative_bias_{k}": (relative_bias, m) for k, m in relative_bias_masks.items()},
        "softcap_document": (
            flexfa.mods.softcap(30.0),
            flexfa.and_masks(flexfa.masks.causal, flexfa.masks.document(doc)),
        ),
    }


def check_golden(src: str, path: Path, name: str, hint: str = "see the docstring") -> None:
    """`src` equals the golden file at `path`, byte for byte; with FLEXFA_UPDATE_GOLDEN set, it
    is written there first."""
    if os.environ.get("FLEXFA_UPDATE_GOLDEN"):
        path.write_text(src)
    assert path.exists(), f"no golden file {path.name}; run with FLEXFA_UPDATE_GOLDEN=1"
    assert src == path.read_text(), f"generated source for {name} changed; {hint}"
