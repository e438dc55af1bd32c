"""Document masks on the "fa4" backend on a real GPU (Note [Document masks on FA4's varlen
kernels] in flexfa/codegen/cute/plan.py): one FA4 varlen call per batch row, forward, LSE and
every gradient (a learnable per-head temperature included) against flexfa's float64 reference of the mask
itself, three-way rule (tests/tolerance.py); the path is checked first, from `explain_backend`.

Skipped without CUDA (and without flash-attn-4). Run on an H200 with
`pytest -q -m gpu tests/codegen/cute/test_gpu_documents.py`.
"""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa import masks as fm
from flexfa.backends.fa4 import missing_package
from flexfa.reference import reference_attention
from tests.tolerance import ThreeWay

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing_package() is not None, reason=str(missing_package())),
]


@pytest.fixture(autouse=True)
def _fa4_varlen_on():
    with flexfa.config.override(fa4_varlen=True, fa4_documents=True):
        yield


def _ids(lengths_per_row, dev) -> torch.Tensor:
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths_per_row]
    ).to(dev)


@pytest.mark.parametrize(
    ("heads", "dtype", "inner", "fa4_mask"),
    [
        ((4, 4), torch.bfloat16, "causal", "causal"),
        ((8, 2), torch.float16, "window", "window"),
        ((4, 2), torch.bfloat16, None, "full"),
    ],
    ids=["causal-bf16", "window-gqa-f16", "documents-only-gqa"],
)
def test_document_mask_fa4_matches_reference_on_gpu(heads, dtype, inner, fa4_mask) -> None:
    dev, D = "cuda", 128
    torch.manual_seed(0)
    ids = _ids([[300, 1, 700, 23], [1024]], dev)
    L = ids.shape[1]
    # A learnable temperature per head (a per-head constant bias would have a zero gradient:
    # softmax's gradient sums to zero over each row).
    temp = torch.linspace(0.5, 1.5, heads[0], device=dev).requires_grad_()

    def per_head(score, b, h, q_idx, kv_idx):
        return score * temp[h]

    def documents(b, h, q_idx, kv_idx):
        return ids[b, q_idx] == ids[b, kv_idx]

    mask_mod = {
        "causal": fm.and_masks(documents, fm.causal),
        "window": fm.and_masks(documents, fm.sliding_window(100)),
        None: documents,
    }[inner]
    q = torch.randn(2, heads[0], L, D, device=dev, dtype=dtype, requires_grad=True)
    k, v = (
        torch.randn(2, heads[1], L, D, device=dev, dtype=dtype, requires_grad=True) for _ in "kv"
    )
    gqa = heads[0] != heads[1]
    fa4_line = flexfa.explain_backend(q, k, v, per_head, mask_mod, enable_gqa=gqa).splitlines()[0]
    assert fa4_line.startswith("fa4: yes") and "a document mask on FA4's varlen kernels" in (
        fa4_line
    ), fa4_line
    from flexfa.api import build_spec
    from flexfa.codegen.cute import backend

    spec = build_spec(q, k, v, per_head, mask_mod, enable_gqa=gqa)
    assert backend.make_call(spec).lowering.kind == fa4_mask
    out, lse = flexfa.attention(
        q, k, v, per_head, mask_mod, return_lse=True, backend="fa4", enable_gqa=gqa
    )
    do = torch.randn_like(out)
    inputs = (q, k, v, temp)
    grads = torch.autograd.grad(out, inputs, do)
    check = ThreeWay(dtype, context=f"{inner}-{heads}-{dtype}")
    expected = {}
    for ref_dtype in (torch.float64, dtype):
        o, l = reference_attention(q, k, v, per_head, mask_mod, enable_gqa=gqa, dtype=ref_dtype)
        expected[ref_dtype] = (o, l, torch.autograd.grad(o, inputs, do.to(o.dtype)))
    (ref_o, ref_l, ref_g), (eager_o, eager_l, eager_g) = expected[torch.float64], expected[dtype]
    check("out", out, eager_o, ref_o)
    check("lse", lse, eager_l.float(), ref_l, atol=1e-3)
    for name, a, e, r in zip(("dq", "dk", "dv", "dtemp"), grads, eager_g, ref_g):
        check(name, a, e, r)
    check.assert_ok()
