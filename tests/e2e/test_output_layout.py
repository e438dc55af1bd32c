"""The output follows q's memory layout (Note [Output layout] in flexfa/layout.py), for all 24
stride orders of a 4-D q, as torch's flex_attention does."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch._higher_order_ops.flex_attention import _permute_strides
from torch.nn.attention.flex_attention import flex_attention

import flexfa

B, H, L, E, EV = 2, 3, 5, 8, 16
PERMS = list(itertools.permutations(range(4)))


def _q_in_order(perm, dtype):
    shape = (B, H, L, E)
    base = torch.randn([shape[d] for d in perm], dtype=dtype)
    return base.permute([perm.index(d) for d in range(4)])  # shape (B, H, L, E), memory `perm`


def _torch_strides(q):
    """The strides torch gives the output for this q (its own rule, applied to a dummy output)."""
    return _permute_strides(torch.empty(B, H, L, EV), q.stride()).stride()


@pytest.mark.parametrize("backend", ["tiled", "triton"])
def test_output_stride_order_follows_q(backend):
    dtype = torch.float64 if backend == "tiled" else torch.float32
    k = torch.randn(B, H, L, E, dtype=dtype)
    v = torch.randn(B, H, L, EV, dtype=dtype)  # Ev != E
    # Triton under the CPU interpreter is slow: the tiled backend covers all 24, Triton a sample
    # (both allocate the output with the same helper).
    for perm in PERMS if backend == "tiled" else [(0, 2, 1, 3), (3, 1, 0, 2), (2, 3, 0, 1)]:
        q = _q_in_order(perm, dtype)
        out = flexfa.attention(q, k, v, backend=backend)
        assert out.stride() == _torch_strides(q), f"q order {perm}"
        if perm in ((0, 2, 1, 3), (3, 1, 0, 2)):  # and the values, against torch eager
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                want = flex_attention(q.double(), k.double(), v.double())
            assert out.stride() == want.stride()
            torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_decode_output_follows_q():
    """The decode kernels (a short q against a longer KV, flexfa/codegen/triton/decode.py)
    allocate their output by the same rule."""
    if not flexfa.config.triton_interpret:
        pytest.skip("the Triton decode kernels run on the CPU only under TRITON_INTERPRET=1")
    k = torch.randn(B, H, 40, E)
    v = torch.randn(B, H, 40, EV)
    for perm in [(0, 2, 1, 3), (2, 1, 0, 3)]:
        shape = (B, H, 2, E)
        base = torch.randn([shape[d] for d in perm])
        q = base.permute([perm.index(d) for d in range(4)])
        out = flexfa.attention(q, k, v, backend="triton")
        assert out.stride() == _permute_strides(torch.empty(B, H, 2, EV), q.stride()).stride()
        torch.testing.assert_close(out, flexfa.attention(q.contiguous(), k, v, backend="tiled"))
