"""Gradients of captured tensors in float16: accumulated in float32 (float64 on the tiled backend)
and cast once, they must be within torch's own acceptance of eager's error (its "fudge factor",
1.5x) against the float64 truth, at lengths that are and are not multiples of the block size.

The bound adds half a float16 ulp of the gradient's magnitude: the one final cast to the
parameter's dtype, which no accumulation order can avoid.
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.harness import Problem, check_attention
from tests.mods import BuiltMod


class _Fp16Params(Problem):
    @property
    def param_dtype(self) -> torch.dtype:  # the learnable tables themselves are float16
        return self.dtype


def _distinct_biases(length: int, heads: int):
    def make(dtype):
        g = torch.Generator().manual_seed(0)
        bq = (torch.randn(heads, length, generator=g, dtype=torch.float64) * 0.5).to(dtype)
        bk = (torch.randn(heads, length, generator=g, dtype=torch.float64) * 0.5).to(dtype)
        bq.requires_grad_(True)
        bk.requires_grad_(True)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bq[h, q_idx] * 0.5 + bk[h, kv_idx]

        return BuiltMod(score_mod, (bq, bk))

    return make


@pytest.mark.parametrize(
    "backend, length",
    [
        ("tiled", 256),
        ("tiled", 277),
        pytest.param("triton", 256, marks=pytest.mark.gpu),
        pytest.param("triton", 277, marks=pytest.mark.gpu),  # ~50 s under the CPU interpreter
    ],
)
def test_fp16_capture_gradients_within_torch_fudge_factor(backend, length):
    p = _Fp16Params(
        batch=1, heads_q=2, heads_kv=2, len_q=length, len_kv=length, dtype=torch.float16
    )
    check = check_attention(p, score_mod=_distinct_biases(length, 2), backend=backend, atol=1e-3)
    for r in check.results:
        if r.name.startswith("d_param"):
            # half an ulp of a float16 gradient of magnitude up to ~2: 2**-11
            assert r.kernel_error <= 1.5 * r.eager_error + 2.0**-11, str(r)
