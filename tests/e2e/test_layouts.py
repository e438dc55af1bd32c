"""Every backend reads every layout autograd or a user can hand it.

q, k, v, the upstream gradients dO and dLSE, and captured tensors come contiguous, expanded
(stride 0), as strided slices, permuted or at a storage offset (tests/e2e/layouts.py); forward and
every gradient must match the float64 reference in each case. The merge of two partial attentions
through their LSEs (how cascade and ring attention combine results) is the case that produces
strided and expanded dLSE in practice.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import flexfa
from flexfa import config
from flexfa.reference import reference_attention
from tests.e2e.harness import INTERPRETER_TILES as TILES
from tests.e2e.harness import Problem, check_attention
from tests.e2e.layouts import LAYOUTS, describe, relayout
from tests.e2e.strategies import examples, layouts
from tests.mods import BuiltMod
from tests.tiers import sweep
from tests.tolerance import ThreeWay

#: The kernel backends this machine can run on the CPU (Triton through its interpreter).
BACKENDS = ["tiled"] + (["triton"] if config.triton_interpret else [])


def _cases(kinds) -> list:
    """(kind, backend): every kind on tiled; on Triton's interpreter two of them by default, the
    others in the exhaustive tier (tests/tiers.py)."""
    interpreted = [(kind, backend) for backend in BACKENDS[1:] for kind in kinds]
    return [(kind, "tiled") for kind in kinds] + sweep(interpreted, keep=2)


def _options(backend: str) -> dict | None:
    return TILES if backend == "triton" else None


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(8), deadline=None)
@given(
    layout=layouts(),
    len_q=st.integers(1, 37),
    len_kv=st.integers(1, 37),
    causal=st.booleans(),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_input_and_gradient_layouts(backend, layout, len_q, len_kv, causal, bias, seed):
    p = Problem(batch=2, heads_q=4, heads_kv=2, len_q=len_q, len_kv=len_kv, head_dim=16)
    note(f"{backend} {p} layouts={layout} causal={causal} bias={bias}")

    def make(dtype):
        if not bias:
            return BuiltMod(fn=None)  # type: ignore[arg-type]
        g = torch.Generator().manual_seed(seed)
        table = torch.randn(4, 80, generator=g).to(dtype).requires_grad_(True)

        def rel_bias(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx - kv_idx + 40]

        return BuiltMod(rel_bias, (table,))

    check_attention(
        p,
        score_mod=make,
        mask_mod=_causal if causal else None,
        backend=backend,
        kernel_options=_options(backend),
        seed=seed,
        layouts=layout,
    )


@pytest.mark.parametrize("kind, backend", _cases(LAYOUTS))
def test_captured_tensor_layouts(backend, kind):
    """A learnable bias table read through a view: values and the table's gradient are right."""
    p = Problem(batch=2, heads_q=4, heads_kv=4, len_q=21, len_kv=19, head_dim=16)

    def make(dtype):
        g = torch.Generator().manual_seed(3)
        leaf = torch.randn(4, 48, generator=g).to(dtype).requires_grad_(True)
        # The kernel reads the view; the gradient must reach the leaf through it.
        table = relayout(leaf, kind)

        def rel_bias(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx - kv_idx + 20]

        return BuiltMod(rel_bias, (leaf,))

    check_attention(
        p,
        score_mod=make,
        mask_mod=_causal,
        backend=backend,
        kernel_options=_options(backend),
        context=f"captured table {kind}",
    )


def _merge(out_a, lse_a, out_b, lse_b):
    """Attention over the union of two disjoint key sets, from each side's output and LSE."""
    lse = torch.logaddexp(lse_a, lse_b)
    # A side with no keys (LSE -inf) has weight 0; both empty gives 0, never NaN.
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, 0.0)
    w_a = torch.where(finite, torch.exp(lse_a - safe), 0.0)[..., None]
    w_b = torch.where(finite, torch.exp(lse_b - safe), 0.0)[..., None]
    return w_a * out_a.to(w_a.dtype) + w_b * out_b.to(w_b.dtype), lse


@pytest.mark.parametrize("backend", BACKENDS)
def test_merged_prefix_and_suffix_equal_one_causal_call(backend):
    """Causal attention split at a key position into a prefix part and a suffix part, merged
    through the LSEs: forward and every gradient equal one causal call (dLSE arrives from
    `logaddexp`, and from `torch.cat` of the LSEs in a strided layout)."""
    B, H, L, E, split = 2, 2, 45, 16, 19
    g = torch.Generator().manual_seed(7)
    base = [torch.randn(B, H, L, E, generator=g, dtype=torch.float64) for _ in range(3)]
    dout = torch.randn(B, H, L, E, generator=g, dtype=torch.float64)
    dlse = torch.randn(B, H, 2 * L, generator=g, dtype=torch.float64)

    def merged(q, k, v, attend):
        def prefix(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

        def suffix(b, h, q_idx, kv_idx):
            return kv_idx + split <= q_idx

        out_a, lse_a = attend(q, k[:, :, :split], v[:, :, :split], prefix)
        out_b, lse_b = attend(q, k[:, :, split:], v[:, :, split:], suffix)
        out, lse = _merge(out_a, lse_a, out_b, lse_b)
        return out, lse

    def kernel(q, k, v, mask):
        return flexfa.attention(
            q,
            k,
            v,
            block_mask=mask,
            return_lse=True,
            backend=backend,
            kernel_options=_options(backend),
        )

    def reference(dtype):
        def attend(q, k, v, mask):
            return reference_attention(q, k, v, None, mask, dtype=dtype)

        return attend

    def run(attend, dtype, split_call: bool):
        leaves = [t.to(dtype).requires_grad_(True) for t in base]
        out, lse = merged(*leaves, attend) if split_call else attend(*leaves, _causal)
        # The LSE leaves through a concatenation too, as when partial results are gathered.
        both = torch.cat([lse, lse], -1)
        grads = torch.autograd.grad(
            [out, both], leaves, [dout.to(out.dtype), dlse.to(both.dtype)], allow_unused=True
        )
        return out, both[..., :L], grads

    out, lse, grads = run(kernel, torch.float32, True)
    out_e, lse_e, grads_e = run(reference(torch.float32), torch.float32, False)
    out_r, lse_r, grads_r = run(reference(torch.float64), torch.float64, False)
    check = ThreeWay(torch.float32, context=f"{backend} merged prefix/suffix")
    check("out", out, out_e, out_r)
    check("lse", lse, lse_e, lse_r)
    for name, a, e, r in zip(("dq", "dk", "dv"), grads, grads_e, grads_r):
        check(name, a, e, r)
    check.assert_ok()


@pytest.mark.parametrize(
    "kind, backend", _cases(["expanded", "scalar", "slice", "step", "permuted", "offset"])
)
def test_lse_gradient_layout_matches_contiguous(backend, kind):
    """The same dLSE values, once contiguous and once in `kind`, give the same gradients."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 4, 23, 16, generator=g) for _ in range(3))
    dout = torch.randn(2, 4, 23, 16, generator=g)
    dlse = relayout(torch.randn(2, 4, 23, generator=g), kind)

    def grads(cot):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = flexfa.attention(
            *leaves, return_lse=True, backend=backend, kernel_options=_options(backend)
        )
        return torch.autograd.grad([out, lse], leaves, [dout, cot])

    strided = grads(dlse)
    dense = grads(dlse.contiguous())
    for name, a, b in zip(("dq", "dk", "dv"), strided, dense):
        err = (a - b).abs().max().item()
        scale = b.abs().max().item()
        assert err <= 1e-5 * max(scale, 1.0), (
            f"{backend}: {name} with dLSE {describe(dlse)} differs from contiguous by {err:.3g} "
            f"(max |{name}| {scale:.3g})"
        )
        assert math.isfinite(err)
