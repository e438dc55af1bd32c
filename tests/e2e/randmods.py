"""Random score_mods and mask_mods, written as Python source from a small grammar.

Hypothesis draws an expression, we compile it into an ordinary Python function, and both flexfa
(through its tracer) and the reference (calling the function per pair) run that same function.

The grammar is built so that every generated mod is finite with finite derivatives at every pair,
masked or not, and has no discontinuity in a float value (comparisons only on integers and
captured bools): a rounding difference between float32 and float64 then moves the result by a
rounding error, never by a jump. Captured tensors:

- `tab`  float (H, 5), learnable       - `temp` float 0-dim, learnable
- `ids`  int32 (7,), values in [-3, 3]  - `keep` bool (6,)
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from hypothesis import strategies as st

from tests.mods import BuiltMod, Shape

_INT_VARS = ("q_idx", "kv_idx", "h", "b")
_CMP = ("<", "<=", ">", ">=", "==", "!=")
_DIVISORS = (-5, -4, -3, -2, 2, 3, 4, 7)
_TAB_COLS, _IDS_LEN, _KEEP_LEN = 5, 7, 6
_counter = itertools.count()


@st.composite
def int_expr(draw, depth: int = 2) -> str:
    """An int32 expression of the index variables (always contains at least one of them)."""
    if depth <= 0 or draw(st.integers(0, 3)) == 0:
        return draw(st.sampled_from(_INT_VARS))
    a = draw(int_expr(depth - 1))
    form = draw(st.integers(0, 11))
    if form == 0:
        return f"({a} + {draw(int_expr(depth - 1))})"
    if form == 1:
        return f"({a} - {draw(int_expr(depth - 1))})"
    if form == 2:
        return f"({a} * {draw(st.integers(-3, 3))})"
    if form == 3:
        return f"({a} // {draw(st.sampled_from(_DIVISORS))})"
    if form == 4:
        return f"({a} % {draw(st.sampled_from(_DIVISORS))})"
    if form == 5:
        return f"torch.abs({a})"
    if form == 6:
        fn = draw(st.sampled_from(["torch.minimum", "torch.maximum"]))
        return f"{fn}({a}, {draw(int_expr(depth - 1))})"
    if form == 7:
        lo = draw(st.integers(-6, 3))
        return f"torch.clamp({a}, {lo}, {lo + draw(st.integers(0, 6))})"
    if form == 8:
        return f"torch.where({draw(bool_expr(depth - 1))}, {a}, {draw(int_expr(depth - 1))})"
    if form == 9:
        return f"({a} + {draw(st.integers(-9, 9))})"
    if form == 10:
        return f"(-{a})"
    return f"ids[({a}) % {_IDS_LEN}]"


@st.composite
def bool_expr(draw, depth: int = 2) -> str:
    """A bool expression: comparisons of integers, & | ~, and a captured bool table."""
    form = draw(st.integers(0, 5)) if depth > 0 else draw(st.integers(0, 1))
    if form == 0:
        rhs = draw(st.one_of(int_expr(max(depth - 1, 0)), st.integers(-4, 20).map(str)))
        return f"({draw(int_expr(max(depth - 1, 0)))} {draw(st.sampled_from(_CMP))} {rhs})"
    if form == 1:
        return f"keep[({draw(int_expr(max(depth - 1, 0)))}) % {_KEEP_LEN}]"
    if form == 2:
        return f"({draw(bool_expr(depth - 1))} & {draw(bool_expr(depth - 1))})"
    if form == 3:
        return f"({draw(bool_expr(depth - 1))} | {draw(bool_expr(depth - 1))})"
    if form == 4:
        return f"(~{draw(bool_expr(depth - 1))})"
    a = draw(int_expr(depth - 1))
    return f"(({a}) % {draw(st.sampled_from((2, 3, 5)))} == 0)"


@st.composite
def float_leaf(draw) -> str:
    form = draw(st.integers(0, 7))
    if form <= 2:
        return "score"
    if form == 3:
        return f"tab[h, ({draw(int_expr(1))}) % {_TAB_COLS}]"
    if form == 4:
        return "temp"
    i = draw(int_expr(1))
    return draw(
        st.sampled_from(
            [
                f"torch.tanh({i} * 0.1)",
                f"(({i}) % 5) * 0.2",
                f"torch.cos({i} * 0.25)",
                f"torch.sign({i}) * 0.5",
            ]
        )
    )


_UNARY = (
    "torch.tanh({a})",
    "torch.sigmoid({a})",
    "torch.sin({a})",
    "torch.cos({a})",
    "torch.exp(torch.tanh({a}))",
    "torch.exp2(torch.tanh({a}))",
    "torch.log(1.0 + {a} * {a})",
    "torch.log2(torch.sigmoid({a}) + 0.5)",
    "torch.sqrt({a} * {a} + 0.5)",
    "torch.rsqrt({a} * {a} + 0.5)",
    "torch.abs({a})",
    "(torch.abs({a}) + 1.0) ** 1.5",
    "({a} ** 2)",
    "(-{a})",
    "torch.clamp({a}, -{c}, {c})",
    "({a} * {c})",
)
_BINARY = (
    "({a} + {b})",
    "({a} - {b})",
    "({a} * torch.tanh({b}))",
    "({a} / (1.0 + torch.abs({b})))",
    "torch.minimum({a}, {b})",
    "torch.maximum({a}, {b})",
)


@st.composite
def float_expr(draw, depth: int = 3) -> str:
    """A float expression, finite and continuous in its float inputs."""
    if depth <= 0 or draw(st.integers(0, 4)) == 0:
        return draw(float_leaf())
    form = draw(st.integers(0, 2))
    a = draw(float_expr(depth - 1))
    if form == 0:
        c = draw(st.sampled_from([0.5, 1.5, 2.0, -1.5]))
        return draw(st.sampled_from(_UNARY)).format(a=a, c=c)
    if form == 1:
        return draw(st.sampled_from(_BINARY)).format(a=a, b=draw(float_expr(depth - 1)))
    return f"torch.where({draw(bool_expr(1))}, {a}, {draw(float_expr(depth - 1))})"


@dataclasses.dataclass(frozen=True)
class RandomMod:
    """A generated mod: its kind and source; `build(shape, dtype)` compiles it with its captures."""

    kind: str
    source: str
    seed: int

    def build(self, shape: Shape, dtype: torch.dtype = torch.float32) -> BuiltMod:
        g = torch.Generator().manual_seed(self.seed)
        tab = (torch.randn(shape.heads, _TAB_COLS, generator=g) * 0.5).to(dtype)
        temp = (torch.rand((), generator=g) + 0.5).to(dtype)
        ids = torch.randint(-3, 4, (_IDS_LEN,), generator=g, dtype=torch.int32)
        keep = torch.randint(0, 2, (_KEEP_LEN,), generator=g).bool()
        tab.requires_grad_(True)
        temp.requires_grad_(True)
        namespace = {"torch": torch, "tab": tab, "temp": temp, "ids": ids, "keep": keep}
        code = compile(self.source, f"<random {self.kind} {next(_counter)}>", "exec")
        exec(code, namespace)
        fn = namespace[f"random_{self.kind}"]
        params = tuple(t for name, t in (("tab", tab), ("temp", temp)) if name in self.source)
        return BuiltMod(fn, params)

    def __str__(self) -> str:
        return self.source


@st.composite
def random_score_mods(draw) -> RandomMod:
    body = draw(float_expr())
    if draw(st.booleans()):
        body = f"score + {body}"
    source = f"def random_score_mod(score, b, h, q_idx, kv_idx):\n    return {body}\n"
    return RandomMod("score_mod", source, draw(st.integers(0, 2**16)))


@st.composite
def random_mask_mods(draw) -> RandomMod:
    source = f"def random_mask_mod(b, h, q_idx, kv_idx):\n    return {draw(bool_expr(3))}\n"
    return RandomMod("mask_mod", source, draw(st.integers(0, 2**16)))
