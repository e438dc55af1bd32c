"""Generated Triton kernels against the float64 reference, under Triton's interpreter (no GPU).

The same kernels run compiled on a GPU (tests/codegen/triton/test_gpu.py). Sizes are small because
the interpreter executes every program with numpy; tiles are 16 wide so that a few rows and columns
of tiles, partial and full, and ragged last tiles all occur. bfloat16 is not run here: the
interpreter multiplies bfloat16 tiles incorrectly (the backend refuses it on the CPU).
"""

from __future__ import annotations

import pytest
import torch

import flexfa
from tests.e2e import layouts
from tests.e2e.harness import INTERPRETER_TILES as TILES
from tests.e2e.harness import Problem, check_attention, maker
from tests.mods import MASK_MODS, SCORE_MODS, mask_mod, score_mod
from tests.tiers import sweep

SCORE_PROBLEM = Problem(
    batch=2, heads_q=4, heads_kv=2, len_q=37, len_kv=45, head_dim=16, head_dim_v=24
)
MASK_PROBLEM = Problem(
    batch=2, heads_q=2, heads_kv=1, len_q=50, len_kv=33, head_dim=16, head_dim_v=16
)


@pytest.mark.parametrize(
    "i", sweep(range(len(SCORE_MODS)), keep=3), ids=[e.name for e in SCORE_MODS]
)
def test_score_mods(i):
    entry = SCORE_MODS[i]
    p = SCORE_PROBLEM
    check_attention(
        p,
        score_mod=maker(entry, p.shape),
        mask_mod=mask_mod("causal").build(p.shape).fn,
        block_size=(16, 32),
        kernel_options=TILES,
        backend="triton",
        context=entry.name,
        layouts=layouts.cycled(i),
    )


@pytest.mark.parametrize("i", sweep(range(len(MASK_MODS)), keep=3), ids=[e.name for e in MASK_MODS])
def test_mask_mods(i):
    entry = MASK_MODS[i]
    p = MASK_PROBLEM
    check_attention(
        p,
        score_mod=maker(score_mod("relative_bias_per_head"), p.shape),
        mask_mod=entry.build(p.shape, seed=1).fn,
        block_size=(32, 16),
        kernel_options=TILES,
        backend="triton",
        context=entry.name,
        layouts=layouts.cycled(i + 1),
    )


@pytest.mark.parametrize(
    "problem",
    [
        Problem(
            batch=1,
            heads_q=2,
            heads_kv=2,
            len_q=64,
            len_kv=64,
            head_dim=32,
            head_dim_v=32,
            dtype=torch.float16,
        ),
        Problem(
            batch=2,
            heads_q=6,
            heads_kv=2,
            len_q=19,
            len_kv=70,
            head_dim=40,
            head_dim_v=8,
            dtype=torch.float16,
        ),
        Problem(batch=1, heads_q=1, heads_kv=1, len_q=1, len_kv=33, head_dim=16, head_dim_v=16),
    ],
    ids=lambda p: f"{p.len_q}x{p.len_kv}-E{p.head_dim}-Ev{p.head_dim_v}-{str(p.dtype)[6:]}",
)
def test_shapes_and_half_precision(problem):
    check_attention(
        problem,
        score_mod=maker(score_mod("softcap"), problem.shape),
        mask_mod=mask_mod("prefix_lm").build(problem.shape).fn,
        block_size=32,
        kernel_options=TILES,
        backend="triton",
    )


def test_bare_mask_mod_and_default_tiles():
    # No BlockMask given: flexfa builds one at its default block size; default interpreter tiles.
    p = Problem(batch=1, heads_q=2, heads_kv=2, len_q=70, len_kv=130, head_dim=16, head_dim_v=16)
    check_attention(p, mask_mod=mask_mod("sliding_window").build(p.shape).fn, backend="triton")


def test_fully_masked_rows_are_zero_with_zero_gradients():
    q, k, v = (torch.randn(1, 2, 48, 16, requires_grad=True) for _ in range(3))

    def late_start(b, h, q_idx, kv_idx):
        return (q_idx >= 20) & (kv_idx <= q_idx)

    out, lse = flexfa.attention(
        q, k, v, block_mask=late_start, return_lse=True, backend="triton", kernel_options=TILES
    )
    assert torch.isneginf(lse[:, :, :20]).all() and torch.isfinite(lse[:, :, 20:]).all()
    assert (out[:, :, :20] == 0).all()
    (out.sum() + lse[:, :, 20:].sum()).backward()
    assert (q.grad[:, :, :20] == 0).all()
    for g in (q.grad, k.grad, v.grad):
        assert torch.isfinite(g).all()


def test_deterministic_captured_gradients_are_bitwise_repeatable():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    table = torch.randn(2, 129, requires_grad=True)
    slopes = torch.randn(2, requires_grad=True)

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 64] + slopes[h] * (kv_idx - q_idx)

    def grads(deterministic: bool):
        out = flexfa.attention(
            q.requires_grad_(), k, v, bias, flexfa.masks.causal, backend="triton",
            kernel_options=TILES, deterministic=deterministic,
        )  # fmt: skip
        return torch.autograd.grad((out * torch.linspace(-1, 1, 16)).sum(), (table, slopes))

    first, second, atomics = grads(True), grads(True), grads(False)
    for a, b, c in zip(first, second, atomics):
        assert torch.equal(a, b), "deterministic gradients differ between runs"
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def test_triton_refuses_with_reasons():
    q = torch.randn(1, 1, 16, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"triton.*float64"):
        flexfa.attention(q, q, q, backend="triton")
    qb = q.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"interpreter.*bfloat16"):
        flexfa.attention(qb, qb, qb, backend="triton")
    q32 = q.float()
    bm = flexfa.create_block_mask(flexfa.masks.causal, None, None, 16, 16, BLOCK_SIZE=8)
    with pytest.raises(ValueError, match="multiple of 16"):
        flexfa.attention(q32, q32, q32, block_mask=bm, backend="triton")
    with pytest.raises(ValueError, match="unknown kernel_options"):
        flexfa.attention(q32, q32, q32, backend="triton", kernel_options={"blockm": 16})
    with pytest.raises(ValueError, match="power of two"):
        flexfa.attention(q32, q32, q32, backend="triton", kernel_options={"block_m": 24})


def test_auto_on_cpu_picks_tiled_and_explains_triton():
    q = torch.randn(1, 1, 16, 16)
    text = flexfa.explain_backend(q, q, q)
    assert "tiled: yes" in text
    assert "triton:" in text


@pytest.mark.parametrize("score", ["relative_bias_per_head", "t5_buckets"])
def test_fused_dq_backward(score):
    """dQ accumulated with atomics inside the dK/dV kernel (kernel_options bwd_dq="fused")."""
    p = SCORE_PROBLEM
    check_attention(
        p,
        score_mod=maker(score_mod(score), p.shape),
        mask_mod=mask_mod("causal").build(p.shape).fn,
        block_size=(16, 32),
        kernel_options={**TILES, "bwd_dq": "fused"},
        backend="triton",
        context=f"{score} fused dQ",
    )
