"""Readable text for IR: one-line expressions and SSA listings.

>>> from flexfa.ir import build as irb
>>> from flexfa.ir.printer import format_expr
>>> format_expr(irb.sub(irb.var("q_idx"), irb.var("kv_idx")))
'(q_idx - kv_idx)'
"""

from __future__ import annotations

from flexfa.ir.nodes import Node, Op, toposort

_INFIX = {
    Op.ADD: "+",
    Op.SUB: "-",
    Op.MUL: "*",
    Op.TRUEDIV: "/",
    Op.FLOORDIV: "//",
    Op.MOD: "%",
    Op.POW: "**",
    Op.LT: "<",
    Op.LE: "<=",
    Op.EQ: "==",
    Op.NE: "!=",
    Op.AND: "&",
    Op.OR: "|",
    Op.XOR: "^",
    Op.SHL: "<<",
    Op.SHR: ">>",
}


def _const_text(node: Node) -> str:
    v = node.arg
    if isinstance(v, float):
        return repr(v)
    return repr(v)


def _leaf_text(node: Node) -> str | None:
    if node.op is Op.CONST:
        return _const_text(node)
    if node.op is Op.VAR:
        return node.arg
    if node.op in (Op.CAPTURE, Op.SCALAR):
        return node.arg.name
    return None


def _node_text(node: Node, name) -> str:
    op = node.op
    if op is Op.LOAD:
        return f"{name(node.srcs[0])}[{', '.join(name(s) for s in node.srcs[1:])}]"
    if op in _INFIX:
        a, b = node.srcs
        return f"({name(a)} {_INFIX[op]} {name(b)})"
    if op is Op.NEG:
        return f"-{name(node.srcs[0])}"
    if op is Op.NOT:
        return f"~{name(node.srcs[0])}"
    if op is Op.CAST:
        return f"{name(node.srcs[0])}.to({node.dtype.value})"
    if op is Op.WHERE:
        c, a, b = node.srcs
        return f"where({name(c)}, {name(a)}, {name(b)})"
    return f"{op.value}({', '.join(name(s) for s in node.srcs)})"


def format_expr(node: Node) -> str:
    """The whole expression on one line (shared subexpressions are repeated)."""
    memo: dict[int, str] = {}
    for n in toposort([node]):
        leaf = _leaf_text(n)
        memo[id(n)] = leaf if leaf is not None else _node_text(n, lambda s: memo[id(s)])
    return memo[id(node)]


def format_graph(roots: dict[str, Node] | list[Node], *, title: str = "") -> str:
    """An SSA listing: one line per interior node, leaves inline, named outputs at the end.

    >>> from flexfa.ir import build as irb
    >>> s = irb.var("score")
    >>> print(format_graph({"out": irb.mul(s, s)}, title="square"))
    square
      %0 = (score * score)  : f32
      out = %0
    """
    named = roots if isinstance(roots, dict) else {f"out{i}": r for i, r in enumerate(roots)}
    names: dict[int, str] = {}
    lines = [title] if title else []
    counter = 0
    for n in toposort(list(named.values())):
        leaf = _leaf_text(n)
        if leaf is not None:
            names[id(n)] = leaf
            continue
        text = _node_text(n, lambda s: names[id(s)])
        names[id(n)] = f"%{counter}"
        lines.append(f"  %{counter} = {text}  : {n.dtype.value}")
        counter += 1
    for label, r in named.items():
        lines.append(f"  {label} = {names[id(r)]}")
    return "\n".join(lines)
