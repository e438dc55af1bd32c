"""Tracing a mod: call it once on proxies and record what it computes as IR.

>>> import torch, flexfa
>>> slopes = torch.tensor([0.5, 0.25])
>>> def alibi(score, b, h, q_idx, kv_idx):
...     return score + slopes[h] * (kv_idx - q_idx)
>>> traced = trace_score_mod(alibi)
>>> print(traced.format())
score_mod alibi(score, b, h, q_idx, kv_idx) captures slopes: f32[1d]
  %0 = slopes[h]  : f32
  %1 = (kv_idx - q_idx)  : i32
  %2 = %1.to(f32)  : f32
  %3 = (%0 * %2)  : f32
  %4 = (score + %3)  : f32
  out = %4
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import keyword
import numbers
import re
import types
from collections.abc import Callable
from typing import Any, Literal

import torch

from flexfa.config import config
from flexfa.frontend.cache import traces
from flexfa.frontend.proxy import IndexedTensor, ModTraceError, Proxy, lift
from flexfa.ir import build as irb
from flexfa.ir.autodiff import ScoreModGradient, score_mod_gradient
from flexfa.ir.dtypes import DType
from flexfa.ir.nodes import (
    MASK_MOD_PARAMS,
    SCORE_MOD_PARAMS,
    Capture,
    Node,
    Op,
    Scalar,
    toposort,
)
from flexfa.ir.printer import format_graph
from flexfa.ir.simplify import simplify
from flexfa.ir.verify import verify

ModKind = Literal["score_mod", "mask_mod"]


@dataclasses.dataclass(frozen=True, eq=False)
class TracedMod:
    """A traced mod: its IR, the tensors it captured, and the Python function it came from.

    `output`, `captures` and `scalars` are pure IR (hashable, device-free); `tensors[slot]` is the
    tensor bound to `captures[slot]` for this call and `scalar_values[slot]` the value of the lifted
    scalar `scalars[slot]` (Note [Lifted scalars] in flexfa/ir/nodes.py). Two TracedMods with equal
    `key` compile to the same kernels.
    """

    kind: ModKind
    name: str
    output: Node
    captures: tuple[Capture, ...]
    tensors: tuple[torch.Tensor, ...]
    fn: Callable[..., Any]
    scalars: tuple[Scalar, ...] = ()
    scalar_values: tuple[float, ...] = ()
    # Custom ops traced through their Python implementation, each as "op traced through its ..."
    # (Note [Custom ops traced through their Python implementation] in lowerings.py).
    traced_through: tuple[str, ...] = ()

    @property
    def params(self) -> tuple[str, ...]:
        return SCORE_MOD_PARAMS if self.kind == "score_mod" else MASK_MOD_PARAMS

    @functools.cached_property
    def key(self) -> str:
        """Digest of the IR, the mod's kind and name (names appear in generated source), and its
        captures: they are parameters of generated functions even where simplification removed
        every use of one."""
        captures = ",".join(f"{c.name}/{c.dtype}/{c.ndim}" for c in self.captures)
        key = f"{self.kind}:{self.name}:{self.output.digest}:{captures}"
        if self.scalars:
            key += ":" + ",".join(f"{s.name}/{s.dtype}" for s in self.scalars)
        return key

    @functools.cached_property
    def variables(self) -> frozenset[str]:
        """The mod parameters the IR actually reads (e.g. whether a mask depends on `b`)."""
        return frozenset(n.arg for n in toposort([self.output]) if n.op is Op.VAR)

    @property
    def is_identity(self) -> bool:
        """True for a score_mod that returns the score unchanged."""
        return self.output.op is Op.VAR and self.output.arg == "score"

    @property
    def is_trivially_true(self) -> bool:
        """True for a mask_mod that allows every pair (noop_mask)."""
        return self.output.op is Op.CONST and self.output.arg is True

    def grad_slots(self) -> frozenset[int]:
        """Slots of captured float tensors that require grad (their gradients must be computed)."""
        return frozenset(
            c.slot
            for c, t in zip(self.captures, self.tensors)
            if t.requires_grad and t.dtype.is_floating_point
        )

    def gradient(self, grad_slots: frozenset[int] = frozenset()) -> ScoreModGradient:
        """d score_mod / d score and d score_mod / d (each load of a capture in `grad_slots`)."""
        return _gradient(self.output, grad_slots)

    def format(self) -> str:
        params = ", ".join(self.params)
        caps = ", ".join(f"{c.name}: {c.dtype.value}[{c.ndim}d]" for c in self.captures)
        title = f"{self.kind} {self.name}({params})" + (f" captures {caps}" if caps else "")
        if self.scalars:
            title += " scalars " + ", ".join(f"{s.name}: {s.dtype.value}" for s in self.scalars)
        return format_graph({"out": self.output}, title=title)

    def with_tensors(self, tensors: tuple[torch.Tensor, ...]) -> TracedMod:
        return self.rebound(tensors=tensors)

    def with_scalar_values(self, values: tuple[float, ...]) -> TracedMod:
        """The same trace with other values of its lifted scalars (Note [Lifted scalars])."""
        if len(values) != len(self.scalars):
            raise ValueError(f"{self.name}: {len(self.scalars)} scalar values expected")
        return self.rebound(scalar_values=tuple(values))

    def rebound(self, **changes: Any) -> TracedMod:
        """The same trace bound to other tensors, scalar values or function (`changes`), keeping
        what was already computed from its IR (`key`, `variables`), which depends on none of them:
        a packed batch rebinds its mods at every new batch, and a toposort of the IR there costs
        more than the rest of the rebinding."""
        if not set(changes) <= {"tensors", "scalar_values", "fn"}:
            raise TypeError(f"rebound changes only tensors, scalar_values and fn, not {changes}")
        # The fields (TracedMod has no __post_init__ to run, and dataclasses.replace costs more
        # than the rest of a packed batch's rebinding), then the functools.cached_property values
        # computed once on `self` (the trace caches keep it and rebind it at every call).
        state = {name: self.__dict__[name] for name in _TRACED_FIELDS}
        state.update(changes)
        state["key"], state["variables"] = self.key, self.variables
        new = object.__new__(TracedMod)
        new.__dict__.update(state)
        return new


_TRACED_FIELDS = tuple(f.name for f in dataclasses.fields(TracedMod))


@functools.lru_cache(maxsize=512)
def _gradient(output: Node, grad_slots: frozenset[int]) -> ScoreModGradient:
    grad = score_mod_gradient(output, grad_slots=grad_slots)
    if config.verify_ir:
        verify(grad.roots())
    return grad


class Tracer:
    """State of one trace: the captured tensors and their names."""

    def __init__(self, kind: ModKind, fn: Callable[..., Any], device: torch.device | None) -> None:
        self.kind = kind
        self.fn = fn
        self.mod_name = mod_name(fn, kind)
        self.device = device if device is not None else torch.device("cpu")
        self.tensors: list[torch.Tensor] = []
        self.captures: list[Capture] = []
        self._slot_of: dict[int, int] = {}
        self._names: dict[int, str] | None = None
        self.scalars: list[Scalar] = []
        self.scalar_values: list[float] = []
        self.traced_through: list[str] = []

    def note_traced_through(self, description: str) -> None:
        """Record a custom op traced through its Python implementation (once per op)."""
        if description not in self.traced_through:
            self.traced_through.append(description)

    def fail(self, message: str) -> None:
        raise ModTraceError(f"{self.kind} {self.mod_name!r}: {message}")

    # -- captured tensors -----------------------------------------------------------------------
    def name_of(self, tensor: torch.Tensor) -> str:
        if self._names is None:
            self._names = closure_names(self.fn)
        return self._names.get(id(tensor), "buf")

    def capture(self, tensor: torch.Tensor) -> Node:
        slot = self._slot_of.get(id(tensor))
        if slot is None:
            if tensor.is_complex() or tensor.dtype not in _LOADABLE:
                self.fail(
                    f"captured tensor {self.name_of(tensor)!r} has dtype {tensor.dtype}; mods can "
                    f"read bool, integer and float16/bfloat16/float32/float64 tensors"
                )
            slot = len(self.tensors)
            taken = {c.name for c in self.captures} | {s.name for s in self.scalars}
            name = _identifier(self.name_of(tensor), taken)
            self.tensors.append(tensor)
            self.captures.append(Capture(slot, name, DType.from_torch(tensor.dtype), tensor.ndim))
            self._slot_of[id(tensor)] = slot
        return irb.capture(self.captures[slot])

    def lift_scalar(self, value: float, name: str) -> Proxy:
        """A SCALAR standing for the Python float `value` (Note [Lifted scalars])."""
        taken = {c.name for c in self.captures} | {s.name for s in self.scalars}
        scalar = Scalar(len(self.scalars), _identifier(name, taken), DType.FLOAT32)
        self.scalars.append(scalar)
        self.scalar_values.append(value)
        return Proxy(self, irb.scalar(scalar))

    def load_scalar(self, tensor: torch.Tensor) -> Node:
        return self._load(tensor, ())

    def _load(self, tensor: torch.Tensor, indices: tuple[Node, ...]) -> Node:
        node = irb.load(self.capture(tensor), indices)
        # Narrow integer tensors (int8/uint8/int16) load as int32; the IR type of the load is the
        # capture's type, which DType.from_torch already widened.
        return node

    def index(
        self, tensor: Any, index: Any, prefix: tuple[Node, ...] = ()
    ) -> Proxy | IndexedTensor:
        if not isinstance(tensor, torch.Tensor):
            self.fail(f"cannot index a {type(tensor).__name__} with traced values; use a tensor")
        parts = index if isinstance(index, tuple) else (index,)
        nodes = list(prefix)
        name = self.name_of(tensor)
        for at, part in enumerate(parts):
            dim = len(nodes)
            if part is None or part is Ellipsis or isinstance(part, slice):
                return self._index_vector(tensor, tuple(nodes), parts[at:])
            if dim >= tensor.ndim:
                self.fail(
                    f"too many indices for captured tensor {name!r} of shape {tuple(tensor.shape)}"
                )
            if isinstance(part, Proxy):
                node = part.node
                if node.dtype.is_float:
                    self.fail(
                        f"index {dim} into captured tensor {name!r} is a float; convert it with "
                        ".to(torch.int32) (after torch.floor if needed)"
                    )
            elif isinstance(part, bool):
                self.fail(
                    f"captured tensor {name!r} was indexed with {part!r}; mods index captured "
                    "tensors with one integer per dim"
                )
                raise AssertionError
            elif isinstance(part, numbers.Integral):
                value = int(part)
                size = tensor.shape[dim]
                if value < 0:
                    value += size
                if not 0 <= value < size:
                    self.fail(
                        f"index {int(part)} is out of range for dim {dim} of {name!r} (size {size})"
                    )
                node = irb.const(value)
            elif isinstance(part, torch.Tensor) and part.ndim == 0 and not part.is_floating_point():
                node = self.load_scalar(part)
            elif isinstance(part, IndexedTensor):
                part._incomplete()
                raise AssertionError
            else:
                self.fail(f"cannot index captured tensor {name!r} with a {type(part).__name__}")
                raise AssertionError
            nodes.append(node)
        if len(nodes) < tensor.ndim:
            return IndexedTensor(self, tensor, tuple(nodes))
        return Proxy(self, self._load(tensor, tuple(nodes)))

    def _index_vector(self, tensor: torch.Tensor, prefix: tuple[Node, ...], rest: tuple) -> Any:
        """`tensor[*prefix, *rest]` where `rest` starts with a slice, None or ...: the vector
        `tensor[*prefix]` indexed with Python values (Note [Shape operations on traced values] in
        vector.py). A traced index after a slice would be a gather, which mods do not have."""
        from flexfa.frontend import vector

        for part in rest:
            traced = isinstance(part, (Proxy, IndexedTensor, torch.Tensor))
            if traced or getattr(type(part), "_flexfa_vector", False):
                self.fail(
                    f"captured tensor {self.name_of(tensor)!r} was indexed with a traced value "
                    "after a slice, None or ...; put the traced indices first (table[q_idx, :])"
                )
        v = vector.from_indexed(self, tensor, prefix)
        return vector.dispatch(self, "__getitem__", (v, rest), {})


_LOADABLE = frozenset(
    {
        torch.bool,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    }
)


def _identifier(name: str, taken: set[str]) -> str:
    base = re.sub(r"\W", "_", name) or "buf"
    if base[0].isdigit() or keyword.iskeyword(base) or base in SCORE_MOD_PARAMS:
        base = f"{base}_"
    candidate, i = base, 1
    while candidate in taken:
        candidate = f"{base}{i}"
        i += 1
    return candidate


def mod_name(fn: Callable[..., Any], kind: ModKind) -> str:
    """A readable identifier for a mod (lambdas get the kind as their name)."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    name = getattr(target, "__name__", None) or type(target).__name__
    if name == "<lambda>" or not name:
        name = kind
    name = re.sub(r"\W", "_", name)
    return name if name.isidentifier() and not keyword.iskeyword(name) else f"{kind}_{name}"


def closure_names(fn: Any, depth: int = 3) -> dict[int, str]:
    """Map id(object) -> the name a mod's code uses for it (closures, globals, defaults)."""
    names: dict[int, str] = {}
    seen: set[int] = set()

    def visit(f: Any, d: int) -> None:
        if id(f) in seen or d < 0:
            return
        seen.add(id(f))
        if isinstance(f, functools.partial):
            visit(f.func, d)
            for a in (*f.args, *f.keywords.values()):
                visit_value("arg", a, d - 1)
            return
        code = getattr(f, "__code__", None)
        if code is None:
            if callable(f) and hasattr(f, "__dict__"):
                for k, v in vars(f).items():
                    visit_value(k, v, d - 1)
            return
        for k, cell in zip(code.co_freevars, getattr(f, "__closure__", None) or ()):
            with contextlib.suppress(ValueError):  # an empty cell raises ValueError
                visit_value(k, cell.cell_contents, d - 1)
        glob = getattr(f, "__globals__", {})
        for k in code.co_names:
            if k in glob:
                visit_value(k, glob[k], d - 1)
        defaults = getattr(f, "__defaults__", None) or ()
        if defaults:
            argnames = code.co_varnames[: code.co_argcount]
            for k, v in zip(argnames[-len(defaults) :], defaults):
                visit_value(k, v, d - 1)

    def visit_value(k: str, v: Any, d: int) -> None:
        if isinstance(v, torch.Tensor):
            names.setdefault(id(v), k)
        elif isinstance(v, (types.FunctionType, functools.partial)) or (
            callable(v) and hasattr(v, "__dict__") and not isinstance(v, type)
        ):
            visit(v, d)
        elif isinstance(v, (tuple, list)) and len(v) <= 64:
            for item in v:
                visit_value(k, item, d)

    visit(fn, depth)
    return names


def _check_arity(fn: Callable[..., Any], kind: ModKind, params: tuple[str, ...]) -> None:
    if not callable(fn):
        raise TypeError(f"{kind} must be a callable {kind}{params}, got {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and some C callables: nothing to check
    try:
        sig.bind(*params)
    except TypeError:
        raise TypeError(
            f"{kind} {mod_name(fn, kind)!r} must accept {len(params)} positional arguments "
            f"({', '.join(params)}), but its signature is {sig}"
        ) from None


_BAKED = object()  # cache entry: this mod's floats could not be lifted; look up key + values

# Note [Mods that bring their trace]
# A function flexfa makes can carry its own way of being traced, as its attribute
# `__flexfa_trace__(fn, kind, device) -> TracedMod`, which `trace` calls instead of tracing it: it
# must return what tracing `fn` would, usually a cached trace of the same code with other tensors
# bound to its captures (`TracedMod.tensors`). The mods of a packed call are the ones that do
# (Note [Packed batches without retracing] in flexfa/varlen.py).


def trace(
    fn: Callable[..., Any], kind: ModKind, *, device: torch.device | None = None
) -> TracedMod:
    """Trace `fn` as a score_mod or a mask_mod. Raises ModTraceError (a TypeError) with a fix.

    Traces are reused while nothing the mod can reach has changed (Note [Trace cache]); a
    score_mod's floats are lifted (Note [Lifted scalars] in flexfa/ir/nodes.py), so a new value
    of one reuses the trace with other `scalar_values`.
    """
    own = getattr(fn, "__flexfa_trace__", None)
    if own is not None:  # Note [Mods that bring their trace]
        return own(fn, kind, device)
    lift = kind == "score_mod"
    key, values = traces.key(fn, kind, device, lift=lift)
    hit = traces.get(key)
    if hit is _BAKED:  # the floats are constants of this trace: key on their values
        key = (key, values)
        baked = traces.get(key)
        if baked is not None:
            return baked
    elif hit is not None:
        if hit.scalar_values != values:  # the same trace with new values, kept for the next call
            hit = hit.with_scalar_values(values)
            traces.put(key, hit)
        return hit
    traced = _trace(fn, kind, device, lift_floats=lift)
    if lift and values and not traced.scalars and key is not None and hit is not _BAKED:
        traces.put(key, _BAKED)
        key = (key, values)
    traces.put(key, traced)
    return traced


def _lifted_call(fn: Callable[..., Any], tracer: Tracer) -> Callable[..., Any]:
    """`fn` with the floats at its lift sites replaced by SCALAR proxies, in the order of
    `flexfa.frontend.cache.lifting_fingerprint` (cells, defaults, kwdefaults; partial args, keywords).
    """

    def lifted(value: Any, name: str) -> Any:
        return tracer.lift_scalar(value, name) if type(value) is float else value

    if isinstance(fn, functools.partial):
        args = tuple(lifted(a, f"arg{i}") for i, a in enumerate(fn.args))
        keywords = {k: lifted(v, k) for k, v in fn.keywords.items()}
        return functools.partial(fn.func, *args, **keywords)
    code = getattr(fn, "__code__", None)
    if not isinstance(fn, types.FunctionType) or code is None:
        return fn
    closure = fn.__closure__
    if closure:
        cells = []
        for name, cell in zip(code.co_freevars, closure):
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                cells.append(cell)
                continue
            cells.append(
                types.CellType(lifted(contents, name)) if type(contents) is float else cell
            )
        closure = tuple(cells)
    defaults = fn.__defaults__
    if defaults:
        names = code.co_varnames[: code.co_argcount][-len(defaults) :]
        defaults = tuple(lifted(v, n) for n, v in zip(names, defaults))
    if not tracer.scalars and not any(type(v) is float for v in (fn.__kwdefaults__ or {}).values()):
        return fn
    clone = types.FunctionType(code, fn.__globals__, fn.__name__, defaults, closure)
    if fn.__kwdefaults__:
        clone.__kwdefaults__ = {k: lifted(v, k) for k, v in fn.__kwdefaults__.items()}
    return clone


def _trace(
    fn: Callable[..., Any], kind: ModKind, device: torch.device | None, lift_floats: bool = False
) -> TracedMod:
    params = SCORE_MOD_PARAMS if kind == "score_mod" else MASK_MOD_PARAMS
    _check_arity(fn, kind, params)
    tracer = Tracer(kind, fn, device)
    call = _lifted_call(fn, tracer) if lift_floats else fn
    proxies = [Proxy(tracer, irb.var(p)) for p in params]
    try:
        result = call(*proxies)
        if tracer.scalars:
            _check_result(tracer, result)
    except Exception as e:
        if tracer.scalars:  # the mod needs a lifted value as a Python number: bake them in
            return _trace(fn, kind, device)
        if isinstance(e, ModTraceError):
            raise
        raise ModTraceError(
            f"{kind} {tracer.mod_name!r} raised {type(e).__name__} while being traced: {e}"
        ) from e
    if result is None:
        tracer.fail("returned None; a mod must return a value")
    out = lift(tracer, result)
    if kind == "score_mod":
        if out.dtype.is_bool:
            tracer.fail(
                "returned a bool; a score_mod returns the new score. A function that says which "
                "pairs to keep is a mask_mod: pass it as block_mask= instead"
            )
        if not out.dtype.is_float:
            out = irb.cast(out, DType.FLOAT32)
        out = irb.cast(out, DType.FLOAT32)
    elif not out.dtype.is_bool:
        tracer.fail(f"must return a bool (True = attend), got a value of type {out.dtype.value}")
    (out,) = simplify([out])
    if config.verify_ir:
        verify([out], allowed_vars=params)
    traced = TracedMod(
        kind=kind,
        name=tracer.mod_name,
        output=out,
        captures=tuple(tracer.captures),
        tensors=tuple(tracer.tensors),
        fn=fn,
        scalars=tuple(tracer.scalars),
        scalar_values=tuple(tracer.scalar_values),
        traced_through=tuple(tracer.traced_through),
    )
    if config.dump_ir is not None:
        _dump(traced)
    return traced


def _check_result(tracer: Tracer, result: Any) -> None:
    """Raise unless `result` lifts to an IR value (run while SCALARs stand for floats, so that a
    mod returning a Python number computed from them is retraced with its floats baked in)."""
    if result is None or not isinstance(lift(tracer, result), Node):
        raise ModTraceError("not an IR value")


def trace_score_mod(fn: Callable[..., Any], *, device: torch.device | None = None) -> TracedMod:
    """Trace `score_mod(score, b, h, q_idx, kv_idx) -> new score`."""
    return trace(fn, "score_mod", device=device)


def trace_mask_mod(fn: Callable[..., Any], *, device: torch.device | None = None) -> TracedMod:
    """Trace `mask_mod(b, h, q_idx, kv_idx) -> bool`."""
    return trace(fn, "mask_mod", device=device)


def _dump(traced: TracedMod) -> None:
    directory = config.dump_ir
    assert directory is not None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{traced.kind}_{traced.name}_{traced.output.digest[:12]}.ir"
    text = traced.format()
    if traced.kind == "score_mod":
        grad = traced.gradient(frozenset(c.slot for c in traced.captures if c.dtype.is_float))
        named = {"d_score": grad.d_score}
        named.update(
            {f"d_{g.load.srcs[0].arg.name}[{i}]": g.d_load for i, g in enumerate(grad.loads)}
        )
        text += "\n\n" + format_graph(named, title="gradient")
    path.write_text(text + "\n")
