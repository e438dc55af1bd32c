"""Mods defined inside a function that torch.compile traces ("local mods").

# Note [Local mods under torch.compile]
# The most common way to write a mod is inside the model's forward, closing over what forward has
# at hand: `bias = self.bias; def rel(score, b, h, q_idx, kv_idx): return score + bias[h, ...]`
# (Hugging Face transformers' FlexAttention integration does exactly this, closing over a softcap
# float, a mask tensor and a position-bias tensor). Under `torch.compile` such a function exists
# only inside Dynamo, as a NestedUserFunctionVariable: its code object is a constant, but its
# closure cells hold Dynamo's variables (a tensor that is a parameter, an input or an
# intermediate of the forward, a float, another nested function). Dynamo cannot turn it into a
# Python function (`assume_constant_result` fails with "failed to convert closure cell to Python
# constant"), and traced code cannot read `fn.__closure__` of such a function either.
# So flexfa splits a local mod where Dynamo keeps it, while Dynamo traces the call:
#   - `flexfa.compiled.local_mod(fn, kind, device_type)` calls `torch._dynamo.comptime` with
#     `_split_hook`, which receives Dynamo's variable for `fn` and walks it with `split` below
#     (also for a functools.partial made outside, which Dynamo cannot pass as a constant either);
#   - `split` rebuilds the mod as a plain Python function: the same code object and globals, its
#     cells (and defaults) rebuilt recursively: numbers, strings, None and dtypes as themselves,
#     nested functions rebuilt the same way, once each (mods composed by `and_masks`, helpers
#     the mod calls, closures that call each other), tuples, lists and dicts item by item,
#     functools.partial by its parts; a global of a rebuilt function is reached through
#     `sys.modules` (("module", name), ("attr", global)); each tensor becomes
#     its fake value (shape, dtype, device: what tracing reads; symbolic sizes stay symbolic, so a
#     trace that depends on one guards on it) and is a *root*; objects that exist outside the
#     compiled region (functions, modules, `self`) are themselves in the rebuilt mod and are
#     roots too, so that the tensors they hold are reached from them by paths, as for any mod;
#   - the hook traces the rebuilt mod (so that flexfa's ModTraceError can be a graph break with
#     its message, not an internal Dynamo error) and hands the roots (Dynamo's own variables)
#     back to the traced code with a token naming the rebuilt mod (`Split`); `_describe` takes
#     the rebuilt mod by its token, finds its trace and returns the paths from the roots
#     (("item", j), ...) to the tensors it captured, and the traced code follows them, so every
#     captured tensor enters the `flexfa::attention` op as what it is in the graph: gradients
#     reach parameters and intermediates alike, and nothing is a constant.
# The rebuilt mod and its trace exist only while Dynamo traces: the compiled graph holds the key
# of the described call and the roots' tensors as op inputs, so a training step reruns neither
# (the inner function object is new at every call; nothing depends on its identity) and an
# optimizer step recompiles nothing.
# Numbers: a number read from outside (an attribute like `self.softcap`, an argument) is taken
# before Dynamo could make it a symbol and guarded by value, so changing it compiles again; a
# number computed in the compiled function that Dynamo treats as dynamic (a size under
# `dynamic=True`) is specialized to its value, with a warning: flexfa traces numbers as constants
# (a mask's analysis reasons about them), so each value compiles its own graph; a value kept in a
# 0-dim tensor keeps one graph. An object from outside is guarded by identity (as
# `assume_constant_result` guards objects); numbers the tracer reads from its attributes are
# constants of the graph.
# Anything else a local mod closes over (an object created inside the compiled region, ...) has no
# value outside the graph, nor has a tensor the mod computes itself from a root's fake value with
# torch operations outside the traced values (`table * 2` inside the mod: `check_captures`):
# `split` or `check_captures` raises `LocalModError`, and the hook reports it as a Dynamo
# graph break whose message names the mod, the variable and the fix (under fullgraph=True an
# error; otherwise the call runs eagerly, where flexfa takes any mod).
# Why comptime: it is Dynamo's own hook for running code on its variables while it traces, and
# it changes nothing for anyone else. Teaching Dynamo's function variables `__closure__` would
# change Dynamo for every user, and torch's way for its own FlexAttention (a higher-order op that
# traces the mod into a subgraph and lifts the tensors it reads) is reserved to torch's in-tree
# operators. The hook reads Dynamo's variables (a function's `code`, `closure`, `defaults`,
# `f_globals`, the side effects' `load_cell`), which torch does not promise to keep:
# tests/e2e/test_compile_local_mods.py is what says that an installed torch still works with it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

# The steps from an object to a captured tensor, as `flexfa.capture_paths.follow` takes them.
Path = tuple[tuple[str, Any], ...]


class LocalModError(TypeError):
    """A local mod closes over something that cannot be taken into the compiled graph."""

    def __init__(self, message: str, mod: str) -> None:
        super().__init__(message)
        self.mod = mod


@dataclasses.dataclass(frozen=True)
class LocalMod:
    """A local mod rebuilt as a Python function (Note [Local mods under torch.compile]).

    `fn` has the mod's code and globals with its closure rebuilt; `anchors` maps id() of each
    root in it (a tensor's fake value, an object from outside) to its path from the roots,
    (("item", j),)."""

    fn: Callable[..., Any]
    anchors: dict[int, Path]
    rebuilt: frozenset[int]  # ids of the functions rebuilt here (their globals are read by module)
    computed: frozenset[int] = frozenset()  # ids of the tensors the graph computes (intermediates)


_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)

_pending: dict[str, LocalMod] = {}
_MAX_PENDING = 64
_lock = threading.Lock()
_tokens = itertools.count()


def peek(token: str) -> LocalMod:
    """The local mod registered under `token` by `split`."""
    with _lock:
        return _pending[token]


def take(token: str) -> LocalMod:
    """The local mod registered under `token` by `split`, removed from the registry."""
    with _lock:
        return _pending.pop(token)


class _Splitter:
    """Walks Dynamo's variable for a local mod (see Note [Local mods under torch.compile])."""

    def __init__(self, tx: Any, kind: str, name: str) -> None:
        from torch._dynamo import variables as dv

        self.dv = dv
        self.tx = tx
        self.kind = kind
        self.name = name
        self.roots: list[Any] = []
        self.anchors: dict[int, Path] = {}
        self.rebuilt: set[int] = set()
        self.computed: set[int] = set()
        self.functions: dict[int, types.FunctionType] = {}  # by id of Dynamo's variable

    def fail(self, where: str, what: str, fix: str) -> None:
        raise LocalModError(
            f"flexfa: the {self.kind} {self.name!r}, defined inside the compiled function, "
            f"closes over {where}, {what}, which flexfa cannot take into the compiled graph. {fix}",
            self.name,
        )

    def root(self, vt: Any, value: Any) -> Any:
        if id(value) not in self.anchors:
            self.anchors[id(value)] = (("item", len(self.roots)),)
            self.roots.append(vt)
        return value

    def function(self, vt: Any) -> types.FunctionType:
        """The rebuilt function; its cells are filled after it is registered, so that functions
        that reach each other (or themselves) through their closures are rebuilt once each."""
        found = self.functions.get(id(vt))
        if found is not None:
            return found
        code = vt.code.as_python_constant()
        cells = tuple(types.CellType() for _ in code.co_freevars) if vt.closure else None
        defaults = None
        if vt.defaults:
            defaults = tuple(
                self.value(d, f"default {i} of {code.co_name!r}")
                for i, d in enumerate(vt.defaults.items)
            )
        fn = types.FunctionType(code, vt.f_globals, code.co_name, defaults, cells)
        if vt.kwdefaults:
            fn.__kwdefaults__ = {
                k: self.value(d, f"default {k!r} of {code.co_name!r}")
                for k, d in vt.kwdefaults.keys_as_python_constant().items()
            }
        fn.__qualname__ = code.co_qualname if hasattr(code, "co_qualname") else code.co_name
        self.rebuilt.add(id(fn))
        self.functions[id(vt)] = fn
        for name, cell, var in zip(
            code.co_freevars, cells or (), vt.closure.items if cells else ()
        ):
            cell.cell_contents = self.value(self.tx.output.side_effects.load_cell(var), f"{name!r}")
        return fn

    def value(self, vt: Any, where: str) -> Any:
        dv = self.dv
        if isinstance(vt, dv.LazyVariableTracker) and not vt.is_realized():
            raw = vt.peek_value()
            if type(raw) in (int, float) and vt.source is not None:
                # A number read from outside (an attribute, an argument) is a constant guarded
                # by value, never a symbol: realizing it could make it one (dynamic=True).
                from torch._dynamo.guards import GuardBuilder, install_guard

                install_guard(vt.source.make_guard(GuardBuilder.CONSTANT_MATCH))
                return raw
        vt = vt.realize()
        if isinstance(vt, dv.NestedUserFunctionVariable):
            return self.function(vt)
        if isinstance(vt, dv.FunctoolsPartialVariable):
            func = self.value(vt.func, where)
            args = [self.value(a, where) for a in vt.args]
            keywords = {k: self.value(a, where) for k, a in vt.keywords.items()}
            return functools.partial(func, *args, **keywords)
        if isinstance(vt, dv.TensorVariable):
            node = vt.as_proxy().node
            fake = node.meta.get("example_value")
            if not isinstance(fake, torch.Tensor):
                self.fail(where, "a tensor Dynamo has no example value for", _FIX_TENSOR)
            if node.op not in ("placeholder", "get_attr"):
                self.computed.add(id(fake))  # Note [Local mods under CUDA graphs]
            return self.root(vt, fake)
        if isinstance(vt, dv.SymNodeVariable):
            value = vt.evaluate_expr()  # specialize: a guard on this value
            warnings.warn(
                f"flexfa: the {self.kind} {self.name!r} closes over {where}, a number "
                f"torch.compile treats as dynamic; flexfa traces it as the constant {value!r}, "
                "so each value compiles its own graph (pass it in a tensor to keep one graph)",
                stacklevel=2,
            )
            return value
        if isinstance(vt, (dv.TupleVariable, dv.ListVariable)):
            items = [self.value(item, where) for item in vt.items]
            return list(items) if isinstance(vt, dv.ListVariable) else tuple(items)
        if isinstance(vt, dv.ConstDictVariable):
            try:
                entries = vt.keys_as_python_constant()
            except Exception:
                self.fail(where, "a dict whose keys are not constants", _FIX_DEFINE)
            return {k: self.value(item, where) for k, item in entries.items()}
        if vt.is_python_constant():
            value = vt.as_python_constant()
            if isinstance(value, _SCALARS) or vt.source is None:
                return value
            return self.root(vt, value)  # a function or module from outside: tensors by paths
        if isinstance(vt, (dv.UserDefinedObjectVariable, dv.NNModuleVariable)):
            if vt.source is None:
                self.fail(
                    where,
                    f"a {vt.python_type().__name__} created inside the compiled region",
                    _FIX_OBJECT,
                )
            from torch._dynamo.guards import GuardBuilder, install_guard

            install_guard(vt.make_guard(GuardBuilder.ID_MATCH))
            return self.root(vt, vt.value)
        try:
            what = f"a {vt.python_type().__name__}"
        except Exception:
            what = f"a value Dynamo represents as {type(vt).__name__}"
        self.fail(where, what, _FIX_OBJECT)
        raise AssertionError("unreachable")


_FIX_DEFINE = (
    "Define the mod at module level (or build it outside the compiled function), or call "
    "flexfa.attention outside the compiled region."
)
_FIX_TENSOR = "Read the tensor into a local variable of the compiled function before the mod."
_FIX_OBJECT = (
    "Close over tensors, numbers, strings, functions, or objects that exist outside the "
    "compiled function (read the tensors you need into local variables first), or define the "
    "mod outside the compiled function."
)


def check_captures(local: LocalMod, traced: Any) -> None:
    """Raise LocalModError if the trace of `local.fn` (a TracedMod) captured a tensor that is
    neither a root nor reached from one: a tensor the mod computed itself from a root with torch
    operations outside the values flexfa traces (`table[0]`, `table * 2`). From a real tensor
    that is a constant of the graph (Note [flexfa under torch.compile]); from a root's fake value
    it has no value at all."""
    from torch._subclasses.fake_tensor import FakeTensor

    for t in traced.tensors:
        if isinstance(t, FakeTensor) and id(t) not in local.anchors:
            raise LocalModError(
                f"flexfa: the {traced.kind} {traced.name!r}, defined inside the compiled "
                "function, computes a tensor from the tensors it closes over with torch "
                "operations of its own (such as `table[0]` or `table * 2` inside the mod); "
                "flexfa can take into the compiled graph only the tensors a mod closes over. "
                "Compute that tensor before defining the mod, and close over the result.",
                traced.name,
            )


def is_local(vt: Any) -> bool:
    """Whether Dynamo's variable `vt` is a mod to rebuild: a function made inside the compiled
    region, or a functools.partial (which Dynamo cannot pass as a constant either, wherever it
    was made)."""
    from torch._dynamo import variables as dv

    vt = vt.realize()
    return isinstance(vt, (dv.NestedUserFunctionVariable, dv.FunctoolsPartialVariable))


@dataclasses.dataclass(frozen=True)
class Split:
    """A local mod's token (the key of its rebuilt function until `_describe` takes it) and its
    roots, Dynamo's variables for the tensors and outside objects of its closure."""

    token: str
    roots: tuple[Any, ...]


def split(tx: Any, vt: Any, kind: str) -> Split:
    """Rebuild the local mod `vt` (Note [Local mods under torch.compile]) and register it."""
    from torch._dynamo import variables as dv

    target = vt.realize()
    while isinstance(target, dv.FunctoolsPartialVariable):
        target = target.func.realize()
    try:
        name = target.get_name()  # a Python function's, made here or outside
    except Exception:
        name = kind
    splitter = _Splitter(tx, kind, name)
    fn = splitter.value(vt, "itself")
    token = f"{kind}:{name}:{next(_tokens)}"
    with _lock:
        _pending[token] = LocalMod(
            fn, splitter.anchors, frozenset(splitter.rebuilt), frozenset(splitter.computed)
        )
        while len(_pending) > _MAX_PENDING:  # left by traces Dynamo restarted before `_describe`
            _pending.pop(next(iter(_pending)))
    return Split(token, tuple(splitter.roots))
