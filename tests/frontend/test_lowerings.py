"""Custom ops in mods through `flexfa.register_lowering`."""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa.reference import reference_attention


def _fast_tanh_math(x):
    """A rational tanh approximation (Pade 3/2), clamped to [-1, 1]: what a fast kernel computes."""
    return torch.clamp(x * (27.0 + x * x) / (27.0 + 9.0 * x * x), -1.0, 1.0)


@torch.library.custom_op("flexfa_test::fast_tanh", mutates_args=())
def fast_tanh(x: torch.Tensor) -> torch.Tensor:
    return _fast_tanh_math(x)


@torch.library.custom_op("flexfa_test::unlowered", mutates_args=())
def unlowered(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def softcap_custom(score, b, h, q_idx, kv_idx):
    return 5.0 * fast_tanh(score / 5.0)


def softcap_math(score, b, h, q_idx, kv_idx):
    return 5.0 * _fast_tanh_math(score / 5.0)


def test_unregistered_custom_op_names_the_op_and_the_api():
    with pytest.raises(flexfa.ModTraceError, match=r"flexfa_test::unlowered .*register_lowering"):
        flexfa.trace_score_mod(lambda s, b, h, q, k: unlowered(s))


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
