"""User-registered lowerings of custom ops, so that mods may call them.

A `torch.library.custom_op` is opaque to flexfa's tracer: it sees only its name. Registering a
lowering tells flexfa what the op computes, written with operations the tracer takes (docs/
semantics.md), e.g. a fast tanh approximation for soft-capping:

>>> import torch, flexfa
>>> @torch.library.custom_op("flexfa_doc::fast_tanh", mutates_args=())
... def fast_tanh(x: torch.Tensor) -> torch.Tensor:
...     return torch.tanh(x)
>>> @flexfa.register_lowering(fast_tanh)
... def _(x):
...     return torch.tanh(x)
>>> def softcap(score, b, h, q_idx, kv_idx):
...     return 30.0 * fast_tanh(score / 30.0)
>>> q = k = v = torch.randn(1, 1, 16, 16)
>>> flexfa.attention(q, k, v, score_mod=softcap).shape
torch.Size([1, 1, 16, 16])

The lowering is traced like the rest of the mod, so it runs on every backend and has gradients
(derived from the lowering, not from the op's own autograd formula). It is called with the op's
arguments (traced values and Python values) and must return one traced value.

# Note [Lowerings and the trace cache]
# Traced mods are cached. Registering (or replacing) a lowering clears that cache, so a mod traced
# before the registration is traced again with the new lowering on its next use.

# Note [Custom ops traced through their Python implementation]
# Many custom ops are a fast path for a compiler around a plain PyTorch function: the
# attention-gym's approximate tanh (`torch.library.custom_op("approx::tanh")`) runs `torch.tanh`
# eagerly on the CPU and CUDA, and only Inductor swaps in its inline-asm lowering. Tracing that
# eager implementation gives flexfa what the op computes, so an op without a registered lowering
# is traced through the Python function it runs on the tracer's device: for a
# `torch.library.custom_op`, its kernel registered for that device type (`register_kernel`), else
# its default implementation (the decorated function); for another operator, a Python kernel
# registered with `OpOverload.py_impl` for the device's dispatch key or CompositeImplicitAutograd
# (a kernel given to `torch.library.Library.impl` lives in the C++ dispatcher, out of reach: such
# an op still needs a lowering). The function is called directly
# with the traced values (never through the dispatcher, which would hand it real tensors), as a
# lowering would be, and must return one traced value. `TracedMod.traced_through` records which
# ops were traced so, and `flexfa.explain_backend` prints it: the kernels then compute the eager
# implementation (`torch.tanh`), not the op's own fast path. Where there is no such function or
# it does not trace (it allocates, calls a C++ kernel, reads `.data_ptr()`, ...), the error asks
# for a lowering as before, with the reason. `register_lowering` takes precedence; the trace
# cache does not see a kernel registered after a mod was traced (register a lowering, which
# clears the cache, to change what a traced op means).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

_LOWERINGS: dict[str, Callable[..., Any]] = {}


def op_name(op: Any) -> str | None:
    """The qualified name (`namespace::name`) of a custom op, an OpOverload or a packet, or None."""
    qualname = getattr(op, "_qualname", None)  # torch.library.custom_op's CustomOpDef
    if isinstance(qualname, str):
        return qualname
    packet_name = getattr(op, "_qualified_op_name", None)  # torch.ops.ns.op
    if isinstance(packet_name, str):
        return packet_name
    schema = getattr(op, "_schema", None)  # torch.ops.ns.op.default
    if schema is not None:
        return schema.name
    return None


def register_lowering(op: Any, lowering: Callable[..., Any] | None = None):
    """Register how flexfa traces calls of the custom op `op` inside mods (see the module docs).

    Usable as `register_lowering(op, fn)` or as a decorator `@register_lowering(op)`.
    """
    name = op_name(op)
    if name is None:
        raise TypeError(
            "register_lowering expects a torch.library.custom_op or a torch.ops operator, got "
            f"{type(op).__name__}"
        )

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn):
            raise TypeError(f"the lowering of {name} must be callable, got {type(fn).__name__}")
        _LOWERINGS[name] = fn
        from flexfa.frontend.cache import traces

        traces.clear()  # Note [Lowerings and the trace cache]
        return fn

    return register(lowering) if lowering is not None else register


def lookup(func: Any) -> Callable[..., Any] | None:
    """The registered lowering for a function the tracer was asked to trace, if any."""
    if not _LOWERINGS:
        return None
    name = op_name(func)
    return _LOWERINGS.get(name) if name is not None else None


def unregistered_op_hint(func: Any, why: str | None = None) -> str | None:
    """An error message for a custom op without a lowering (`why`: why its Python implementation
    was not traced, Note [Custom ops traced through their Python implementation])."""
    name = op_name(func)
    if name is None:
        return None
    because = f" ({why})" if why else ""
    return (
        f"the custom op {name} has no flexfa lowering{because}; register one with "
        f"flexfa.register_lowering(op, fn), fn written with operations listed in docs/semantics.md "
        f"(it runs on every backend: tiled, triton, fa4)"
    )


@dataclasses.dataclass(frozen=True)
class PythonImplementation:
    """The Python function a custom op runs eagerly, and which of its kernels that is."""

    op: str
    kernel: str  # e.g. "its cpu kernel", "its default implementation"
    fn: Callable[..., Any]

    def describe(self) -> str:
        return f"{self.op} traced through {self.kernel}"


def python_implementation(func: Any, device_type: str) -> PythonImplementation | None:
    """The Python function the custom op `func` runs on `device_type`, or None (Note [Custom ops
    traced through their Python implementation])."""
    name = op_name(func)
    if name is None:
        return None
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(name)
    if opdef is not None:
        kernels = getattr(opdef, "_backend_fns", {})
        if device_type in kernels:
            return PythonImplementation(name, f"its {device_type} kernel", kernels[device_type])
        if None in kernels:
            return PythonImplementation(name, "its default implementation", kernels[None])
        return None
    overload = func if isinstance(func, torch._ops.OpOverload) else None
    if overload is None and isinstance(func, torch._ops.OpOverloadPacket):
        overload = getattr(func, "default", None)
    if overload is None:
        return None
    keys = (
        torch._C._dispatch_key_for_device(device_type),
        "CompositeImplicitAutograd",
    )
    for key in keys:
        kernel = overload.py_kernels.get(getattr(torch._C.DispatchKey, key, None))
        if kernel is not None:
            return PythonImplementation(name, f"its {key} Python kernel", kernel)
    return None
