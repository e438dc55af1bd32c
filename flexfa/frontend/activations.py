"""torch.nn.functional's elementwise activations as IR (the tracer's table of them).

# Note [Activations]
# torch.nn.functional's elementwise activations, written with the IR's operations exactly as torch
# defines them (same constants, same branches, thresholds included), so they trace, differentiate
# through the IR's autodiff and lower on every backend with no new kernel code. Only exact GELU
# needs an op of its own (ERF).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from flexfa.frontend import optable
from flexfa.frontend import proxy as px
from flexfa.ir import build as irb
from flexfa.ir.dtypes import DType
from flexfa.ir.nodes import Node, Op

if TYPE_CHECKING:
    from flexfa.frontend.trace import Tracer


def _act_arg(args: tuple, kwargs: dict, i: int, key: str, default: float) -> float:
    value = optable._arg(args, kwargs, i, key, default)
    if isinstance(value, (px.Proxy, px.IndexedTensor, torch.Tensor)):
        tracer = px._find_tracer(args, kwargs)
        tracer.fail(f"activation parameter {key!r} must be a Python number inside a mod")
    return float(value)


def _f(x: Node, value: float) -> Node:
    return irb.fconst(value, x)


def _float_arg(tracer: Tracer, value: Any) -> Node:
    x = px.lift(tracer, value)
    return x if x.dtype.is_float else irb.cast(x, DType.FLOAT32)


def _relu(tracer, args, kwargs):
    x = px.lift(tracer, args[0])
    return irb.binary(Op.MAX, x, irb.const(0, x.dtype))


def _silu(tracer, args, kwargs):
    x = _float_arg(tracer, args[0])
    return irb.mul(x, irb.unary(Op.SIGMOID, x))


def _gelu(tracer, args, kwargs):
    x = _float_arg(tracer, args[0])
    approximate = optable._arg(args, kwargs, 1, "approximate", "none")
    half_x = irb.mul(_f(x, 0.5), x)
    if approximate == "none":
        return irb.mul(half_x, irb.add(_f(x, 1.0), irb.unary(Op.ERF, irb.mul(x, _f(x, 0.5**0.5)))))
    if approximate == "tanh":
        inner = irb.add(x, irb.mul(_f(x, 0.044715), irb.mul(x, irb.mul(x, x))))
        t = irb.unary(Op.TANH, irb.mul(_f(x, math.sqrt(2.0 / math.pi)), inner))
        return irb.mul(half_x, irb.add(_f(x, 1.0), t))
    tracer.fail(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    raise AssertionError


def _softplus_of(x: Node, beta: float, threshold: float) -> Node:
    bx = irb.mul(x, _f(x, beta))
    soft = irb.div(irb.unary(Op.LOG, irb.add(_f(x, 1.0), irb.unary(Op.EXP, bx))), _f(x, beta))
    return irb.where(irb.binary(Op.LT, _f(x, threshold), bx), x, soft)


def _softplus(tracer, args, kwargs):
    x = _float_arg(tracer, args[0])
    beta = _act_arg(args, kwargs, 1, "beta", 1.0)
    return _softplus_of(x, beta, _act_arg(args, kwargs, 2, "threshold", 20.0))


def _elu_of(x: Node, alpha: float, scale: float = 1.0, input_scale: float = 1.0) -> Node:
    neg = irb.mul(
        _f(x, alpha), irb.sub(irb.unary(Op.EXP, irb.mul(x, _f(x, input_scale))), _f(x, 1.0))
    )
    out = irb.where(irb.binary(Op.LT, _f(x, 0.0), x), x, neg)
    return out if scale == 1.0 else irb.mul(out, _f(x, scale))


def _elu(tracer, args, kwargs):
    x = _float_arg(tracer, args[0])
    return _elu_of(x, _act_arg(args, kwargs, 1, "alpha", 1.0))


def _celu(tracer, args, kwargs):
    x = _float_arg(tracer, args[0])
    alpha = _act_arg(args, kwargs, 1, "alpha", 1.0)
    return _elu_of(x, alpha, input_scale=1.0 / alpha)


_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def _selu(tracer, args, kwargs):
    return _elu_of(_float_arg(tracer, args[0]), _SELU_ALPHA, _SELU_SCALE)


def _leaky_relu(tracer, args, kwargs):
    x = _float_arg(tracer, args[0])
    slope = _act_arg(args, kwargs, 1, "negative_slope", 0.01)
    return irb.where(irb.binary(Op.LT, _f(x, 0.0), x), x, irb.mul(x, _f(x, slope)))


def _clamped(x: Node, lo: float, hi: float) -> Node:
    return irb.binary(Op.MIN, irb.binary(Op.MAX, x, _f(x, lo)), _f(x, hi))


def _hardtanh(tracer, args, kwargs):
    x = _float_arg(tracer, args[0])
    lo = _act_arg(args, kwargs, 1, "min_val", -1.0)
    return _clamped(x, lo, _act_arg(args, kwargs, 2, "max_val", 1.0))


def _relu6(tracer, args, kwargs):
    return _clamped(_float_arg(tracer, args[0]), 0.0, 6.0)


def _hardsigmoid(tracer, args, kwargs):
    x = _float_arg(tracer, args[0])
    return irb.div(_clamped(irb.add(x, _f(x, 3.0)), 0.0, 6.0), _f(x, 6.0))


def _hardswish(tracer, args, kwargs):
    x = _float_arg(tracer, args[0])
    return irb.div(irb.mul(x, _clamped(irb.add(x, _f(x, 3.0)), 0.0, 6.0)), _f(x, 6.0))


def _mish(tracer, args, kwargs):
    x = _float_arg(tracer, args[0])
    return irb.mul(x, irb.unary(Op.TANH, _softplus_of(x, 1.0, 20.0)))


def _logsigmoid(tracer, args, kwargs):
    x = _float_arg(tracer, args[0])
    # -softplus(-x), as min(x, 0) - log(1 + exp(-|x|)): finite for every x
    tail = irb.unary(Op.LOG, irb.add(_f(x, 1.0), irb.unary(Op.EXP, irb.neg(irb.unary(Op.ABS, x)))))
    return irb.sub(irb.binary(Op.MIN, x, _f(x, 0.0)), tail)


def _softsign(tracer, args, kwargs):
    x = _float_arg(tracer, args[0])
    return irb.div(x, irb.add(_f(x, 1.0), irb.unary(Op.ABS, x)))


def _tanhshrink(tracer, args, kwargs):
    x = _float_arg(tracer, args[0])
    return irb.sub(x, irb.unary(Op.TANH, x))


def _softshrink(tracer, args, kwargs):
    x = _float_arg(tracer, args[0])
    lam = _act_arg(args, kwargs, 1, "lambd", 0.5)
    out = irb.where(irb.binary(Op.LT, _f(x, lam), x), irb.sub(x, _f(x, lam)), _f(x, 0.0))
    return irb.where(irb.binary(Op.LT, x, _f(x, -lam)), irb.add(x, _f(x, lam)), out)


def _hardshrink(tracer, args, kwargs):
    x = _float_arg(tracer, args[0])
    lam = _act_arg(args, kwargs, 1, "lambd", 0.5)
    keep = irb.binary(Op.OR, irb.binary(Op.LT, _f(x, lam), x), irb.binary(Op.LT, x, _f(x, -lam)))
    return irb.where(keep, x, _f(x, 0.0))


def _erfc(tracer, args, kwargs):
    x = _float_arg(tracer, args[0])
    return irb.sub(_f(x, 1.0), irb.unary(Op.ERF, x))


ACTIVATIONS: dict[str, Callable[[Tracer, tuple, dict], Node]] = {
    "relu": _relu,
    "silu": _silu,
    "gelu": _gelu,
    "softplus": _softplus,
    "elu": _elu,
    "celu": _celu,
    "selu": _selu,
    "leaky_relu": _leaky_relu,
    "hardtanh": _hardtanh,
    "relu6": _relu6,
    "hardsigmoid": _hardsigmoid,
    "hardswish": _hardswish,
    "mish": _mish,
    "logsigmoid": _logsigmoid,
    "log_sigmoid": _logsigmoid,
    "softsign": _softsign,
    "tanhshrink": _tanhshrink,
    "softshrink": _softshrink,
    "hardshrink": _hardshrink,
    "erfc": _erfc,
    "special_erfc": _erfc,
}
