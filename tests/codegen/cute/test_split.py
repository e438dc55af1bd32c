"""Note [Prefix masks as two native calls]: which masks split by rows, the proof against the mask
itself pair by pair, and the whole forward and backward with FA4's entry points replaced by a
float64 stand-in that applies FA4's own native masks (bottom-right aligned windows)."""

from __future__ import annotations

import pytest
import torch

from flexfa import masks as fm
from flexfa import mods as fmods
from flexfa.api import build_spec
from flexfa.codegen.cute.plan import native_mask, split_rows
from flexfa.frontend import trace_mask_mod
from flexfa.reference import reference_attention


def _dense(mask_mod, len_q: int, len_kv: int) -> torch.Tensor:
    q = torch.arange(len_q).view(-1, 1)
    kv = torch.arange(len_kv).view(1, -1)
    return torch.broadcast_to(mask_mod(torch.tensor(0), torch.tensor(0), q, kv), (len_q, len_kv))


@pytest.mark.parametrize("length", [300, 129, 1000])
@pytest.mark.parametrize("prefix", [1, 100, 128, 257])
def test_the_split_is_the_mask_pair_by_pair(length, prefix):
    mask_mod = fm.prefix_lm(prefix)
    split = split_rows(trace_mask_mod(mask_mod), length, length)
    if prefix >= length:
        assert split is None
        return
    assert split is not None and (split.rows, split.keys) == (prefix, prefix)
    first = native_mask(split.first, prefix, prefix)
    second = native_mask(split.second, length - prefix, length)
    got = torch.zeros(length, length, dtype=torch.bool)
    got[:prefix, :prefix] = first
    got[prefix:] = second
    assert torch.equal(got, _dense(mask_mod, length, length))
    # One kernel serves both parts: the same window flags.
    assert split.first.kind == split.second.kind == "window"
    assert None not in (split.first.window_left, split.second.window_left)


@pytest.mark.parametrize(
    "mask_mod",
    [
        fm.causal,  # native as it is
        lambda b, h, q, kv: (kv < 100) | ((kv <= q) & (q - kv < 64)),  # a prefix and a window
        lambda b, h, q, kv: (kv < 100) | (kv < q),  # strictly causal rows: row 100 differs
        lambda b, h, q, kv: (kv < 100) | (kv <= q) | (b > 0),  # reads b
    ],
)
def test_other_masks_do_not_split(mask_mod):
    assert split_rows(trace_mask_mod(mask_mod), 300, 300) is None


def test_top_left_prefix_masks_with_more_keys_do_not_split():
    # FA4's causal mask is bottom-right aligned: with more keys than queries the rows after the
    # prefix are not it.
    assert split_rows(trace_mask_mod(fm.prefix_lm(100)), 300, 400) is None


def _install_stand_in(monkeypatch, score_mod, seen):
    """launch.forward / launch.backward in float64 under FA4's native window of each part."""
    from flexfa.codegen.cute import backend, launch

    def attend(q, k, v, lowering, scale):
        allowed = native_mask(lowering, q.shape[2], k.shape[2])
        return reference_attention(
            q, k, v, score_mod, lambda b, h, i, j: allowed[i, j], scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # fmt: skip

    def forward(q, k, v, *, out, scale, lowering, **kw):
        seen.append(("fwd", q.shape[2], k.shape[2], lowering.fa4_kwargs()))
        o, lse = attend(q, k, v, lowering, scale)
        return out.copy_(o), lse.float()

    def backward(q, k, v, out, dout, lse, dlse, *, scale, lowering, **kw):
        seen.append(("bwd", q.shape[2], k.shape[2], lowering.fa4_kwargs()))
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            o, l = attend(*leaves, lowering, scale)
            d_lse = torch.zeros_like(l) if dlse is None else dlse.to(l.dtype)
            return torch.autograd.grad((o, l), leaves, (dout, d_lse))

    monkeypatch.setattr(launch, "forward", forward)
    monkeypatch.setattr(launch, "backward", backward)
    monkeypatch.setattr(backend, "hooks_for", lambda s, m, g: launch.Hooks(None, None, None, None))
    monkeypatch.setattr(backend, "_arch_major", lambda device: 9)


@pytest.mark.parametrize(
    ("heads", "length", "score_mod", "layouts"),
    [
        ((2, 2), 300, None, False),
        ((4, 2), 257, fmods.softcap(5.0), True),
        ((2, 1), 130, None, True),
    ],
)
def test_split_forward_and_backward_equal_the_mask(monkeypatch, heads, length, score_mod, layouts):
    """`layouts`: q seen permuted from a (B, L, H, E) buffer, dO sliced and dLSE expanded with
    stride 0, as `lse.sum()` hands it."""
    from flexfa.codegen.cute import backend

    seen: list = []
    _install_stand_in(monkeypatch, score_mod, seen)
    torch.manual_seed(0)
    f64 = torch.float64
    hq, hkv = heads
    if layouts:
        q = torch.randn(2, length, hq, 32, dtype=f64).transpose(1, 2).requires_grad_()
    else:
        q = torch.randn(2, hq, length, 32, dtype=f64, requires_grad=True)
    k, v = (torch.randn(2, hkv, length, 32, dtype=f64, requires_grad=True) for _ in range(2))
    mask_mod = fm.prefix_lm(100)
    spec = build_spec(q, k, v, score_mod, mask_mod, enable_gqa=hq != hkv)
    call = backend.make_call(spec)
    assert call.lowering.kind == call.bwd_lowering.kind == "rows"
    assert call.hooks.mask_mod is None and call.fwd_sparse is None
    out, lse = backend.run(spec, q, k, v)
    if layouts:
        dout = torch.randn(*out.shape[:-1], 64, dtype=f64)[..., ::2]
        dlse = torch.randn(1, 1, 1, dtype=f64).expand_as(lse)
    else:
        dout = torch.randn_like(out)
        dlse = torch.randn_like(lse)
    got = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    o, l = reference_attention(q, k, v, score_mod, mask_mod, enable_gqa=hq != hkv)
    want = torch.autograd.grad((o, l), (q, k, v), (dout, dlse))
    torch.testing.assert_close(out, o)
    torch.testing.assert_close(lse.double(), l)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"d{name}: {m}")
    window = {"window_size_left": length}
    assert seen == [
        ("fwd", 100, 100, {**window, "window_size_right": 99 + length}),
        ("fwd", length - 100, length, {**window, "window_size_right": 0}),
        ("bwd", 100, 100, {**window, "window_size_right": 99 + length}),
        ("bwd", length - 100, length, {**window, "window_size_right": 0}),
    ]


def test_a_score_mod_of_q_idx_keeps_the_mask_mod(monkeypatch):
    """The second call's hooks would see its rows from 0: a score_mod that reads q_idx keeps the
    mask_mod, and explain_backend's path says why."""
    from flexfa.codegen.cute import backend

    monkeypatch.setattr(backend, "_arch_major", lambda device: 9)
    q = torch.randn(1, 4, 300, 32, dtype=torch.bfloat16)
    spec = build_spec(q, q, q, fmods.alibi.bind(4), fm.prefix_lm(100))
    assert backend.make_call(spec).lowering.kind == "mask_mod"
    assert "reads q_idx" in backend.describe_split(spec)
    spec = build_spec(q, q, q, fmods.softcap(5.0), fm.prefix_lm(100))
    assert "two calls" in backend.describe_split(spec)
    assert backend.describe_split(build_spec(q, q, q, None, fm.causal)) is None
