"""Hypothesis strategies: random mask_mods (library masks, arithmetic on indices, data-dependent
masks reading tensors), random lengths and block sizes.

A drawn mask is a `MaskExpr`: a plain Python function that works on flexfa's traced values and on
broadcast index tensors alike (the oracle calls it directly), and its text for failure messages.
Captured tensors are sized for up to `MAX_B` batch elements, `MAX_H` heads and the longest
sequence, and every load stays in range.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from hypothesis import strategies as st

import flexfa
from flexfa import masks as fm
from tests.tiers import examples  # noqa: F401  (the tier's example counts, for the tests here)

MAX_B, MAX_H = 2, 3

#: Square and rectangular block sizes from 16 to 256, and a few that are not powers of two.
BLOCK_SIZES = st.sampled_from(
    [16, 32, 64, 128, 256, (16, 32), (32, 16), (64, 16), (16, 128), (128, 32), (24, 40), (48, 16)]
)


@dataclasses.dataclass(frozen=True)
class MaskExpr:
    fn: Callable[..., object]
    text: str

    def __repr__(self) -> str:
        return self.text


@dataclasses.dataclass(frozen=True)
class Tables:
    """Tensors the drawn masks read, sized for the case."""

    docs: torch.Tensor  # [MAX_B, L] int32, non-decreasing consecutive ids
    gappy_docs: torch.Tensor  # [L] int64, non-decreasing ids with gaps
    random_ids: torch.Tensor  # [L] int32, unsorted small ids
    windows: torch.Tensor  # [MAX_H] int32
    lengths: torch.Tensor  # [MAX_B] int32
    keep: torch.Tensor  # [5, 7] bool
    weights: torch.Tensor  # [L] float32


def _tables(seed: int, length: int) -> Tables:
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(MAX_B):
        sizes = torch.randint(1, 60, (length,), generator=g)
        docs.append(torch.repeat_interleave(torch.arange(length), sizes)[:length])
    gaps = torch.cumsum(
        torch.randint(0, 4, (length,), generator=g) * (torch.rand(length, generator=g) < 0.05), 0
    )
    return Tables(
        docs=torch.stack(docs).to(torch.int32),
        gappy_docs=gaps.to(torch.int64) * 3,
        random_ids=torch.randint(0, 3, (length,), generator=g).to(torch.int32),
        windows=torch.randint(1, 80, (MAX_H,), generator=g).to(torch.int32),
        lengths=torch.randint(0, length + 1, (MAX_B,), generator=g).to(torch.int32),
        keep=torch.randint(0, 2, (5, 7), generator=g).to(torch.bool),
        weights=torch.randn(length, generator=g),
    )


_COMPARE = {
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}
compare_ops = st.sampled_from(sorted(_COMPARE))
small = st.integers(-70, 70)


@st.composite
def atoms(draw, t: Tables) -> MaskExpr:
    kind = draw(
        st.sampled_from(
            [
                "library", "diff", "q", "kv", "chunk", "dilated", "negmod", "sum", "linear",
                "doc", "doc_order", "gappy", "random_ids", "head_window", "head_parity",
                "key_length", "table", "float", "where", "minmax", "int64", "bitwise", "clamp",
                "constant",
            ]
        )
    )  # fmt: skip
    op = draw(compare_ops)
    cmp = _COMPARE[op]
    if kind == "library":
        name = draw(
            st.sampled_from(["causal", "sliding", "sliding_bi", "prefix", "chunked", "dilated"])
        )
        w = draw(st.integers(1, 90))
        d = draw(st.integers(1, 5))
        fn = {
            "causal": fm.causal,
            "sliding": fm.sliding_window(w),
            "sliding_bi": fm.sliding_window(w, causal=False),
            "prefix": fm.prefix_lm(w),
            "chunked": fm.chunked(w),
            "dilated": fm.dilated_sliding_window(w, d),
        }[name]
        return MaskExpr(fn, f"{name}({w}, {d})")
    if kind == "diff":
        c = draw(small)
        return MaskExpr(lambda b, h, q, kv: cmp(q - kv, c), f"(q - kv {op} {c})")
    if kind == "q":
        c = draw(st.integers(-5, 170))
        return MaskExpr(lambda b, h, q, kv: cmp(q, c), f"(q {op} {c})")
    if kind == "kv":
        c = draw(st.integers(-5, 170))
        return MaskExpr(lambda b, h, q, kv: cmp(kv, c), f"(kv {op} {c})")
    if kind == "chunk":
        c1, c2 = draw(st.integers(1, 70)), draw(st.integers(1, 70))
        return MaskExpr(lambda b, h, q, kv: cmp(q // c1, kv // c2), f"(q // {c1} {op} kv // {c2})")
    if kind == "dilated":
        d = draw(st.integers(1, 6))
        r = draw(st.integers(0, 5)) % d
        return MaskExpr(lambda b, h, q, kv: torch.abs(q - kv) % d == r, f"(|q - kv| % {d} == {r})")
    if kind == "negmod":
        d = draw(st.integers(1, 7))
        c = draw(st.integers(-4, 4))
        return MaskExpr(
            lambda b, h, q, kv: ((kv - q) // d == c) | ((q - kv) % d < c),
            f"((kv - q) // {d} == {c} | (q - kv) % {d} < {c})",
        )
    if kind == "sum":
        m, c = draw(st.integers(1, 90)), draw(st.integers(0, 90))
        return MaskExpr(lambda b, h, q, kv: (q + kv) % m < c, f"((q + kv) % {m} < {c})")
    if kind == "linear":
        a, k, c = draw(st.integers(-3, 3)), draw(st.integers(-3, 3)), draw(st.integers(-200, 200))
        return MaskExpr(lambda b, h, q, kv: cmp(a * q - k * kv, c), f"({a}q - {k}kv {op} {c})")
    if kind == "doc":
        docs = t.docs
        return MaskExpr(
            lambda b, h, q, kv: docs[b, q] == docs[b, kv], "(docs[b, q] == docs[b, kv])"
        )
    if kind == "doc_order":
        docs = t.docs[0]
        return MaskExpr(lambda b, h, q, kv: cmp(docs[q], docs[kv]), f"(docs[q] {op} docs[kv])")
    if kind == "gappy":
        ids = t.gappy_docs
        return MaskExpr(lambda b, h, q, kv: cmp(ids[q], ids[kv]), f"(gappy[q] {op} gappy[kv])")
    if kind == "random_ids":
        ids = t.random_ids
        return MaskExpr(lambda b, h, q, kv: ids[q] == ids[kv], "(ids[q] == ids[kv])")
    if kind == "head_window":
        win = t.windows
        return MaskExpr(lambda b, h, q, kv: (q - kv < win[h]) & (kv <= q), "(0 <= q - kv < win[h])")
    if kind == "head_parity":
        return MaskExpr(lambda b, h, q, kv: h % 2 == 0, "(h % 2 == 0)")
    if kind == "key_length":
        lengths = t.lengths
        return MaskExpr(lambda b, h, q, kv: kv < lengths[b], "(kv < lengths[b])")
    if kind == "table":
        keep = t.keep
        return MaskExpr(lambda b, h, q, kv: keep[q % 5, kv % 7], "keep[q % 5, kv % 7]")
    if kind == "float":
        a = draw(st.floats(-2.0, 2.0, allow_nan=False, width=32))
        c = draw(st.floats(-50.0, 50.0, allow_nan=False, width=32))
        w = t.weights
        variant = draw(st.integers(0, 2))
        if variant == 0:
            return MaskExpr(
                lambda b, h, q, kv: cmp(q.float() * a - kv.float(), c), f"(q*{a} - kv {op} {c})"
            )
        if variant == 1:
            return MaskExpr(
                lambda b, h, q, kv: torch.sigmoid((q - kv).float() / 7.0) > 0.5 + a / 5,
                f"(sigmoid((q-kv)/7) > {0.5 + a / 5})",
            )
        return MaskExpr(
            lambda b, h, q, kv: cmp(w[q] + w[kv], c / 25), f"(w[q] + w[kv] {op} {c / 25})"
        )
    if kind == "where":
        w = draw(st.integers(0, 60))
        return MaskExpr(
            lambda b, h, q, kv: torch.where(q > kv, q - kv, kv - q) < w,
            f"(where-abs(q - kv) < {w})",
        )
    if kind == "minmax":
        c = draw(st.integers(0, 120))
        return MaskExpr(
            lambda b, h, q, kv: (torch.minimum(q, kv) < c) & (torch.maximum(q - c, kv) >= q - c),
            f"(min(q, kv) < {c} & max(q - {c}, kv) >= q - {c})",
        )
    if kind == "int64":
        m = draw(st.integers(2, 9))
        return MaskExpr(
            lambda b, h, q, kv: (q.to(torch.int64) * 1000003 + kv) % m == 0,
            f"((q * 1000003 + kv) % {m} == 0)",
        )
    if kind == "bitwise":
        k = draw(st.sampled_from([1, 3, 7, 12]))
        return MaskExpr(lambda b, h, q, kv: (q & k) == (kv & k), f"((q & {k}) == (kv & {k}))")
    if kind == "clamp":
        c = draw(st.integers(1, 30))
        return MaskExpr(
            lambda b, h, q, kv: torch.clamp(q - kv, -c, c) == c, f"(clamp(q - kv, ±{c}) == {c})"
        )
    value = draw(st.booleans())
    return MaskExpr(lambda b, h, q, kv: q.new_full((), value, dtype=torch.bool), f"{value}")


def combine(children: st.SearchStrategy[MaskExpr]) -> st.SearchStrategy[MaskExpr]:
    def binary(pair: tuple[MaskExpr, MaskExpr], how: str) -> MaskExpr:
        a, c = pair
        fa, fc = a.fn, c.fn
        fns = {
            "&": lambda b, h, q, kv: fa(b, h, q, kv) & fc(b, h, q, kv),
            "|": lambda b, h, q, kv: fa(b, h, q, kv) | fc(b, h, q, kv),
            "^": lambda b, h, q, kv: fa(b, h, q, kv) ^ fc(b, h, q, kv),
        }
        return MaskExpr(fns[how], f"({a.text} {how} {c.text})")

    def negate(a: MaskExpr) -> MaskExpr:
        fa = a.fn
        return MaskExpr(lambda b, h, q, kv: ~fa(b, h, q, kv), f"~{a.text}")

    def select(triple: tuple[MaskExpr, MaskExpr, MaskExpr]) -> MaskExpr:
        c, x, y = triple
        fc, fx, fy = c.fn, x.fn, y.fn
        return MaskExpr(
            lambda b, h, q, kv: torch.where(fc(b, h, q, kv), fx(b, h, q, kv), fy(b, h, q, kv)),
            f"where({c.text}, {x.text}, {y.text})",
        )

    pairs = st.tuples(children, children)
    return st.one_of(
        pairs.map(lambda p: binary(p, "&")),
        pairs.map(lambda p: binary(p, "|")),
        pairs.map(lambda p: binary(p, "^")),
        children.map(negate),
        st.tuples(children, children, children).map(select),
    )


@dataclasses.dataclass(frozen=True)
class Case:
    """A random create_block_mask problem."""

    mask: MaskExpr
    B: int | None
    H: int | None
    q_len: int
    kv_len: int
    block_size: int | tuple[int, int]

    @property
    def batch(self) -> int:
        return self.B or 1

    @property
    def heads(self) -> int:
        return self.H or 1


@st.composite
def masks(draw, q_len: int, kv_len: int, max_leaves: int = 4) -> MaskExpr:
    """A random mask whose captured tensors cover these lengths (and MAX_B, MAX_H)."""
    t = _tables(draw(st.integers(0, 2**16)), max(q_len, kv_len))
    return draw(st.recursive(atoms(t), combine, max_leaves=max_leaves))


@st.composite
def cases(draw, max_len: int = 160, max_leaves: int = 4) -> Case:
    q_len = draw(st.integers(1, max_len))
    kv_len = draw(st.one_of(st.just(q_len), st.integers(1, max_len)))
    mask = draw(masks(q_len, kv_len, max_leaves))
    B = draw(st.sampled_from([None, 1, 2]))
    H = draw(st.sampled_from([None, 1, 3]))
    variables = flexfa.trace_mask_mod(mask.fn).variables
    # A mask that reads b (or h) needs B (or H); give it one when None was drawn.
    if B is None and "b" in variables:
        B = MAX_B
    if H is None and "h" in variables:
        H = MAX_H
    return Case(mask, B, H, q_len, kv_len, draw(BLOCK_SIZES))
