"""BlockMask beyond create_block_mask: torch interop, user block lists, indexing, resizing,
combining, and drawing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention import flex_attention as torch_flex

import flexfa
from flexfa import masks as fm
from flexfa.blockmask.block_mask import BlockMask, BlockSize, TileState
from flexfa.reference import reference_attention
from tests.blockmask import oracle
from tests.blockmask.strategies import cases, examples, masks

_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _docs(*lengths: int) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(
        torch.int32
    )


# -- torch interop ------------------------------------------------------------------------------


@settings(max_examples=examples(25), **_SETTINGS)
@given(cases(max_len=100, max_leaves=2))
def test_round_trip_through_torch(case) -> None:
    bm = flexfa.create_block_mask(
        case.mask.fn, case.B, case.H, case.q_len, case.kv_len, BLOCK_SIZE=case.block_size
    )
    tbm = bm.to_torch()
    assert tbm.seq_lengths == (case.q_len, case.kv_len)
    assert tuple(tbm.BLOCK_SIZE) == (bm.block_size.q, bm.block_size.kv)
    back = BlockMask.from_torch(tbm)
    assert torch.equal(back.tile_states(), bm.tile_states())
    assert back.mask.key == bm.mask.key
    assert not back.tiles_from_mask
    oracle.check_invariants(back)


@pytest.mark.parametrize("block", [32, (64, 16)])
def test_from_torch_create_block_mask(block) -> None:
    doc = _docs(40, 90, 70)
    mask = fm.and_masks(fm.causal, fm.document(doc))
    tbm = torch_flex.create_block_mask(mask, None, None, 200, 200, device="cpu", BLOCK_SIZE=block)
    ours = flexfa.create_block_mask(mask, None, None, 200, 200, BLOCK_SIZE=block)
    theirs = BlockMask.from_torch(tbm)
    # torch counts the padding of the last tile row/column as excluded pairs, so it may call
    # partial what flexfa calls full there; everywhere else the two agree exactly.
    a, b = ours.tile_states(), theirs.tile_states()
    same = a == b
    edge_full = (a == TileState.FULL) & (b == TileState.PARTIAL)
    assert bool((same | edge_full).all())
    nq, nkv = a.shape[-2:]
    interior = torch.zeros_like(same)
    interior[..., : nq - 1, : nkv - 1] = True
    assert bool(same[interior].all())


def test_to_torch_runs_in_torch_flex_attention() -> None:
    doc = _docs(50, 70, 80)
    mask = fm.and_masks(fm.causal, fm.document(doc))
    bm = flexfa.create_block_mask(mask, None, None, 200, 200, BLOCK_SIZE=32)
    q, k, v = (torch.randn(1, 2, 200, 16, dtype=torch.float64) for _ in range(3))
    with pytest.warns(UserWarning):
        out = torch_flex.flex_attention(q, k, v, block_mask=bm.to_torch())
    ref, _ = reference_attention(q, k, v, mask_mod=mask)
    torch.testing.assert_close(out, ref)


def test_from_torch_rejects_other_objects() -> None:
    with pytest.raises(TypeError, match=r"torch\.nn\.attention\.flex_attention\.BlockMask"):
        BlockMask.from_torch("not a mask")


def test_from_torch_with_untraceable_mask_mod() -> None:
    tbm = torch_flex.create_block_mask(fm.causal, 2, 1, 64, 64, device="cpu", BLOCK_SIZE=16)
    sliced = tbm[1]  # torch replaces the mask_mod of a slice by a function that raises
    with pytest.raises(ValueError, match="pass mask_mod="):
        BlockMask.from_torch(sliced)
    bm = BlockMask.from_torch(sliced, mask_mod=fm.causal)
    assert bm.shape == (1, 1, 64, 64)
    want = oracle.expected_states(fm.causal, 1, 1, 64, 64, BlockSize(16, 16))
    assert torch.equal(bm.tile_states(), want)


# -- user block lists ---------------------------------------------------------------------------


def test_from_kv_blocks_computes_q_side_and_defaults() -> None:
    # 3 q-blocks x 4 kv-blocks of 16: partial where listed, full where listed as full.
    kv_num = torch.tensor([1, 2, 0])
    kv_idx = torch.tensor([[2, 0, 0, 0], [3, 0, 0, 0], [0, 0, 0, 0]])
    full_num = torch.tensor([1, 0, 2])
    full_idx = torch.tensor([[0, 0, 0, 0], [0, 0, 0, 0], [1, 3, 0, 0]])
    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=16)
    assert bm.shape == (1, 1, 48, 64)
    assert bm.tile_states()[0, 0].tolist() == [[2, 0, 1, 0], [1, 0, 0, 1], [0, 2, 0, 2]]
    oracle.check_invariants(bm)
    assert bm.mask.is_trivially_true
    # The lists are authoritative: the reference attends wherever a listed tile is full.
    allowed = flexfa.reference.allowed_pairs(None, bm, 1, 1, 48, 64, torch.device("cpu"))
    assert bool(allowed[0, 0, :16, :16].all()) and not bool(allowed[0, 0, :16, 16:32].any())


def test_from_kv_blocks_with_lengths_and_mask() -> None:
    n = torch.tensor([[[1, 2]]])
    idx = torch.tensor([[[[0, 1], [0, 1]]]])
    bm = BlockMask.from_kv_blocks(
        n, idx, BLOCK_SIZE=(32, 16), mask_mod=fm.causal, seq_lengths=(50, 20)
    )
    assert (bm.q_len, bm.kv_len, bm.num_q_blocks, bm.num_kv_blocks) == (50, 20, 2, 2)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((torch.tensor([1.0]), torch.tensor([[0]])), {}, TypeError, "integer tensor"),
        ((torch.tensor([1]), torch.tensor([0])), {}, ValueError, "shape"),
        ((torch.tensor([1, 1]), torch.tensor([[0]])), {}, ValueError, "expected"),
        ((torch.tensor([2]), torch.tensor([[0]])), {}, ValueError, r"lie in \[0, 1\]"),
        ((torch.tensor([1]), torch.tensor([[5]])), {}, ValueError, "outside"),
        (
            (torch.tensor([1]), torch.tensor([[0]])),
            {"full_kv_num_blocks": torch.tensor([0])},
            ValueError,
            "together",
        ),
        (
            (torch.tensor([1]), torch.tensor([[0]])),
            {"seq_lengths": (500, 16)},
            ValueError,
            "q-blocks",
        ),
        (
            (torch.tensor([1]), torch.tensor([[0]])),
            {"seq_lengths": (0, 16)},
            ValueError,
            "seq_lengths",
        ),
    ],
)
def test_from_kv_blocks_errors(args, kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        BlockMask.from_kv_blocks(*args, BLOCK_SIZE=16, **kwargs)


# -- indexing -----------------------------------------------------------------------------------


def test_indexing_batch_and_head_remaps_the_mask() -> None:
    docs = torch.stack([_docs(10, 30, 24), _docs(40, 24), _docs(64)])
    heads = torch.tensor([5, 9, 17, 33])

    def per_head_document(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx - kv_idx < heads[h])

    bm = flexfa.create_block_mask(per_head_document, 3, 4, 64, 64, BLOCK_SIZE=16)
    full = oracle.dense_allowed(per_head_document, 3, 4, 64, 64)
    for index, (bs, hs) in [
        (1, ([1], [0, 1, 2, 3])),
        (-1, ([2], [0, 1, 2, 3])),
        ((0, 2), ([0], [2])),
        ((slice(1, None), slice(None, None, 2)), ([1, 2], [0, 2])),
        ((slice(None), -1), ([0, 1, 2], [3])),
    ]:
        sub = bm[index]
        assert sub.shape[:2] == (len(bs), len(hs))
        want = oracle.tile_states(full[bs][:, hs], BlockSize(16, 16))
        assert torch.equal(oracle.states_of(sub, len(bs), len(hs)), want), index
        # Partial tiles evaluate the remapped mask at the new indices: same pairs as before.
        dense = oracle.dense_allowed(sub.mask_mod, len(bs), len(hs), 64, 64)
        assert torch.equal(dense, full[bs][:, hs]), index


def test_indexing_a_broadcast_dim_keeps_it() -> None:
    bm = flexfa.create_block_mask(fm.causal, 8, 4, 64, 64, BLOCK_SIZE=16)
    assert bm[5].shape[:2] == (1, 1) and bm[5, 2].mask is bm.mask


@pytest.mark.parametrize(
    ("index", "error"),
    [
        ((0, 0, 0, 0), IndexError),  # batch, head and q-block at most
        (5, IndexError),
        ("a", TypeError),
        (slice(None, None, -1), ValueError),
        (slice(3, 3), IndexError),
    ],
)
def test_indexing_errors(index, error) -> None:
    docs = torch.zeros(2, 32, dtype=torch.int32)
    bm = flexfa.create_block_mask(fm.document(docs), 2, None, 32, 32, BLOCK_SIZE=16)
    with pytest.raises(error):
        bm[index]


# -- resize (decoding) ---------------------------------------------------------------------------


@settings(max_examples=examples(25), **_SETTINGS)
@given(cases(max_len=100, max_leaves=2), st.data())
def test_resize_matches_a_mask_built_for_the_new_rows(case, data) -> None:
    bm = flexfa.create_block_mask(
        case.mask.fn, case.B, case.H, case.q_len, case.kv_len, BLOCK_SIZE=case.block_size
    )
    q_offset = data.draw(st.integers(0, case.q_len - 1))
    q_len = data.draw(st.integers(1, case.q_len - q_offset))
    kv_len = data.draw(st.integers(1, case.kv_len))
    new = bm.resize(q_len=q_len, kv_len=kv_len, q_offset=q_offset)
    dense = oracle.dense_allowed(case.mask.fn, case.batch, case.heads, case.q_len, case.kv_len)
    want = oracle.tile_states(
        dense[..., q_offset : q_offset + q_len, :kv_len], BlockSize.of(case.block_size)
    )
    assert torch.equal(oracle.states_of(new, case.batch, case.heads), want)
    remapped = oracle.dense_allowed(new.mask_mod, case.batch, case.heads, q_len, kv_len)
    assert torch.equal(remapped, dense[..., q_offset : q_offset + q_len, :kv_len])


def test_decoding_steps() -> None:
    doc = _docs(300, 500, 224)
    bm = flexfa.create_block_mask(fm.and_masks(fm.causal, fm.document(doc)), None, None, 1024, 1024)
    for length in (1, 299, 300, 301, 777, 1024):
        step = bm.resize(q_len=1, kv_len=length, q_offset=length - 1)
        allowed = oracle.dense_allowed(step.mask_mod, 1, 1, 1, length)
        assert torch.equal(oracle.states_of(step, 1, 1), oracle.tile_states(allowed, bm.block_size))


def test_resize_of_block_lists_slices_them() -> None:
    n = torch.tensor([1, 1, 1, 1])
    idx = torch.tensor([[0, 0], [1, 0], [0, 0], [1, 0]])
    bm = BlockMask.from_kv_blocks(n, idx, BLOCK_SIZE=16)
    part = bm.resize(q_len=20, kv_len=32, q_offset=32)
    assert part.tile_states()[0, 0].tolist() == [[1, 0], [0, 1]]
    with pytest.raises(ValueError, match="whole q-blocks"):
        bm.resize(q_len=16, q_offset=8)
    with pytest.raises(ValueError, match="beyond"):
        bm.resize(q_len=64, q_offset=16)


def test_resize_errors() -> None:
    bm = flexfa.create_block_mask(fm.causal, None, None, 64, 64, BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="q_offset"):
        bm.resize(q_offset=-1)
    with pytest.raises(ValueError, match="kv_len"):
        bm.resize(kv_len=0)


# -- and / or -----------------------------------------------------------------------------------


@settings(max_examples=examples(20), **_SETTINGS)
@given(cases(max_len=90, max_leaves=2), st.data(), st.sampled_from(["&", "|"]))
def test_combining_block_masks(c1, data, how) -> None:
    other = data.draw(masks(c1.q_len, c1.kv_len, max_leaves=2))
    B, H = 2, 3
    bs = c1.block_size
    a = flexfa.create_block_mask(c1.mask.fn, B, H, c1.q_len, c1.kv_len, BLOCK_SIZE=bs)
    b = flexfa.create_block_mask(other.fn, B, H, c1.q_len, c1.kv_len, BLOCK_SIZE=bs)
    combined = a & b if how == "&" else a | b
    combinator = fm.and_masks if how == "&" else fm.or_masks
    want = oracle.expected_states(
        combinator(c1.mask.fn, other.fn), B, H, c1.q_len, c1.kv_len, BlockSize.of(bs)
    )
    assert torch.equal(oracle.states_of(combined, B, H), want), (c1.mask, other)
    assert combined.tiles_from_mask


def test_combining_mismatched_masks_fails() -> None:
    a = flexfa.create_block_mask(fm.causal, None, None, 64, 64, BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="same lengths"):
        a & flexfa.create_block_mask(fm.causal, None, None, 64, 48, BLOCK_SIZE=16)
    lists = BlockMask.from_kv_blocks(
        torch.tensor([1] * 4), torch.zeros(4, 4, dtype=torch.int32), BLOCK_SIZE=16
    )
    with pytest.raises(ValueError, match="block lists"):
        a | lists


# -- drawing ------------------------------------------------------------------------------------


def test_to_string() -> None:
    bm = flexfa.create_block_mask(fm.sliding_window(40), None, None, 64, 64, BLOCK_SIZE=16)
    assert str(bm) == "░░\n██░░\n░░██░░\n░░░░██░░"
    bm = flexfa.create_block_mask(fm.sliding_window(16), None, None, 64, 64, BLOCK_SIZE=16)
    assert str(bm) == "░░\n░░░░\n  ░░░░\n    ░░░░"


def test_to_string_summarizes_large_grids_and_planes() -> None:
    heads = torch.tensor([100, 2000, 5000])
    bm = flexfa.create_block_mask(
        lambda b, h, q, kv: q - kv < heads[h], None, 3, 8192, 8192, BLOCK_SIZE=64
    )
    text = bm.to_string(grid_size=8, limit=2)
    lines = text.splitlines()
    assert lines[0] == "(h=0)" and len(lines[1]) == 16
    assert "1 more (b, h) planes" in text and "16 x 16 tiles" in text
    assert len(bm[:, 2].to_string(grid_size=-1).splitlines()) == 128


def test_sparsity() -> None:
    bm = flexfa.create_block_mask(fm.causal, None, None, 512, 512, BLOCK_SIZE=128)
    assert bm.sparsity() == pytest.approx(100 * 6 / 16)


def test_plot(tmp_path) -> None:
    # matplotlib comes with the test extra: a missing install fails here rather than skipping.
    bm = flexfa.create_block_mask(fm.sliding_window(300), None, None, 2048, 2048)
    path = tmp_path / "mask.png"
    bm.plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(IndexError):
        flexfa.create_block_mask(
            fm.document(torch.zeros(2, 64, dtype=torch.int32)), 2, None, 64, 64
        ).plot(path, b=2)


def test_plot_without_matplotlib(tmp_path, monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    bm = flexfa.create_block_mask(fm.causal, None, None, 64, 64)
    with pytest.raises(ImportError, match=r"pip install flexfa\[plot\]"):
        bm.plot(tmp_path / "x.png")


def test_block_lists_are_authoritative_in_attention() -> None:
    # Tile (0, 0) full although the mask excludes some of its pairs; tile (1, 1) empty although the
    # mask allows pairs there; tile (1, 0) partial.
    bm = BlockMask.from_kv_blocks(
        torch.tensor([0, 1]),
        torch.tensor([[0, 0], [0, 0]]),
        torch.tensor([1, 0]),
        torch.tensor([[0, 0], [0, 0]]),
        BLOCK_SIZE=16,
        mask_mod=fm.causal,
        seq_lengths=(30, 27),
    )
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for n in (30, 27, 27))
    out = flexfa.attention(q, k, v, block_mask=bm)
    expected, _ = reference_attention(q, k, v, block_mask=bm)
    torch.testing.assert_close(out, expected)
    # The same with the mask applied everywhere differs: the tiles changed which pairs attend.
    masked, _ = reference_attention(q, k, v, mask_mod=fm.causal)
    assert not torch.allclose(out, masked)


def test_from_buffer_makes_what_the_checked_constructors_make() -> None:
    """`BlockMask.from_buffer` (Note [Block lists in one buffer]) skips the dataclasses' checks:
    its result must hold every field, and the same lists as the checked constructors give."""
    import dataclasses

    def per_plane(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx < 50 + 20 * h) & (kv_idx <= q_idx + 40 * b)

    bm = flexfa.create_block_mask(per_plane, 2, 3, 300, 200, BLOCK_SIZE=(64, 32))
    assert (bm.batch, bm.heads) == (2, 3)
    B, H, nq, nkv = bm.batch, bm.heads, bm.num_q_blocks, bm.num_kv_blocks
    lists = (bm.kv_partial, bm.kv_full, bm.q_partial, bm.q_full)
    sizes = BlockMask.buffer_sizes(B, H, nq, nkv)
    assert sizes == tuple(bl.count.numel() for bl in lists) + tuple(
        bl.index.numel() for bl in lists
    )
    # An offset buffer, as fused.py's (a flag follows the lists) or a slice of a larger one.
    flat = [bl.count.flatten() for bl in lists] + [bl.index.flatten() for bl in lists]
    buffer = torch.cat(
        [torch.full((5,), -7, dtype=torch.int32), *flat, torch.ones(1, dtype=torch.int32)]
    )
    got = BlockMask.from_buffer(
        buffer[5:], batch=B, heads=H, q_len=300, kv_len=200, block_size=bm.block_size, mask=bm.mask
    )
    for f in dataclasses.fields(BlockMask):
        assert f.name in got.__dict__, f.name
    checked = BlockMask(
        **{f.name: getattr(got, f.name) for f in dataclasses.fields(BlockMask)}
    )  # the checks pass on what it made
    for name in ("kv_partial", "kv_full", "q_partial", "q_full"):
        want, have = getattr(bm, name), getattr(checked, name)
        assert torch.equal(want.count, have.count), name
        assert torch.equal(want.index, have.index), name
        assert have.index.is_contiguous() and have.count.dtype == torch.int32
    assert torch.equal(got.tile_states(), bm.tile_states())
