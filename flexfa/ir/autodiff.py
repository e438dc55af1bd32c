"""Reverse-mode differentiation of a score_mod, so that nobody writes a backward by hand.

For a score_mod `out = f(score, b, h, q_idx, kv_idx, captures...)`, `score_mod_gradient` returns
- `d_score`: the expression for d out / d score, and
- one `LoadGradient` per LOAD from a captured tensor that requires grad: the expression for
  d out / d load. A backward pass multiplies both by the incoming gradient of the modified score and
  scatter-adds the second into the captured tensor's gradient at the load's indices.

Derivatives follow torch autograd's conventions at the kinks: d|x|/dx = sign(x) (0 at 0),
d max(a, b) splits the gradient evenly at ties, `where` routes the gradient to the chosen branch,
and floor/ceil/sign/comparisons have zero derivative.
"""

from __future__ import annotations

import dataclasses
import math

from flexfa.ir import build as irb
from flexfa.ir.dtypes import DType, arithmetic_type
from flexfa.ir.nodes import Node, Op, toposort
from flexfa.ir.simplify import simplify


@dataclasses.dataclass(frozen=True)
class LoadGradient:
    """d out / d (one load of a captured tensor). `load` is the LOAD node: capture and indices."""

    load: Node
    d_load: Node

    @property
    def slot(self) -> int:
        return self.load.srcs[0].arg.slot

    @property
    def indices(self) -> tuple[Node, ...]:
        return self.load.srcs[1:]


@dataclasses.dataclass(frozen=True)
class ScoreModGradient:
    d_score: Node
    loads: tuple[LoadGradient, ...]

    def roots(self) -> list[Node]:
        return [self.d_score, *(g.d_load for g in self.loads), *(g.load for g in self.loads)]


def _zero_like(node: Node) -> Node:
    return irb.fconst(0.0, node)


def _grad_rules(n: Node, g: Node) -> list[Node | None]:
    """Gradient contributions of `n`'s sources given the gradient `g` of `n` (None: no gradient)."""
    op, s = n.op, n.srcs
    f = lambda v: irb.fconst(v, n)
    if op is Op.ADD:
        return [g, g]
    if op is Op.SUB:
        return [g, irb.neg(g)]
    if op is Op.MUL:
        return [irb.mul(g, s[1]), irb.mul(g, s[0])]
    if op is Op.TRUEDIV:
        a, b = s
        return [irb.div(g, b), irb.neg(irb.div(irb.mul(g, a), irb.mul(b, b)))]
    if op is Op.NEG:
        return [irb.neg(g)]
    if op is Op.ABS:
        return [irb.mul(g, irb.unary(Op.SIGN, s[0]))]
    if op is Op.EXP:
        return [irb.mul(g, n)]
    if op is Op.EXP2:
        return [irb.mul(irb.mul(g, n), f(math.log(2.0)))]
    if op is Op.LOG:
        return [irb.div(g, s[0])]
    if op is Op.LOG2:
        return [irb.div(g, irb.mul(s[0], f(math.log(2.0))))]
    if op is Op.SQRT:
        return [irb.div(g, irb.mul(f(2.0), n))]
    if op is Op.RSQRT:
        return [irb.mul(irb.mul(g, f(-0.5)), irb.mul(n, irb.mul(n, n)))]
    if op is Op.TANH:
        return [irb.mul(g, irb.sub(f(1.0), irb.mul(n, n)))]
    if op is Op.SIGMOID:
        return [irb.mul(g, irb.mul(n, irb.sub(f(1.0), n)))]
    if op is Op.ERF:  # d erf(x) = 2 / sqrt(pi) * exp(-x^2)
        x = s[0]
        return [
            irb.mul(
                g, irb.mul(f(2.0 / math.sqrt(math.pi)), irb.unary(Op.EXP, irb.neg(irb.mul(x, x))))
            )
        ]
    if op is Op.SIN:
        return [irb.mul(g, irb.unary(Op.COS, s[0]))]
    if op is Op.COS:
        return [irb.neg(irb.mul(g, irb.unary(Op.SIN, s[0])))]
    if op is Op.POW:
        a, e = s
        ga = irb.mul(g, irb.mul(e, irb.binary(Op.POW, a, irb.sub(e, irb.fconst(1.0, e)))))
        ge = None
        if e.op is not Op.CONST:
            ge = irb.mul(g, irb.mul(n, irb.unary(Op.LOG, a)))
        return [ga, ge]
    if op in (Op.MIN, Op.MAX):
        a, b = s
        a_wins = irb.binary(Op.LT, a, b) if op is Op.MIN else irb.binary(Op.LT, b, a)
        tie = irb.binary(Op.EQ, a, b)
        half = irb.mul(g, f(0.5))
        zero = _zero_like(g)
        ga = irb.where(a_wins, g, irb.where(tie, half, zero))
        b_wins = irb.binary(Op.LT, b, a) if op is Op.MIN else irb.binary(Op.LT, a, b)
        gb = irb.where(b_wins, g, irb.where(tie, half, zero))
        return [ga, gb]
    if op is Op.MOD:
        a, b = s
        return [g, irb.neg(irb.mul(g, irb.unary(Op.FLOOR, irb.div(a, b))))]
    if op is Op.WHERE:
        c, a, b = s
        zero = _zero_like(g)
        return [None, irb.where(c, g, zero), irb.where(c, zero, g)]
    if op is Op.CAST:
        return [g]
    # FLOORDIV, FLOOR, CEIL, SIGN, comparisons, logic: piecewise constant, zero derivative.
    return [None] * len(s)


def score_mod_gradient(
    output: Node, *, grad_slots: frozenset[int] = frozenset()
) -> ScoreModGradient:
    """Differentiate a score_mod's output w.r.t. `score` and the loads of captures in `grad_slots`.

    >>> from flexfa.ir import build as irb
    >>> from flexfa.ir.printer import format_expr
    >>> s = irb.var("score")
    >>> format_expr(score_mod_gradient(irb.mul(s, s)).d_score)
    '(score + score)'
    """
    if not output.dtype.is_float:
        raise TypeError("only a floating-point score_mod output can be differentiated")
    adjoint: dict[int, Node] = {id(output): irb.fconst(1.0, output)}
    order = toposort([output])
    for n in reversed(order):
        g = adjoint.get(id(n))
        if (
            g is None
            or not n.dtype.is_float
            or n.op in (Op.CONST, Op.VAR, Op.LOAD, Op.CAPTURE, Op.SCALAR)
        ):
            continue
        for src, contribution in zip(n.srcs, _grad_rules(n, g)):
            if contribution is None or not src.dtype.is_float:
                continue
            contribution = irb.cast(contribution, arithmetic_type(src.dtype))
            prev = adjoint.get(id(src))
            adjoint[id(src)] = contribution if prev is None else irb.add(prev, contribution)

    score = next((n for n in order if n.op is Op.VAR and n.arg == "score"), None)
    d_score = adjoint.get(id(score)) if score is not None else None
    if d_score is None:
        d_score = irb.fconst(0.0, output)
    loads = [
        n
        for n in order
        if n.op is Op.LOAD and n.dtype.is_float and n.srcs[0].arg.slot in grad_slots
    ]
    d_loads = [adjoint.get(id(n), irb.fconst(0.0, n)) for n in loads]
    simplified = simplify([d_score, *d_loads])
    grads = tuple(
        LoadGradient(load, d)
        for load, d in zip(loads, simplified[1:])
        if not (d.op is Op.CONST and d.arg == 0.0)
    )
    return ScoreModGradient(d_score=irb.cast(simplified[0], DType.FLOAT32), loads=grads)
