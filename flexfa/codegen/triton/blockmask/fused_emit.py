"""The fused block-mask kernel's source: the mask's TWO nodes as Triton code that mirrors
`flexfa.blockmask.intervals` one function at a time, the witnesses, and the rendered module
(Note [Fused analysis] in flexfa/codegen/triton/blockmask/fused.py)."""

from __future__ import annotations

import dataclasses

from flexfa.blockmask.analysis import independent
from flexfa.blockmask.fused_plan import (
    How,
    Input,
    IntervalInput,
    KernelLineInput,
    Plan,
    Step,
    TruthInput,
)
from flexfa.blockmask.lines import Sig
from flexfa.frontend.trace import TracedMod
from flexfa.ir.dtypes import DType
from flexfa.ir.nodes import COMPARE_OPS, Node, Op


@dataclasses.dataclass(frozen=True)
class _T:
    """A Truth in the kernel: `{v}_t`, `{v}_f`, `{v}_b`."""

    v: str


@dataclasses.dataclass(frozen=True)
class _I:
    """An Interval in the kernel: `{v}_lo`, `{v}_hi`, and `{v}_nan` / `{v}_c` where present."""

    v: str
    nan: bool
    contiguous: bool
    tight: bool


def _load(name: str) -> str:
    return f"tl.load({name} + b * {name}_sb + h * {name}_sh + i * {name}_si + j * {name}_sj)"


class _Emitter:
    def __init__(
        self, plan: Plan, inputs: dict[int, tuple[Input, tuple[str, ...]]], root: Node
    ) -> None:
        self.plan = plan
        self.root = root
        self.inputs = inputs
        self.lines: list[str] = []
        self.values: dict[int, _T | _I] = {}
        self.functions: list[tuple[str, Node]] = []  # device functions of KLINE nodes
        self.capture_args = ""
        # `b` where a KLINE node's device function meets [CHUNK, block] positions: a scalar in
        # the fused kernel, a column of the tiles' sequences in the packed one.
        self.line_b = "b"

    def emit(self, oob: tuple[str, ...]) -> str:
        for k, step in enumerate(self.plan.steps):
            self.values[id(step.node)] = self._step(f"v{k}", step)
        for name in oob:
            self.lines.append(f"safe = safe & ({_load(name)} == 0)")
        root = self.values[id(self.root)]
        assert isinstance(root, _T)
        return root.v

    def _out(self, line: str) -> None:
        self.lines.append(line)

    def _truth(self, v: str, t: str, f: str, both: str) -> _T:
        # Note [Scalar truths in the interpreter]: Triton's interpreter (3.9) gives a comparison
        # of float64 scalars (bounds that depend on b and h only) a float64 type, and widens it
        # to float64 values when it meets a tile (`tile | scalar` then fails). `tl.where(x, True,
        # False)` is an int1 of the same value in both the interpreter and compiled code (where
        # it folds away).
        self._out(f"{v}_t = tl.where({t}, True, False)")
        self._out(f"{v}_f = tl.where({f}, True, False)")
        self._out(f"{v}_b = tl.where({both}, True, False)")
        return _T(v)

    def _step(self, v: str, step: Step) -> _T | _I:
        n = step.node
        st = self.plan.static
        if step.how is How.PREFIX:
            (name,) = self.inputs[id(n)][1]
            self._out(f"{v}_row = {name} + b * {name}_sb + h * {name}_sh")
            self._out(f"{v}_lo = q_lo - kv_hi + (Lkv - 1)")
            self._out(f"{v}_hi = q_hi - kv_lo + (Lkv - 1)")
            self._out(f"{v}_n = tl.load({v}_row + {v}_hi + 1) - tl.load({v}_row + {v}_lo)")
            return self._truth(v, f"{v}_n > 0", f"{v}_n < {v}_hi - {v}_lo + 1", f"{v}_t & {v}_f")
        if step.how in (How.LINE, How.KLINE):
            desc, names = self.inputs[id(n)]
            if isinstance(desc, KernelLineInput):
                return self._kernel_line(v, n)
            if isinstance(desc, TruthInput):
                t, f, both = (f"{_load(x)} != 0" for x in names)
                return self._truth(v, t, f, both)
            assert isinstance(desc, IntervalInput)
            self._out(f"{v}_lo = {_load(names[0])}")
            self._out(f"{v}_hi = {_load(names[1])}")
            rest = list(names[2:])
            if desc.nan:
                self._out(f"{v}_nan = {_load(rest.pop(0))} != 0")
            if desc.contiguous:
                self._out(f"{v}_c = {_load(rest.pop(0))} != 0")
            return _I(v, desc.nan, desc.contiguous, desc.tight)
        if step.how is How.AFFINE:
            return self._affine(v, st.affine[id(n)])
        if step.how is How.DIFF:
            d = self._affine(v + "d", st.diff[id(n)])
            return self._difference_sign(v, n.op, d)
        return self._transfer(v, n)

    def _kernel_line(self, v: str, n: Node) -> _T | _I:
        """`Line.abstract` over each tile's block, evaluated here: the node's device function at
        every position of the block (and the next one, for the steps)."""
        fn = f"line_{v}"
        self.functions.append((fn, n))
        sig = self.plan.static.sig[id(n)]
        pos, ok, hi = ("q_pos", "q_ok", "q_hi") if sig is Sig.Q else ("kv_pos", "kv_ok", "kv_hi")
        args = f"{pos}, origin" if sig is Sig.Q else f"origin, {pos}"
        nxt = f"{pos} + 1, origin" if sig is Sig.Q else f"origin, {pos} + 1"
        b = self.line_b
        self._out(
            f"{v}_x = {fn}({b}, h, {args}{self.capture_args}) & ({ok} | ~{ok})"
            if n.dtype.is_bool
            else f"{v}_x = {fn}({b}, h, {args}{self.capture_args}) + 0 * {pos}"
        )
        if n.dtype.is_bool:
            self._out(f"{v}_n = tl.sum(({v}_x & {ok}).to(tl.int32), 1)")
            self._out(f"{v}_len = tl.sum({ok}.to(tl.int32), 1)")
            return self._truth(v, f"{v}_n > 0", f"{v}_n < {v}_len", f"{v}_t & {v}_f")
        big = "2147483647" if n.dtype is DType.INT32 else "tl.full([], 2**62, tl.int64)"
        self._out(f"{v}_y = {fn}({b}, h, {nxt}{self.capture_args}) + 0 * {pos}")
        self._out(f"{v}_mn = tl.min(tl.where({ok}, {v}_x, {big}), 1)")
        self._out(f"{v}_mx = tl.max(tl.where({ok}, {v}_x, -{big}), 1)")
        self._out(f"{v}_step = tl.where({pos} + 1 <= {hi}[:, None], {v}_y - {v}_x, 0)")
        self._out(f"{v}_c = tl.max(((({v}_step > 1) | ({v}_step < -1))).to(tl.int32), 1) == 0")
        if n.dtype is DType.INT32:
            self._out(f"{v}_lo = {v}_mn.to(tl.float64)")
            self._out(f"{v}_hi = {v}_mx.to(tl.float64)")
            return _I(v, nan=False, contiguous=True, tight=True)
        # int64: past 2**52 float64 bounds are not exact (Note [Bounds as float64]): unbounded.
        self._out(f"{v}_small = ({v}_mn >= -(2**52)) & ({v}_mx <= 2**52)")
        self._out(f"{v}_lo = tl.where({v}_small, {v}_mn.to(tl.float64), -float('inf'))")
        self._out(f"{v}_hi = tl.where({v}_small, {v}_mx.to(tl.float64), float('inf'))")
        self._out(f"{v}_c = {v}_c & {v}_small")
        return _I(v, nan=False, contiguous=True, tight=False)

    def _affine(self, v: str, form) -> _I:
        """`analysis._affine_bounds`: exact bounds at the tile's corners (int64, then float64)."""
        ranges = {
            "b": ("b", "b"),
            "h": ("h", "h"),
            "q_idx": ("q_lo", "q_hi"),
            "kv_idx": ("kv_lo", "kv_hi"),
        }
        lo, hi = [str(form.const)], [str(form.const)]
        if not form.coeffs:  # a folded constant: give it the tiles' shape and an integer type
            lo.append("0 * q_lo.to(tl.int64)")
            hi.append("0 * q_lo.to(tl.int64)")
        for name, c in form.coeffs:
            a, z = ranges[name]
            small, large = (a, z) if c > 0 else (z, a)
            lo.append(f"{c} * {small}.to(tl.int64)")
            hi.append(f"{c} * {large}.to(tl.int64)")
        self._out(f"{v}_lo = ({' + '.join(lo)}).to(tl.float64)")
        self._out(f"{v}_hi = ({' + '.join(hi)}).to(tl.float64)")
        cq, ck = form.coeff("q_idx"), form.coeff("kv_idx")
        unit = (abs(cq), abs(ck)) in ((0, 0), (1, 0), (0, 1)) or (abs(cq) == 1 and cq == -ck)
        if unit:
            self._out(f"{v}_c = one")
        return _I(v, nan=False, contiguous=unit, tight=True)

    def _difference_sign(self, v: str, op: Op, d: _I) -> _T:
        """`intervals.difference_sign`."""
        lo, hi = f"{d.v}_lo", f"{d.v}_hi"
        if op is Op.LT:
            t, f = f"{hi} > 0", f"{lo} <= 0"
        elif op is Op.LE:
            t, f = f"{hi} >= 0", f"{lo} < 0"
        elif op is Op.EQ:
            t, f = f"({lo} <= 0) & ({hi} >= 0)", f"~(({lo} == 0) & ({hi} == 0))"
        else:
            t, f = f"~(({lo} == 0) & ({hi} == 0))", f"({lo} <= 0) & ({hi} >= 0)"
        # With unit steps every integer between the bounds is a difference at some pair, so a
        # mixed tile is proven for == and != as well.
        exact = (d.tight and op in (Op.LT, Op.LE)) or (d.contiguous and op in (Op.EQ, Op.NE))
        return self._truth(v, t, f, f"{v}_t & {v}_f" if exact else "zero")

    def _transfer(self, v: str, n: Node) -> _T | _I:
        srcs = [self.values[id(s)] for s in n.srcs]
        if n.op is Op.CAST:
            (a,) = srcs
            return a  # bool -> bool, and int casts that cannot wrap (see _CASTS)
        if n.op is Op.NOT:
            (a,) = srcs
            assert isinstance(a, _T)
            return self._truth(v, f"{a.v}_f", f"{a.v}_t", f"{a.v}_b")
        if n.op in (Op.AND, Op.OR, Op.XOR) and isinstance(srcs[0], _T):
            return self._logic(v, n.op, *srcs)
        assert n.op in COMPARE_OPS
        a, b = srcs
        if isinstance(a, _T):
            x = self._logic(v + "x", Op.XOR, a, b)
            if n.op is Op.EQ:
                return self._truth(v, f"{x.v}_f", f"{x.v}_t", f"{x.v}_b")
            return x
        st = self.plan.static
        indep = independent(st.sig[id(n.srcs[0])], st.sig[id(n.srcs[1])])
        return self._compare(v, n.op, a, b, indep)

    def _logic(self, v: str, op: Op, a: _T, b: _T) -> _T:
        """`intervals.logical_and`, `logical_or`, `logical_xor`."""
        a, b = a.v, b.v
        if op is Op.AND:
            both = f"({a}_b & ~{b}_f) | ({b}_b & ~{a}_f)"
            return self._truth(v, f"{a}_t & {b}_t", f"{a}_f | {b}_f", both)
        if op is Op.OR:
            both = f"({a}_b & ~{b}_t) | ({b}_b & ~{a}_t)"
            return self._truth(v, f"{a}_t | {b}_t", f"{a}_f & {b}_f", both)
        t = f"({a}_t & {b}_f) | ({a}_f & {b}_t)"
        f = f"({a}_t & {b}_t) | ({a}_f & {b}_f)"
        both = f"({a}_b & (~{b}_t | ~{b}_f)) | ({b}_b & (~{a}_t | ~{a}_f))"
        return self._truth(v, t, f, both)

    def _compare(self, v: str, op: Op, a: _I, b: _I, independent: bool) -> _T:
        """`intervals.independent_compare`."""
        nan = " | ".join(f"{x.v}_nan" for x in (a, b) if x.nan) or None
        if nan:
            self._out(f"{v}_nan = {nan}")
        if op in (Op.LT, Op.LE):
            if op is Op.LT:
                t, f = f"{a.v}_lo < {b.v}_hi", f"{a.v}_hi >= {b.v}_lo"
            else:
                t, f = f"{a.v}_lo <= {b.v}_hi", f"{a.v}_hi > {b.v}_lo"
            if nan:
                f = f"({f}) | {v}_nan"
            if not (independent and a.tight and b.tight):
                both = "zero"
            else:
                both = f"{v}_t & {v}_f" + (f" & ~{v}_nan" if nan else "")
            return self._truth(v, t, f, both)
        self._out(f"{v}_ov = ({a.v}_lo <= {b.v}_hi) & ({b.v}_lo <= {a.v}_hi)")
        same = f"({a.v}_lo == {a.v}_hi) & ({b.v}_lo == {b.v}_hi) & ({a.v}_lo == {b.v}_lo)"
        if nan:
            same = f"{same} & ~{v}_nan"
        self._out(f"{v}_same = {same}")
        both = "zero"
        if independent and a.contiguous and b.contiguous:
            both = f"{v}_ov & ~{v}_same & {a.v}_c & {b.v}_c"
        if op is Op.EQ:
            return self._truth(v, f"{v}_ov", f"~{v}_same", both)
        return self._truth(v, f"~{v}_same", f"{v}_ov", both)


# ------------------------------------------------------------------------------------------------
# Rendering, loading and launching.
# ------------------------------------------------------------------------------------------------


# Witness pairs per undecided tile (a subset of Note [Witness candidates]): corners, centre, edge
# midpoints, the diagonal q_idx - kv_idx in {-1, 0, 1} where it crosses the tile, and neighbours of
# corners. Every pair lies inside the tile; only a pair allowed and a pair excluded prove anything.
_CLAMP_Q = "tl.minimum(tl.maximum({}, q_lo), q_hi)"
_CLAMP_KV = "tl.minimum(tl.maximum({}, kv_lo), kv_hi)"
_WITNESSES = (
    ("q_lo", "kv_lo"),
    ("q_lo", "kv_hi"),
    ("q_hi", "kv_lo"),
    ("q_hi", "kv_hi"),
    ("q_mid", "kv_mid"),
    ("q_lo", "kv_mid"),
    ("q_hi", "kv_mid"),
    ("q_mid", "kv_lo"),
    ("q_mid", "kv_hi"),
    *(
        (
            _CLAMP_Q.format(f"kv_lo + {t}"),
            _CLAMP_KV.format(f"{_CLAMP_Q.format(f'kv_lo + {t}')} - {t}"),
        )
        for t in (-1, 0, 1)
    ),
    ("q_lo", _CLAMP_KV.format("kv_lo + 1")),
    ("q_hi", _CLAMP_KV.format("kv_hi - 1")),
    (_CLAMP_Q.format("q_lo + 1"), "kv_lo"),
    (_CLAMP_Q.format("q_hi - 1"), "kv_hi"),
)


@dataclasses.dataclass(frozen=True)
class Body:
    """A mask's abstract program as Triton code: the mask_mod's device function and those of its
    KLINE nodes (`functions`), the body's lines, the root truth's name, and the captures'
    parameter names."""

    functions: str
    mask_fn: str
    lines: tuple[str, ...]
    root: str
    captures: tuple[str, ...]


def emit_body(
    mask: TracedMod, plan: Plan, inputs: dict, oob: tuple[str, ...], line_b: str = "b"
) -> Body:
    """The body of a kernel that bounds `mask` on rectangles (q_lo..q_hi, kv_lo..kv_hi) of plane
    (b, h); `line_b` is `b` as KLINE nodes' device functions take it."""
    from flexfa.codegen.triton import emit

    emitter = _Emitter(plan, inputs, mask.output)
    emitter.line_b = line_b
    fn = emit.emit_mod(mask, f"mask_mod_{mask.name}")
    captures = tuple(f"mm_{p}" for p in fn.params)
    emitter.capture_args = "".join(f", {n}" for n in captures)
    root = emitter.emit(oob)
    lines_src = "".join(
        "\n\n" + emit.emit_mod(dataclasses.replace(mask, output=node), name).source
        for name, node in emitter.functions
    )
    return Body(fn.source + lines_src, fn.name, tuple(emitter.lines), root, captures)


def render_module(template: str, functions: str, **values: object) -> str:
    """The module: the prelude, `functions` (device functions), then `template` rendered."""
    from flexfa.codegen.triton import module
    from flexfa.version import __version__

    env = module.jinja_environment()
    kernel = env.get_template(template).render(**values)
    prelude = env.get_template("prelude.py.jinja").render(flexfa_version=__version__)
    return prelude + "\n\n" + functions + kernel


def render(
    mask: TracedMod, plan: Plan, inputs: dict, oob: tuple[str, ...], names: list[str]
) -> str:
    """The module: prelude, the mask_mod as a device function, the kernel for this plan."""
    body = emit_body(mask, plan, inputs, oob)
    return render_module(
        "block_lists.py.jinja",
        body.functions,
        params="".join(f"\n    {n}," for n in names),
        args="".join(f"\n                {n}," for n in names),
        capture_params="".join(f"\n    {n}," for n in body.captures),
        capture_call_args="".join(f"\n                {n}," for n in body.captures),
        capture_args="".join(f", {n}" for n in body.captures),
        mask_fn=body.mask_fn,
        witnesses=_WITNESSES,
        body="\n    ".join(body.lines),
        root=body.root,
    )
