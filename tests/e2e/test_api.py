"""The public call: the literal examples, the forms block_mask= accepts, return_lse, scale,
layouts and grad modes."""

from __future__ import annotations

import math

import pytest
import torch

import flexfa
from flexfa.masks import causal, sliding_window
from flexfa.mods import alibi
from flexfa.reference import reference_attention


def qkv(B=1, H=4, L=300, E=64, dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(B, H, L, E, generator=g, dtype=dtype).requires_grad_(grad) for _ in range(3)
    )


def test_literal_call_from_the_issue():
    from flexfa.masks import sliding_window
    from flexfa.mods import alibi

    q, k, v = qkv(L=700, dtype=torch.float64)
    out = flexfa.attention(q, k, v, score_mod=alibi, block_mask=sliding_window(512))
    expected, _ = reference_attention(q, k, v, score_mod=alibi, mask_mod=sliding_window(512))
    torch.testing.assert_close(out, expected)


def test_block_mask_forms_agree():
    q, k, v = qkv(L=200, dtype=torch.float64)
    mask = sliding_window(50)
    forms = [
        mask,  # a mask from flexfa.masks
        lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 50),  # a bare mask_mod
        flexfa.create_block_mask(mask, None, None, 200, 200),  # a BlockMask
        flexfa.create_block_mask(mask, 1, 4, 200, 200, BLOCK_SIZE=(32, 64)),
    ]
    expected, _ = reference_attention(q, k, v, mask_mod=mask)
    for form in forms:
        torch.testing.assert_close(flexfa.attention(q, k, v, block_mask=form), expected)


def test_no_mask_and_noop_mask_attend_everywhere():
    q, k, v = qkv(L=40, dtype=torch.float64)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(flexfa.attention(q, k, v), expected)
    torch.testing.assert_close(flexfa.attention(q, k, v, block_mask=flexfa.noop_mask), expected)


def test_return_lse():
    q, k, v = qkv(L=30, dtype=torch.float16)
    out = flexfa.attention(q, k, v, block_mask=causal)
    out2, lse = flexfa.attention(q, k, v, block_mask=causal, return_lse=True)
    assert isinstance(out, torch.Tensor) and torch.equal(out, out2)
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 30)
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(64)
    s = s.masked_fill(~torch.ones(30, 30, dtype=torch.bool).tril(), -math.inf)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=0, atol=1e-5)


def test_float64_inputs_give_float64_lse():
    _, lse = flexfa.attention(*qkv(L=10, dtype=torch.float64), return_lse=True)
    assert lse.dtype == torch.float64


def test_scale():
    q, k, v = qkv(L=20, dtype=torch.float64)
    torch.testing.assert_close(
        flexfa.attention(q, k, v, scale=0.5),
        torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5),
    )


def test_transposed_layout_inputs():
    """(B, L, H, E) storage viewed as (B, H, L, E), as models often hold it."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(2, 33, 4, 16, generator=g, dtype=torch.float64).transpose(1, 2)
        for _ in range(3)
    )
    assert not q.is_contiguous()
    expected, _ = reference_attention(q, k, v, mask_mod=causal)
    torch.testing.assert_close(flexfa.attention(q, k, v, block_mask=causal), expected)


def test_grad_modes():
    q, k, v = qkv(L=50, grad=True)
    out = flexfa.attention(q, k, v, block_mask=causal)
    assert out.requires_grad and out.grad_fn is not None
    with torch.no_grad():
        frozen = flexfa.attention(q, k, v, block_mask=causal)
    assert not frozen.requires_grad
    torch.testing.assert_close(out.detach(), frozen)
    plain = flexfa.attention(*(t.detach() for t in (q, k, v)), block_mask=causal)
    assert plain.grad_fn is None


def test_only_captured_tensors_require_grad():
    q, k, v = qkv(L=40)
    table = torch.zeros(4, 9, requires_grad=True)
    out = flexfa.attention(q, k, v, score_mod=flexfa.mods.relative_bias(table))
    (dtable,) = torch.autograd.grad(out.square().sum(), table)
    assert dtable.shape == table.shape and dtable.abs().sum() > 0


@pytest.mark.parametrize("steps", [16, 128, 4096])
def test_step_columns_only_change_rounding(steps):
    q, k, v = qkv(L=333)
    base = flexfa.attention(q, k, v, score_mod=alibi, block_mask=causal)
    other = flexfa.attention(
        q, k, v, score_mod=alibi, block_mask=causal, kernel_options={"step_columns": steps}
    )
    torch.testing.assert_close(other, base, rtol=1e-5, atol=1e-6)


def test_single_query_and_single_key():
    q, _, _ = qkv(L=1, dtype=torch.float64)
    _, k, v = qkv(L=57, dtype=torch.float64, seed=1)
    expected, _ = reference_attention(q, k, v, score_mod=alibi)
    torch.testing.assert_close(flexfa.attention(q, k, v, score_mod=alibi), expected)
    expected, _ = reference_attention(k, q, q, mask_mod=causal)
    torch.testing.assert_close(flexfa.attention(k, q, q, block_mask=causal), expected)
