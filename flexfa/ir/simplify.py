"""Simplification and constant folding: local rewrite rules applied bottom-up to a fixpoint.

Each rule is a small function that returns a replacement node or None, with its justification on
the line above it. Rules run on every node after its sources have been simplified.

# Note [Multiplying by zero]
# `x * 0 -> 0` is not an IEEE identity for floats (inf * 0 is NaN). We apply it anyway because the
# products it removes come from autodiff (the derivative of a constant is 0), where torch autograd
# would not compute the term at all, and because mod inputs (scores, indices) are finite. A
# captured table holding inf or NaN multiplied by a literal 0 is the one case whose result differs
# from eager torch.
"""

from __future__ import annotations

from collections.abc import Callable

from flexfa.ir import build as irb
from flexfa.ir.dtypes import DType, fits
from flexfa.ir.evaluate import fold_constant
from flexfa.ir.nodes import COMMUTATIVE_OPS, Node, Op, toposort

Rule = Callable[[Node], "Node | None"]


def _is_num(n: Node, value: float) -> bool:
    return n.op is Op.CONST and not n.dtype.is_bool and n.arg == value


def _is_bool(n: Node, value: bool) -> bool:
    return n.op is Op.CONST and n.dtype.is_bool and n.arg is value


# const op const -> const (evaluated exactly as the evaluator would, in the node's own type).
def fold(n: Node) -> Node | None:
    value = fold_constant(n)
    return None if value is None else irb.const(value, n.dtype)


# c op x -> x op c for commutative ops: puts constants on the right so later rules see one shape.
def constants_right(n: Node) -> Node | None:
    if n.op in COMMUTATIVE_OPS and n.srcs[0].op is Op.CONST and n.srcs[1].op is not Op.CONST:
        return Node(n.op, n.dtype, (n.srcs[1], n.srcs[0]))
    return None


# x + 0 -> x ; x - 0 -> x ; 0 - x -> -x
def additive_identity(n: Node) -> Node | None:
    if n.op in (Op.ADD, Op.SUB) and _is_num(n.srcs[1], 0):
        return n.srcs[0]
    if n.op is Op.SUB and _is_num(n.srcs[0], 0):
        return irb.neg(n.srcs[1])
    return None


# x * 1 -> x ; x / 1 -> x ; x * -1 -> -x ; x * 0 -> 0 (see Note [Multiplying by zero])
def multiplicative_identity(n: Node) -> Node | None:
    if n.op in (Op.MUL, Op.TRUEDIV) and _is_num(n.srcs[1], 1):
        return n.srcs[0]
    if n.op is Op.MUL and _is_num(n.srcs[1], -1):
        return irb.neg(n.srcs[0])
    if n.op is Op.MUL and _is_num(n.srcs[1], 0):
        return n.srcs[1]
    if n.op is Op.TRUEDIV and _is_num(n.srcs[0], 0) and n.srcs[1].op is not Op.CONST:
        return n.srcs[0]  # 0 / x -> 0, same caveat as x * 0
    return None


# -(-x) -> x ; ~~x -> x ; -(a - b) -> b - a
def double_negation(n: Node) -> Node | None:
    if n.op in (Op.NEG, Op.NOT) and n.srcs[0].op is n.op:
        return n.srcs[0].srcs[0]
    if n.op is Op.NEG and n.srcs[0].op is Op.SUB:
        a, b = n.srcs[0].srcs
        return irb.sub(b, a)
    return None


_LOSSLESS_WIDENING = {
    (DType.INT32, DType.INT64),
    (DType.FLOAT16, DType.FLOAT32),
    (DType.BFLOAT16, DType.FLOAT32),
    (DType.FLOAT16, DType.FLOAT64),
    (DType.BFLOAT16, DType.FLOAT64),
    (DType.FLOAT32, DType.FLOAT64),
    (DType.BOOL, DType.INT32),
    (DType.BOOL, DType.INT64),
}


# cast(cast(x, wide), type(x)) -> x when `wide` represents every value of type(x).
def cast_round_trip(n: Node) -> Node | None:
    if n.op is Op.CAST and n.srcs[0].op is Op.CAST:
        x = n.srcs[0].srcs[0]
        if x.dtype is n.dtype and (x.dtype, n.srcs[0].dtype) in _LOSSLESS_WIDENING:
            return x
    return None


# where(true, a, b) -> a ; where(false, a, b) -> b ; where(c, a, a) -> a ; where(~c, a, b) -> where(c, b, a)
def where_rules(n: Node) -> Node | None:
    if n.op is not Op.WHERE:
        return None
    c, a, b = n.srcs
    if _is_bool(c, True):
        return a
    if _is_bool(c, False) or a is b:
        return b
    if c.op is Op.NOT:
        return irb.where(c.srcs[0], b, a)
    if n.dtype.is_bool and _is_bool(a, True) and _is_bool(b, False):
        return c  # where(c, True, False) -> c
    return None


# a & true -> a ; a & false -> false ; a | false -> a ; a | true -> true ; a & a -> a ; a | a -> a
def boolean_identities(n: Node) -> Node | None:
    if n.dtype is not DType.BOOL or n.op not in (Op.AND, Op.OR):
        return None
    a, b = n.srcs
    if a is b:
        return a
    absorbing, neutral = (False, True) if n.op is Op.AND else (True, False)
    if _is_bool(b, neutral):
        return a
    if _is_bool(b, absorbing):
        return b
    return None


# For integers, x == x -> true, x <= x -> true, x < x -> false, x != x -> false (floats: NaN).
def reflexive_compare(n: Node) -> Node | None:
    if n.op not in (Op.LT, Op.LE, Op.EQ, Op.NE):
        return None
    a, b = n.srcs
    if a is b and not a.dtype.is_float:
        return irb.const(n.op in (Op.LE, Op.EQ))
    return None


# (x + c1) + c2 -> x + (c1 + c2) and (x - c1) + c2 -> x + (c2 - c1), integers only (exact there),
# and only when c1 + c2 fits the type: otherwise the folded constant would not be representable.
def reassociate_int_constants(n: Node) -> Node | None:
    if not n.dtype.is_int or n.op not in (Op.ADD, Op.SUB) or n.srcs[1].op is not Op.CONST:
        return None
    inner, c2 = n.srcs
    if inner.op not in (Op.ADD, Op.SUB) or inner.srcs[1].op is not Op.CONST:
        return None
    x, c1 = inner.srcs
    s1 = c1.arg if inner.op is Op.ADD else -c1.arg
    s2 = c2.arg if n.op is Op.ADD else -c2.arg
    total = s1 + s2
    if not fits(-total if total < 0 else total, n.dtype):
        return irb.add(x, irb.const(total, n.dtype)) if fits(total, n.dtype) else None
    return (
        irb.add(x, irb.const(total, n.dtype))
        if total >= 0
        else irb.sub(x, irb.const(-total, n.dtype))
    )


# pow(x, 1) -> x ; pow(x, 2) -> x * x ; pow(x, 0) -> 1
def small_powers(n: Node) -> Node | None:
    if n.op is not Op.POW or n.srcs[1].op is not Op.CONST:
        return None
    x, e = n.srcs[0], n.srcs[1].arg
    if e == 1:
        return x
    if e == 2:
        return irb.mul(x, x)
    if e == 0:
        return irb.const(1, n.dtype)
    return None


RULES: tuple[Rule, ...] = (
    fold,
    constants_right,
    additive_identity,
    multiplicative_identity,
    double_negation,
    cast_round_trip,
    where_rules,
    boolean_identities,
    reflexive_compare,
    reassociate_int_constants,
    small_powers,
)


def _rewrite(n: Node, max_steps: int = 64) -> Node:
    for _ in range(max_steps):
        for rule in RULES:
            out = rule(n)
            if out is not None and out is not n:
                n = out
                break
        else:
            return n
    return n


def simplify(roots: list[Node] | tuple[Node, ...]) -> list[Node]:
    """Simplify the DAG below `roots`; returns the new roots in the same order.

    >>> from flexfa.ir import build as irb
    >>> from flexfa.ir.printer import format_expr
    >>> x = irb.var("score")
    >>> format_expr(simplify([irb.add(irb.mul(x, irb.const(1.0)), irb.const(0.0))])[0])
    'score'
    """
    new: dict[int, Node] = {}
    for n in toposort(list(roots)):
        srcs = tuple(new[id(s)] for s in n.srcs)
        rebuilt = n if srcs == n.srcs else Node(n.op, n.dtype, srcs, n.arg)
        out = _rewrite(rebuilt)
        # A rewrite may produce new nodes whose sources were not simplified as a whole; run the
        # rules over that fresh subgraph once more (it is tiny).
        if out is not rebuilt and out.op is not Op.CONST:
            out = _resimplify(out, new)
        new[id(n)] = out
    return [new[id(r)] for r in roots]


def _resimplify(node: Node, done: dict[int, Node]) -> Node:
    local: dict[int, Node] = {}
    for n in toposort([node]):
        srcs = tuple(local[id(s)] for s in n.srcs)
        rebuilt = n if srcs == n.srcs else Node(n.op, n.dtype, srcs, n.arg)
        local[id(n)] = _rewrite(rebuilt)
    return local[id(node)]
