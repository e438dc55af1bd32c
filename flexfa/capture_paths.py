"""Where a mod's captured tensors live, as torch.compile reaches them (Note [flexfa under
torch.compile] in flexfa/compiled.py): paths from a mod to each tensor it captures, following
them, and the error for a tensor no path reaches.

>>> import torch
>>> table = torch.zeros(4, 8)
>>> def bias(score, b, h, q_idx, kv_idx):
...     return score + table[h, q_idx % 8]
>>> path = tensor_paths(bias)[id(table)]
>>> follow(bias, path) is table
True
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Mapping
from typing import Any

import torch

from flexfa.frontend.trace import TracedMod
from flexfa.local_mods import LocalMod, Path

_MAX_DEPTH = 5


def tensor_paths(
    fn: Any, anchors: Mapping[int, Path] | None = None, rebuilt: frozenset[int] = frozenset()
) -> dict[int, Path]:
    """id(tensor) -> the attribute path from `fn` to it, for every tensor `fn` can reach through
    closure cells, globals it names, defaults, partial arguments, bound selves and attributes.

    For a local mod (Note [Local mods under torch.compile] in flexfa/local_mods.py), `anchors`
    gives the paths of its roots and `rebuilt` the ids of its rebuilt functions: a path through
    those starts again at a root, or at `sys.modules` for a global they read; a value reached
    only through a rebuilt function's cell has no path (None)."""
    anchors = anchors or {}
    paths: dict[int, Path] = {}
    seen: set[int] = set()

    def step(path: Path | None, kind: str, arg: Any) -> Path | None:
        return None if path is None else (*path, (kind, arg))

    def value(v: Any, path: Path | None, depth: int) -> None:
        if id(v) in anchors:
            path, depth = anchors[id(v)], 0
        if isinstance(v, torch.Tensor):
            if path is not None:
                paths.setdefault(id(v), path)
            return
        if depth > _MAX_DEPTH or id(v) in seen or v is None or isinstance(v, (str, int, float)):
            return
        if isinstance(v, (types.ModuleType, type)):
            return
        if path is not None:  # reached without a path: a later visit may have one
            seen.add(id(v))
        if isinstance(v, (tuple, list)) and len(v) <= 64:
            for i, item in enumerate(v):
                value(item, step(path, "item", i), depth + 1)
        elif isinstance(v, dict) and len(v) <= 64:
            for key, item in v.items():
                if isinstance(key, (str, int)):
                    value(item, step(path, "item", key), depth + 1)
        elif isinstance(v, torch.nn.Module):
            for name, t in [*v.named_parameters(recurse=False), *v.named_buffers(recurse=False)]:
                if path is not None:
                    paths.setdefault(id(t), (*path, ("attr", name)))
            for name, child in v.named_children():
                value(child, step(path, "attr", name), depth + 1)
            for name, item in vars(v).items():
                if not name.startswith("_"):
                    value(item, step(path, "attr", name), depth + 1)
        elif callable(v):
            function(v, path, depth)

    def function(f: Any, path: Path | None, depth: int) -> None:
        code = getattr(f, "__code__", None)
        if isinstance(f, torch.nn.Module):
            seen.discard(id(f))
            value(f, path, depth)
        elif isinstance(f, types.FunctionType) and code is not None:
            local = id(f) in rebuilt
            inner = None if local else path  # a rebuilt function's cells are not followed
            for i, cell in enumerate(f.__closure__ or ()):
                try:
                    contents = cell.cell_contents
                except ValueError:
                    continue
                value(contents, step(inner, "cell", i), depth + 1)
            for name in code.co_names:
                if name in f.__globals__:
                    where = (
                        _module_path(f.__globals__, name) if local else step(path, "global", name)
                    )
                    value(f.__globals__[name], where, depth + 1)
            for i, d in enumerate(f.__defaults__ or ()):
                value(d, step(inner, "default", i), depth + 1)
            for d in (f.__kwdefaults__ or {}).values():  # found by anchor (local mods) only
                value(d, None, depth + 1)
        elif isinstance(f, functools.partial):
            value(f.func, step(path, "attr", "func"), depth + 1)
            for i, item in enumerate(f.args):
                value(item, step(step(path, "attr", "args"), "item", i), depth + 1)
            for key, item in f.keywords.items():
                value(item, step(step(path, "attr", "keywords"), "item", key), depth + 1)
        elif isinstance(f, types.MethodType):
            value(f.__self__, step(path, "self", None), depth + 1)
            function(f.__func__, step(path, "func", None), depth + 1)
        elif hasattr(f, "__dict__") and not isinstance(f, types.BuiltinFunctionType):
            for name, item in vars(f).items():
                value(item, step(path, "attr", name), depth + 1)

    seen.add(id(fn))
    function(fn, None if rebuilt else (), 0)  # a rebuilt mod is not followed: its roots are
    return paths


def _module_path(globals_: dict[str, Any], name: str) -> Path | None:
    """The path to a global of a rebuilt local mod: through `sys.modules`, where its module is."""
    module = sys.modules.get(globals_.get("__name__", ""))
    if module is None or getattr(module, "__dict__", None) is not globals_:
        return None
    return (("module", module.__name__), ("attr", name))


def follow(root: Any, path: Path) -> Any:
    """The object at `path` from `root` (Dynamo traces this, installing guards on the way)."""
    obj = root
    for kind, arg in path:
        if kind == "cell":
            obj = obj.__closure__[arg].cell_contents
        elif kind == "global":
            obj = obj.__globals__[arg]
        elif kind == "default":
            obj = obj.__defaults__[arg]
        elif kind == "self":
            obj = obj.__self__
        elif kind == "func":
            obj = obj.__func__
        elif kind == "attr":
            obj = getattr(obj, arg)
        elif kind == "module":  # a local mod's global (Note [Local mods under torch.compile])
            obj = sys.modules[arg]
        else:  # "item"
            obj = obj[arg]
    return obj


def paths_for(
    traced: TracedMod | None, fn: Any, local: LocalMod | None = None
) -> tuple[tuple[Path, ...], tuple[int | None, ...]]:
    """The paths to `traced`'s captured tensors from `fn` (its rebuilt local mod `local`, if
    any), and for each capture the index of its path, or None where no path reaches it."""
    if traced is None or not traced.tensors:
        return (), ()
    found = tensor_paths(fn) if local is None else tensor_paths(fn, local.anchors, local.rebuilt)
    paths: list[Path] = []
    inputs: list[int | None] = []
    for t in traced.tensors:
        path = found.get(id(t))
        if path is None:
            inputs.append(None)
        else:
            inputs.append(len(paths))
            paths.append(path)
    return tuple(paths), tuple(inputs)


# Note [Captured tensors torch.compile cannot reach]
# The ops read a mod's captured tensors from the paths `_describe` found, so the graph passes
# each one in at every call. A tensor with no path (one the mod computes itself with torch
# operations on a captured tensor: `shift[0]`, `table * 2`, `ids.long()`; or one it reaches
# through keyword-only defaults) has no place in the graph: all the ops could use is the tensor
# the trace saw, a constant frozen at trace time. A decode loop whose mod read `positions[0]` of
# a tensor made anew at each step then ran every step with the first step's value, and Dynamo,
# which never saw the read, had no guard to compile again. So such a capture is an error, for
# mods made outside the compiled region as for local ones (`check_captures`): `_split_hook`
# traces the mod while Dynamo traces the call and reports it as a graph break carrying flexfa's
# message (Dynamo's `Unsupported` under fullgraph=True). Without fullgraph=True, Dynamo resumes
# after that break, `_describe` registers nothing, and `_refuse` (`torch.compiler.disable`d, so
# not wrapped as an internal Dynamo error) raises the same message as a RuntimeError; also where
# the hook could not see the mod. A mod flexfa cannot trace takes the same way, with eager's
# ModTraceError. The fix is the user's: read the captured tensor itself with traced indices
# (`shift[b]`, or a 0-dim `shift` as it is), or compute the derived tensor before the mod and
# capture the result.
def unreachable_capture(traced: TracedMod | None, inputs: tuple[int | None, ...]) -> str | None:
    """flexfa's message for the first tensor of `traced` that has no path (None in `inputs`), or
    None when every captured tensor has one."""
    if traced is None:
        return None
    for cap, i in zip(traced.captures, inputs):
        if i is None:
            return (
                f"flexfa: the {traced.kind} {traced.name!r} reads a tensor {cap.name!r} that "
                "torch.compile cannot reach from the mod (by a closure cell, global, default, "
                "attribute or item): a tensor the mod computes itself from a captured tensor "
                "with torch operations (such as `shift[0]`, `table * 2` or `ids.long()` inside "
                "the mod). The compiled graph would freeze its value at trace time. Read the "
                "captured tensor itself in the mod, indexed with traced values (`shift[b]`, or a "
                "0-dim tensor as it is), or compute that tensor before defining the mod and "
                "capture the result (a closure variable, global, default or attribute)."
            )
    return None
