"""Note [Repeated inference calls]: repeated calls with gradients disabled reuse their spec and
backend, and still see everything that can change between calls."""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa import api
from flexfa.reference import reference_attention


@pytest.fixture
def spec_builds(monkeypatch):
    """How many calls built their spec (the full path) rather than finding it."""
    api._memo.clear()
    calls = []
    real = api.build_spec

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "build_spec", counting)
    yield calls
    api._memo.clear()


def _close(out, q, k, v, score_mod=None, mask_mod=None):
    ref, _ = reference_attention(q.double(), k.double(), v.double(), score_mod, mask_mod)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_a_repeated_call_skips_the_spec_and_sees_new_values(spec_builds):
    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))
    with torch.no_grad():
        for _ in range(3):
            q.normal_()  # new values in the same tensors: the same call, other results
            _close(flexfa.attention(q, k, v, block_mask=None), q, k, v)
    assert len(spec_builds) == 1


def test_what_changes_the_call_builds_it_again(spec_builds):
    table = torch.randn(2)
    scale = 0.5

    def bias(score, b, h, q_idx, kv_idx):
        return score + scale * table[h]

    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))
    with torch.no_grad():
        flexfa.attention(q, k, v, score_mod=bias)
        table = torch.randn(2)  # a new captured tensor (closure cell rebound)
        _close(flexfa.attention(q, k, v, score_mod=bias), q, k, v, bias)
        scale = 2.0  # a changed float
        _close(flexfa.attention(q, k, v, score_mod=bias), q, k, v, bias)
        qt = q.transpose(2, 3).contiguous().transpose(2, 3)  # other strides
        _close(flexfa.attention(qt, k, v, score_mod=bias), qt, k, v, bias)
        flexfa.attention(q, k, v, score_mod=bias, scale=0.3)  # another scale
        bm = flexfa.create_block_mask(flexfa.masks.causal, 1, 2, 5, 5)
        out = flexfa.attention(q, k, v, score_mod=bias, block_mask=bm)
        _close(out, q, k, v, bias, flexfa.masks.causal)
        flexfa.attention(q, k, v, score_mod=bias, block_mask=bm)  # found
    assert len(spec_builds) == 6


def test_calls_with_gradients_paged_or_mask_mods_take_the_full_path(spec_builds):
    q, k, v = (torch.randn(1, 2, 5, 16, requires_grad=True) for _ in range(3))
    for _ in range(2):
        flexfa.attention(q, k, v).sum().backward()
    with torch.no_grad():
        for _ in range(2):
            flexfa.attention(q, k, v, block_mask=flexfa.masks.causal)
    assert len(spec_builds) == 4 and not api._memo


def test_bad_arguments_still_raise_after_a_good_call(spec_builds):
    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))
    with torch.no_grad():
        flexfa.attention(q, k, v)
        with pytest.raises(ValueError, match="enable_gqa"):
            flexfa.attention(q, k[:, :1], v[:, :1])
        with pytest.raises(TypeError, match="scale"):
            flexfa.attention(q, k, v, scale="big")
        with pytest.raises(ValueError, match="4 dims"):
            flexfa.attention(q[0], k, v)


def test_the_memo_keeps_only_the_last_calls(spec_builds):
    """Per-step BlockMasks (a decoding loop's slices) are not kept alive past the memo's size."""
    import gc
    import weakref

    q, k, v = (torch.randn(1, 2, 1, 16) for _ in range(3))
    refs = []
    with torch.no_grad():
        for _ in range(api._MEMO_SIZE + 4):
            bm = flexfa.create_block_mask(flexfa.masks.noop_mask, 1, 2, 1, 1)
            flexfa.attention(q, k, v, block_mask=bm)
            refs.append(weakref.ref(bm))
    del bm
    gc.collect()
    assert len(api._memo) == api._MEMO_SIZE
    assert all(r() is None for r in refs[:4]), "the oldest BlockMasks are released"
