"""Bad input to flexfa.attention raises ValueError/TypeError naming the argument and what was
expected, before any kernel runs."""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa.masks import causal, sliding_window
from flexfa.mods import alibi


def qkv(B=1, Hq=2, Hkv=2, Lq=8, Lkv=8, E=16, Ev=16, dtype=torch.float32):
    return (
        torch.randn(B, Hq, Lq, E, dtype=dtype),
        torch.randn(B, Hkv, Lkv, E, dtype=dtype),
        torch.randn(B, Hkv, Lkv, Ev, dtype=dtype),
    )


def raises(exc, match, *args, **kwargs):
    with pytest.raises(exc, match=match):
        flexfa.attention(*args, **kwargs)


# -- tensors ----------------------------------------------------------------------------------------


def test_not_a_tensor():
    q, _, v = qkv()
    raises(TypeError, r"k must be a torch.Tensor, got list", q, [1.0], v)


def test_wrong_rank():
    q, k, v = qkv()
    raises(
        ValueError,
        r"q must have 4 dims \(batch, heads, seq_len, head_dim\), got shape \(2, 8, 16\)",
        q[0],
        k,
        v,
    )


def test_unsupported_dtype():
    q, k, v = qkv()
    raises(TypeError, r"v has dtype torch.int64; expected one of float16", q, k, v.long())


def test_mismatched_dtypes():
    q, k, v = qkv()
    raises(
        TypeError,
        r"q, k and v must share a dtype, got torch.float32, torch.float16",
        q,
        k.half(),
        v,
    )


def test_mismatched_devices():
    q, k, v = qkv()
    raises(ValueError, r"q, k and v must be on one device, got cpu, meta", q, k.to("meta"), v)


def test_mismatched_batch():
    q, _, _ = qkv(B=2)
    _, k, v = qkv(B=3)
    raises(ValueError, r"batch sizes differ: q has 2, k has 3", q, k, v)


def test_mismatched_head_dim():
    q, _, v = qkv(E=16)
    _, k, _ = qkv(E=32)
    raises(ValueError, r"k's head dim \(32\) must equal q's \(16\)", q, k, v)


def test_k_and_v_lengths_differ():
    q, k, _ = qkv(Lkv=8)
    _, _, v = qkv(Lkv=9)
    raises(ValueError, r"k and v must have the same heads and length", q, k, v)


def test_head_dim_below_8():
    q, k, v = qkv(E=4, Ev=16)
    raises(ValueError, r"head dims must be at least 8, got E=4", q, k, v)


def test_empty_sequence():
    q, k, v = qkv(Lq=0)
    raises(ValueError, r"q's length must be at least 1", q, k, v)


def test_heads_differ_without_enable_gqa():
    q, k, v = qkv(Hq=4, Hkv=2)
    raises(ValueError, r"q has 4 heads but k/v have 2; pass enable_gqa=True", q, k, v)


def test_gqa_heads_not_a_multiple():
    q, k, v = qkv(Hq=3, Hkv=2)
    raises(
        ValueError,
        r"q's heads \(3\) must be a multiple of k/v's heads \(2\)",
        q,
        k,
        v,
        enable_gqa=True,
    )


# -- mods -------------------------------------------------------------------------------------------


def test_score_mod_arity():
    def three(score, b, h):
        return score

    raises(
        TypeError, r"score_mod 'three' must accept 5 positional arguments", *qkv(), score_mod=three
    )


def test_mask_mod_arity_and_factory_passed_uncalled():
    raises(
        TypeError, r"mask_mod 'alibi' must accept 4 positional arguments", *qkv(), block_mask=alibi
    )
    raises(
        TypeError,
        r"mask_mod 'sliding_window' must accept 4 positional arguments",
        *qkv(),
        block_mask=sliding_window,
    )


def test_score_mod_given_a_mask_mod():
    raises(
        TypeError,
        r"score_mod 'causal' must accept 5 positional arguments",
        *qkv(),
        score_mod=causal,
    )


def test_unsupported_operation_in_a_mod():
    def lgamma_bias(score, b, h, q_idx, kv_idx):
        return torch.lgamma(score)

    raises(
        TypeError,
        r"score_mod 'lgamma_bias': torch.lgamma cannot be traced",
        *qkv(),
        score_mod=lgamma_bias,
    )


def test_control_flow_in_a_mask():
    def branchy(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx if h == 0 else True

    raises(TypeError, r"mask_mod 'branchy'.*torch.where", *qkv(), block_mask=branchy)


def test_mods_returning_the_wrong_dtype():
    raises(
        TypeError,
        r"returned a bool; a score_mod returns the new score",
        *qkv(),
        score_mod=lambda s, b, h, q, k: q >= k,
    )
    raises(
        TypeError,
        r"must return a bool \(True = attend\), got a value of type f32",
        *qkv(),
        block_mask=lambda b, h, q, k: q * 0.5,
    )


def test_captured_tensor_on_another_device():
    table = torch.zeros(2, device="meta")
    raises(
        ValueError,
        r"score_mod 'score_mod' captures 'table' on meta, but q is on cpu",
        *qkv(),
        score_mod=lambda s, b, h, q, k: s + table[h],
    )
    ids = torch.zeros(8, dtype=torch.int32, device="meta")
    raises(
        ValueError,
        r"mask_mod 'document' captures '(q|kv)_ids' on meta",
        *qkv(),
        block_mask=flexfa.masks.document(ids),
    )


def test_captured_tensor_too_small_for_an_attended_pair():
    short = torch.zeros(4)
    raises(
        IndexError,
        r"score_mod 'score_mod' indexes a captured tensor out of bounds",
        *qkv(),
        score_mod=lambda s, b, h, q, k: s + short[q],
    )


# -- other arguments -------------------------------------------------------------------------------


def test_block_mask_of_the_wrong_type():
    raises(
        TypeError,
        r"block_mask must be a flexfa.BlockMask, a torch BlockMask, a mask_mod\(b, h, q_idx, "
        r"kv_idx\) or None, got Tensor",
        *qkv(),
        block_mask=torch.ones(8, 8, dtype=torch.bool),
    )


def test_block_mask_for_other_lengths():
    bm = flexfa.create_block_mask(causal, None, None, 16, 16)
    raises(
        ValueError,
        r"block_mask was built for lengths \(Q_LEN=16, KV_LEN=16\) but q/k have \(8, 8\)",
        *qkv(),
        block_mask=bm,
    )


def test_block_mask_for_other_heads():
    bm = flexfa.create_block_mask(lambda b, h, q, k: h == 0, 1, 3, 8, 8)
    raises(
        ValueError, r"block_mask has 3 heads; expected 1 \(broadcast\) or 2", *qkv(), block_mask=bm
    )


def test_bad_scale():
    raises(TypeError, r"scale must be a finite number or None, got 'big'", *qkv(), scale="big")
    raises(TypeError, r"scale must be a finite number or None, got inf", *qkv(), scale=float("inf"))


def test_bad_backend():
    raises(
        ValueError,
        r"unknown backend 'cuda_magic'; expected 'auto' or one of",
        *qkv(),
        backend="cuda_magic",
    )
    raises(TypeError, r"backend must be a string, got int", *qkv(), backend=3)


def test_bad_kernel_options():
    raises(
        TypeError,
        r"kernel_options must be a dict or None, got list",
        *qkv(),
        kernel_options=[("step_columns", 8)],
    )


def test_heads_dependent_mod_called_directly():
    with pytest.raises(
        TypeError, match=r"alibi depends on the number of heads.*alibi.bind\(num_heads\)"
    ):
        alibi(torch.zeros(()), 0, 0, 0, 0)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        alibi.bind(0)


def test_mod_factories_validate_their_arguments():
    with pytest.raises(ValueError, match="window must be a positive int, got 0"):
        sliding_window(0)
    with pytest.raises(ValueError, match="cap must be a positive finite number"):
        flexfa.mods.softcap(-1.0)
    with pytest.raises(TypeError, match="doc_ids must hold integers"):
        flexfa.masks.document(torch.zeros(4))
    with pytest.raises(ValueError, match="odd last dim"):
        flexfa.mods.relative_bias(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="and_masks needs at least one mask_mod"):
        flexfa.and_masks()
