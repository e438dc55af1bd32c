"""K/V batch broadcast on the GPU (Triton backend), against the float64 reference."""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa.reference import reference_attention

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("heads_q, heads_kv", [(4, 4), (8, 2)])
def test_kv_broadcast_gpu(dtype, heads_q, heads_kv):
    g = torch.Generator(device="cuda").manual_seed(0)
    B, Lq, Lkv, D = 3, 300, 517, 64

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype).requires_grad_(True)

    q, k, v = randn(B, heads_q, Lq, D), randn(1, heads_kv, Lkv, D), randn(1, heads_kv, Lkv, D)
    d_out = torch.randn(B, heads_q, Lq, D, device="cuda", generator=g).to(dtype)
    gqa = heads_q != heads_kv
    out = flexfa.attention(
        q, k, v, block_mask=flexfa.masks.causal, enable_gqa=gqa, backend="triton"
    )
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    out_r, _ = reference_attention(*leaves, mask_mod=flexfa.masks.causal, enable_gqa=gqa)
    grads_r = torch.autograd.grad(out_r, leaves, d_out.double())
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_r, *grads_r)):
        err = float((a.double() - b).norm() / b.norm())
        assert err < tol, f"{name}: relative error {err:.3g} >= {tol}"
