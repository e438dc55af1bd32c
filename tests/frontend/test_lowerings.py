"""Custom ops in mods: through `flexfa.register_lowering`, or traced through their Python
implementation (Note [Custom ops traced through their Python implementation])."""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa.reference import reference_attention
from tests.tolerance import ThreeWay


def _fast_tanh_math(x):
    """A rational tanh approximation (Pade 3/2), clamped to [-1, 1]: what a fast kernel computes."""
    return torch.clamp(x * (27.0 + x * x) / (27.0 + 9.0 * x * x), -1.0, 1.0)


@torch.library.custom_op("flexfa_test::fast_tanh", mutates_args=())
def fast_tanh(x: torch.Tensor) -> torch.Tensor:
    return _fast_tanh_math(x)


@torch.library.custom_op("flexfa_test::unlowered", mutates_args=())
def unlowered(x: torch.Tensor) -> torch.Tensor:
    return torch.special.bessel_j0(x)  # nothing flexfa can trace


def softcap_custom(score, b, h, q_idx, kv_idx):
    return 5.0 * fast_tanh(score / 5.0)


def softcap_math(score, b, h, q_idx, kv_idx):
    return 5.0 * _fast_tanh_math(score / 5.0)


def test_unregistered_custom_op_names_the_op_and_the_api():
    with pytest.raises(
        flexfa.ModTraceError, match=r"flexfa_test::unlowered .*register_lowering"
    ) as e:
        flexfa.trace_score_mod(lambda s, b, h, q, k: unlowered(s))
    # why its Python implementation was not traced instead
    assert "tracing its default implementation failed" in str(e.value)
    assert "torch.special_bessel_j0 cannot be traced" in str(e.value)


@pytest.mark.parametrize("backend", ["tiled", "triton"])
def test_registered_lowering_runs_with_gradients(backend):
    flexfa.register_lowering(fast_tanh, _fast_tanh_math)
    dtype = torch.float64 if backend == "tiled" else torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        (torch.randn(1, 2, 19, 16, generator=g, dtype=torch.float64) * 3).to(dtype).requires_grad_()
        for _ in range(3)
    )
    out = flexfa.attention(q, k, v, score_mod=softcap_custom, backend=backend)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_attention(*leaves, softcap_math)
    grads_r = torch.autograd.grad(ref.sum(), leaves)
    tol = 1e-9 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for a, b in zip(grads, grads_r):
        torch.testing.assert_close(a.double(), b, atol=10 * tol, rtol=10 * tol)


def test_registration_as_decorator_and_by_packet():
    @flexfa.register_lowering(torch.ops.flexfa_test.unlowered)
    def _(x):
        return x * 2.0

    traced = flexfa.trace_score_mod(lambda s, b, h, q, k: unlowered(s))
    assert "(score * 2.0)" in traced.format()
    with pytest.raises(TypeError, match="custom_op"):
        flexfa.register_lowering(torch.tanh, lambda x: x)


# The attention-gym's approximate-tanh softcap: a custom op whose eager kernel is torch.tanh (its
# inline-asm lowering is for Inductor only), with a fake implementation, called as torch.ops.
@torch.library.custom_op("approx::tanh", mutates_args=())
def _tanh_approx(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


@_tanh_approx.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


CAP = 5.0


def gym_softcap(score, b, h, q_idx, kv_idx):
    return torch.ops.approx.tanh(score / CAP) * CAP


def tanh_softcap(score, b, h, q_idx, kv_idx):
    return torch.tanh(score / CAP) * CAP


def test_a_custom_op_is_traced_through_its_python_implementation():
    traced = flexfa.trace_score_mod(gym_softcap)
    assert traced.output is flexfa.trace_score_mod(tanh_softcap).output
    assert traced.traced_through == ("approx::tanh traced through its default implementation",)
    q = torch.randn(1, 1, 16, 16)
    explained = flexfa.explain_backend(q, q, q, score_mod=gym_softcap)
    line = (
        "score_mod 'gym_softcap': custom op approx::tanh traced through its default implementation"
    )
    assert line in explained.splitlines(), explained


def _reference(base, dtype, score_mod):
    leaves = [t.to(dtype).requires_grad_() for t in base]
    o, _ = reference_attention(*leaves, score_mod)
    return (o, *torch.autograd.grad(o.sum(), leaves))


@pytest.mark.parametrize("backend", ["tiled", "triton"])
def test_gym_softcap_matches_the_reference_with_gradients(backend):
    dtype = torch.float64 if backend == "tiled" else torch.float32
    g = torch.Generator().manual_seed(1)
    base = [torch.randn(1, 2, 19, 16, generator=g, dtype=torch.float64) * 3 for _ in range(3)]
    q, k, v = (t.to(dtype).requires_grad_() for t in base)
    out = flexfa.attention(q, k, v, score_mod=gym_softcap, backend=backend)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    # The op has no autograd formula, so the reference differentiates its eager kernel's math
    # (torch.tanh); its forward is checked against the op itself, run eagerly by torch.
    reference = _reference(base, torch.float64, tanh_softcap)
    eager = _reference(base, dtype, tanh_softcap)
    with torch.no_grad():
        op_out, _ = reference_attention(*(t.to(dtype) for t in base), gym_softcap)
    check = ThreeWay(dtype, context=f"gym softcap on {backend}")
    check("out vs the op run eagerly", out, op_out, reference[0])
    for name, kernel, e, r in zip(("out", "dq", "dk", "dv"), (out, *grads), eager, reference):
        check(name, kernel, e, r)
    check.assert_ok()


def test_a_kernel_for_the_device_is_preferred():
    @torch.library.custom_op("flexfa_test::per_device", mutates_args=())
    def per_device(x: torch.Tensor) -> torch.Tensor:
        return x * 2.0

    @per_device.register_kernel("cpu")
    def _(x):
        return x * 3.0

    traced = flexfa.trace_score_mod(lambda s, b, h, q, k: per_device(s))
    assert "(score * 3.0)" in traced.format()
    assert traced.traced_through == ("flexfa_test::per_device traced through its cpu kernel",)
    on_cuda = flexfa.trace_score_mod(
        lambda s, b, h, q, k: per_device(s), device=torch.device("cuda")
    )
    assert "(score * 2.0)" in on_cuda.format()  # no cuda kernel: the default implementation


def test_a_registered_lowering_comes_first():
    @torch.library.custom_op("flexfa_test::lowered_first", mutates_args=())
    def lowered_first(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)

    flexfa.register_lowering(lowered_first, lambda x: x * 0.5)
    traced = flexfa.trace_score_mod(lambda s, b, h, q, k: lowered_first(s))
    assert "(score * 0.5)" in traced.format() and traced.traced_through == ()


def test_an_implementation_that_returns_no_traced_value_is_refused():
    @torch.library.custom_op("flexfa_test::constant", mutates_args=())
    def constant(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(())

    with pytest.raises(flexfa.ModTraceError, match=r"returned a Tensor, not one traced value"):
        flexfa.trace_score_mod(lambda s, b, h, q, k: s + constant(s))


def test_an_operator_with_a_python_kernel_is_traced_through_it():
    lib = torch.library.Library("flexfa_test_lib", "DEF")
    lib.define("doubled_sigmoid(Tensor x) -> Tensor")
    op = torch.ops.flexfa_test_lib.doubled_sigmoid
    op.default.py_impl(torch._C.DispatchKey.CompositeImplicitAutograd)(
        lambda x: torch.sigmoid(x) * 2.0
    )
    traced = flexfa.trace_score_mod(lambda s, b, h, q, k: op(s))
    assert "sigmoid(score)" in traced.format() and "* 2.0" in traced.format()
    assert traced.traced_through == (
        "flexfa_test_lib::doubled_sigmoid traced through its CompositeImplicitAutograd Python "
        "kernel",
    )
    # A kernel given to Library.impl is held by the C++ dispatcher: the op needs a lowering.
    lib.define("opaque(Tensor x) -> Tensor")
    lib.impl("opaque", lambda x: torch.tanh(x), "CPU")
    with pytest.raises(flexfa.ModTraceError, match="no Python implementation to trace"):
        flexfa.trace_score_mod(lambda s, b, h, q, k: torch.ops.flexfa_test_lib.opaque(s))
    _LIBRARIES.append(lib)  # an op lives as long as its library


_LIBRARIES: list = []
