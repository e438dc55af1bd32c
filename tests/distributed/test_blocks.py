"""One block's backward from the global output and LSE (Note [Block backward from the global LSE]).

Keys split into two blocks: each block's forward, merged by LSE, and each block's backward handed
the merged output and LSE must sum to the gradients of one flexfa.attention call over all keys,
for the tiled backend, Triton (under its interpreter here) and the generic autograd path.
"""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa import backends
from flexfa.distributed import blocks


class _Other:
    """A backend the block backward knows nothing about (it takes the generic path)."""

    name = "other"

    def __init__(self, inner):
        self.inner = inner

    def run(self, spec, q, k, v):
        return self.inner.run(spec, q, k, v)


def _window(b, h, q_idx, kv_idx):
    return (q_idx > kv_idx) & (q_idx - kv_idx < 9)  # strict: query 0 has no key


@pytest.mark.parametrize("which", ["tiled", "generic", "triton"])
def test_block_backward_sums_to_the_full_gradient(which):
    torch.manual_seed(0)
    Lq, Lkv, E = 16, 24, 16
    # q is a row slice of a longer tensor, as a query piece of a shard is.
    q = torch.randn(1, 4, Lq + 8, E)[..., 8:, :].detach().requires_grad_(True)
    k = torch.randn(1, 2, Lkv, E, requires_grad=True)
    v = torch.randn(1, 2, Lkv, E, requires_grad=True)
    slopes = torch.rand(4, requires_grad=True)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    backend = "triton" if which == "triton" else "tiled"
    kw = dict(enable_gqa=True, backend=backend)
    out, lse = flexfa.attention(q, k, v, alibi, _window, return_lse=True, **kw)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    loss = (out * dout).sum() + (torch.where(torch.isinf(lse), 0, lse) * dlse).sum()
    want = torch.autograd.grad(loss, (q, k, v, slopes))

    opts = blocks.Options(alibi, _window, None, True, backend, None, False)
    cut = 10
    parts, specs = [], []
    for start, n in ((0, cut), (cut, Lkv - cut)):
        bm = blocks.block_mask(opts, 1, 4, 0, Lq, start, n, q.device)
        k_j, v_j = k.detach()[..., start : start + n, :], v.detach()[..., start : start + n, :]
        spec = blocks.block_spec(opts, bm, q.detach(), k_j, v_j, 0, start, needs_grad=True)
        impl = backends.select(backend, spec)
        if which == "generic":
            impl = _Other(impl)
        specs.append((impl, spec, k_j, v_j, start, n))
        parts.append(blocks.forward(impl, spec, q.detach(), k_j, v_j))
    o, m = flexfa.merge_attention(
        parts[0][0].float(), parts[0][1], parts[1][0].float(), parts[1][1]
    )
    torch.testing.assert_close(o, out.detach(), rtol=1e-5, atol=1e-6)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dslopes = torch.zeros_like(slopes)
    dlse_in = torch.where(torch.isinf(m), 0, dlse)
    for impl, spec, k_j, v_j, start, n in specs:
        gq, gk, gv, gcap = blocks.backward(impl, spec, q.detach(), k_j, v_j, o, m, dout, dlse_in)
        dq += gq
        dk[..., start : start + n, :] += gk
        dv[..., start : start + n, :] += gv
        assert set(gcap) <= {slopes}
        dslopes += gcap.get(slopes, 0)
    for name, got, ref in zip(("dq", "dk", "dv", "dslopes"), (dq, dk, dv, dslopes), want):
        torch.testing.assert_close(
            got, ref, rtol=1e-4, atol=2e-5, msg=lambda s, n=name: f"{n}: {s}"
        )


def test_shifted_mods_reuse_one_trace_and_offsets():
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    a = blocks.shift_mask(causal, 8, 0, torch.device("cpu"))
    assert blocks.shift_mask(causal, 8, 0, torch.device("cpu")) is a
    b = blocks.shift_mask(causal, 16, 8, torch.device("cpu"))
    ta, tb = flexfa.trace_mask_mod(a), flexfa.trace_mask_mod(b)
    assert ta.key == tb.key  # offsets are captured tensors: one IR, one kernel
    opts = blocks.Options(None, causal, None, False, "tiled", None, False)
    bm = blocks.block_mask(opts, 1, 1, 0, 8, 8, 8, torch.device("cpu"))
    assert bm is None  # queries 0..7 never see keys 8..15
