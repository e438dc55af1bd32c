"""Coming from torch FlexAttention: its BlockMask accepted as is, `return_aux` with LSE and
max_scores on every backend (compared with dense float64 code)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

import flexfa
from flexfa.blockmask import bind
from flexfa.reference import allowed_pairs, apply_per_pair, reference_attention


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def causal_without_row_5(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx != 5)


def bias(score, b, h, q_idx, kv_idx):
    return score + 0.1 * (kv_idx - q_idx) - 0.05 * h


def qkv(L=70, Lkv=None, dtype=torch.float32, seed=0, H=2):
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, H, L, 16), (1, H, Lkv or L, 16), (1, H, Lkv or L, 16)]
    return tuple(torch.randn(s, generator=g, dtype=dtype) for s in shapes)


def test_torch_block_mask_is_accepted_and_converted_once(monkeypatch):
    q, k, v = qkv(L=300, dtype=torch.float64)
    torch_mask = create_block_mask(causal, None, None, 300, 300, device="cpu")
    calls = []
    real = bind.converted

    def counting(m):
        calls.append(m)
        return real(m)

    out = flexfa.attention(q, k, v, score_mod=bias, block_mask=torch_mask)
    expected, _ = reference_attention(q, k, v, score_mod=bias, mask_mod=causal)
    torch.testing.assert_close(out, expected)
    assert bind.converted(torch_mask) is bind.converted(torch_mask)  # cached
    monkeypatch.setattr("flexfa.blockmask.interop.from_torch", lambda *a: calls.append(a))
    flexfa.attention(q, k, v, block_mask=torch_mask)  # a cache hit: from_torch is not called
    assert not calls


def test_torch_block_mask_for_other_lengths_is_an_error():
    q, k, v = qkv(L=100)
    torch_mask = create_block_mask(causal, None, None, 256, 256, device="cpu")
    with pytest.raises(ValueError, match="lengths"):
        flexfa.attention(q, k, v, block_mask=torch_mask)


def dense_max_scores(q, k, v, score_mod, mask_mod):
    B, H, Lq, E = q.shape
    Lkv = k.shape[2]
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(E)
    s = apply_per_pair(score_mod, B, H, Lq, Lkv, q.device, score=s)
    allowed = allowed_pairs(mask_mod, None, B, H, Lq, Lkv, q.device)
    return s.masked_fill(~allowed, -math.inf).amax(-1)


@pytest.mark.parametrize("backend", ["tiled", "triton"])
@pytest.mark.parametrize("lengths", [(70, 70), (45, 83)])
def test_return_aux_lse_and_max_scores(backend, lengths):
    q, k, v = qkv(*lengths)
    out, aux = flexfa.attention(
        q, k, v, score_mod=bias, block_mask=causal_without_row_5, backend=backend,
        return_aux=AuxRequest(lse=True, max_scores=True),
    )  # fmt: skip
    ref_out, ref_lse = reference_attention(
        q.double(), k.double(), v.double(), score_mod=bias, mask_mod=causal_without_row_5
    )
    expected_max = dense_max_scores(q, k, v, bias, causal_without_row_5)
    assert aux.max_scores.dtype == torch.float32 and aux.max_scores.shape == (1, 2, lengths[0])
    assert torch.isneginf(aux.max_scores[:, :, 5]).all() and torch.isneginf(aux.lse[:, :, 5]).all()
    torch.testing.assert_close(aux.max_scores.double(), expected_max, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux.lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-5)


def test_return_aux_fields_not_asked_for_are_none_and_gradients_flow():
    q, k, v = (t.requires_grad_() for t in qkv())
    out, aux = flexfa.attention(q, k, v, block_mask=causal, return_aux=AuxRequest(max_scores=True))
    assert aux.lse is None and aux.max_scores is not None and not aux.max_scores.requires_grad
    out.sum().backward()
    assert q.grad is not None
    _, only_lse = flexfa.attention(q, k, v, return_aux=flexfa.AuxRequest(lse=True))
    assert only_lse.max_scores is None and only_lse.lse.requires_grad
    with pytest.raises(ValueError, match="not both"):
        flexfa.attention(q, k, v, return_lse=True, return_aux=AuxRequest(lse=True))
    with pytest.raises(TypeError, match="AuxRequest"):
        flexfa.attention(q, k, v, return_aux=True)


def test_return_aux_under_torch_compile():
    import torch._dynamo.testing

    q, k, v = qkv()

    def f(q, k, v):
        return flexfa.attention(
            q, k, v, score_mod=bias, block_mask=causal,
            return_aux=AuxRequest(lse=True, max_scores=True),
        )  # fmt: skip

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    out, aux = torch.compile(f, fullgraph=True, backend=counter)(q, k, v)
    ref_out, ref_aux = f(q, k, v)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(aux.lse, ref_aux.lse)
    torch.testing.assert_close(aux.max_scores, ref_aux.max_scores)
    assert counter.frame_count == 1


def test_positional_arguments_in_torch_order_and_torch_kernel_options():
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = qkv(L=64)
    torch_mask = create_block_mask(causal, None, None, 64, 64, device="cpu")
    args = (q, k, v, bias, torch_mask, 0.3, False, True)  # ..., scale, enable_gqa, return_lse
    out, lse = flexfa.attention(*args)
    ref_out, ref_lse = flex_attention(*args)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    with pytest.warns(UserWarning, match="PRESCALE_QK"):
        again = flexfa.attention(
            q, k, v, bias, torch_mask, 0.3,
            kernel_options={"BLOCK_M": 32, "BLOCK_N": 32, "PRESCALE_QK": False},
        )  # fmt: skip
    torch.testing.assert_close(again, out)
    from flexfa.torch_options import translate

    assert translate({"BLOCK_M1": 32, "num_stages": 2}) == {"bwd_block_m1": 32, "num_stages": 2}
