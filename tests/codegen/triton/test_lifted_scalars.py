"""Lifted scalars (Note [Lifted scalars] in flexfa/ir/nodes.py): score_mods that differ only in a
Python float share one generated module, one launcher plan and (on a GPU) one set of compiled
kernels, and compute what the same mod with the float written as a constant computes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flexfa
from flexfa.codegen.triton import module as tmodule
from flexfa.codegen.triton import plan as tplan
from flexfa.reference import reference_attention


def scaled_distance(c: float):
    return lambda score, b, h, q_idx, kv_idx, c=c: score + c * 0.01 * (kv_idx - q_idx)


def test_scalar_only_differences_share_one_module_and_plan(cache_dir):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g, requires_grad=True) for _ in range(3))
    before = dataclasses.replace(tmodule.stats)
    plans_before = len(tplan.plans)
    for c in (1.0, 7.0, -3.0):
        mod = scaled_distance(c)
        out = flexfa.attention(
            q, k, v, score_mod=mod, block_mask=flexfa.masks.causal, backend="triton"
        )
        out.sum().backward()
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        expected, _ = reference_attention(
            *(t.detach().double().requires_grad_() for t in (q, k, v)),
            score_mod=lambda s, b, h, qi, ki, c=c: s + c * 0.01 * (ki - qi),
            mask_mod=flexfa.masks.causal,
        )
        torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
        assert all(gr.abs().sum() > 0 for gr in grads)
    # one module rendered and one launcher plan made (for the first c); the others reuse them
    assert tmodule.stats.renders - before.renders == 1
    assert len(tplan.plans) - plans_before == 1


@pytest.mark.gpu
def test_twenty_scalar_mods_compile_once_on_the_gpu():
    q, k, v = (
        torch.randn(1, 4, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    counts = []
    for c in range(20):
        out = flexfa.attention(
            q,
            k,
            v,
            score_mod=scaled_distance(float(c)),
            block_mask=flexfa.masks.causal,
            backend="triton",
        )
        out.sum().backward()
        counts.append(tmodule.compiled_kernel_count())
    assert counts[-1] == counts[0] > 0
