"""flexfa.merge_attention: exact attention over the union of disjoint key sets."""

from __future__ import annotations

import math

import pytest
import torch

import flexfa
from flexfa.reference import reference_attention
from tests.tolerance import ThreeWay


def _randn(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_two_halves_of_the_keys_merge_to_one_pass():
    q, k, v = (_randn(2, 3, 7, 16, seed=s) for s in range(3))
    a = reference_attention(q, k[:, :, :5], v[:, :, :5])
    b = reference_attention(q, k[:, :, 5:], v[:, :, 5:])
    out, lse = flexfa.merge_attention(a[0], a[1], b[0], b[1])
    expected, expected_lse = reference_attention(q, k, v)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, expected_lse)


def test_prefix_and_suffix_of_a_causal_mask_equal_one_causal_call():
    """Forward and gradients: a causal call over keys [0, s) and one over [s, L), merged."""
    L, s = 23, 9
    q, k, v = (_randn(1, 2, L, 16, seed=i).requires_grad_() for i in range(3))

    def prefix(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def suffix(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx + s

    oa, la = flexfa.attention(q, k[:, :, :s], v[:, :, :s], block_mask=prefix, return_lse=True)
    ob, lb = flexfa.attention(q, k[:, :, s:], v[:, :, s:], block_mask=suffix, return_lse=True)
    assert torch.isneginf(lb[:, :, :s]).all()  # rows before s see no suffix key
    out, lse = flexfa.merge_attention(oa, la, ob, lb)
    expected, expected_lse = flexfa.attention(
        q, k, v, block_mask=flexfa.masks.causal, return_lse=True
    )
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, expected_lse)
    g = _randn(*out.shape, seed=7)
    grads = torch.autograd.grad((out * g).sum() + lse.sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * g).sum() + expected_lse.sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want)


def test_empty_sides_give_no_nan():
    out_a, out_b = _randn(1, 4, 8, seed=1), _randn(1, 4, 8, seed=2)
    inf = math.inf
    lse_a = torch.tensor([[-inf, 0.5, -inf, 3.0]], dtype=torch.float64)
    lse_b = torch.tensor([[-inf, -inf, 1.0, 2.0]], dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (out_a, lse_a, out_b, lse_b)]
    out, lse = flexfa.merge_attention(*leaves)
    assert torch.isneginf(lse[0, 0]) and (out[0, 0] == 0).all()  # both empty: an empty row
    torch.testing.assert_close(out[0, 1], out_a[0, 1])  # one side empty: the other side
    torch.testing.assert_close(lse[0, 2], lse_b[0, 2])
    torch.testing.assert_close(lse[0, 3], torch.logaddexp(lse_a[0, 3], lse_b[0, 3]))
    (out.sum() + torch.where(torch.isneginf(lse), 0.0, lse).sum()).backward()
    for t in leaves:
        assert torch.isfinite(t.grad).all()


def test_gradcheck_float64_with_empty_sides():
    out_a, out_b = _randn(2, 3, 5, seed=1), _randn(2, 3, 5, seed=2)
    lse_a, lse_b = _randn(2, 3, seed=3), _randn(2, 3, seed=4)
    lse_a[0, 1] = -math.inf
    lse_b[1, 2] = -math.inf
    inputs = [t.requires_grad_() for t in (out_a, lse_a, out_b, lse_b)]

    def finite(*args):
        out, lse = flexfa.merge_attention(*args)
        return out, torch.where(torch.isneginf(lse), 0.0, lse)

    assert torch.autograd.gradcheck(finite, inputs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_outputs(dtype):
    q, k, v = (_randn(1, 2, 6, 16, seed=s) for s in range(3))
    ref, ref_lse = reference_attention(q, k, v)
    eager, eager_lse = reference_attention(q.to(dtype), k.to(dtype), v.to(dtype), dtype=dtype)
    lq, lk, lv = q.to(dtype), k.to(dtype), v.to(dtype)
    a = flexfa.attention(lq, lk[:, :, :4], lv[:, :, :4], return_lse=True)
    b = flexfa.attention(lq, lk[:, :, 4:], lv[:, :, 4:], return_lse=True)
    out, lse = flexfa.merge_attention(a[0], a[1], b[0], b[1])
    assert out.dtype == dtype and lse.dtype == torch.float32
    check = ThreeWay(dtype)
    check("out", out, eager, ref)
    check("lse", lse, eager_lse, ref_lse)
    check.assert_ok()


def test_bad_arguments_are_named():
    o, lse = torch.zeros(2, 3, 4), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="lse_b must have shape"):
        flexfa.merge_attention(o, lse, o, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="out_a and out_b"):
        flexfa.merge_attention(o, lse, torch.zeros(2, 3, 5), lse)
    with pytest.raises(TypeError, match="out_b must be a torch"):
        flexfa.merge_attention(o, lse, None, lse)
