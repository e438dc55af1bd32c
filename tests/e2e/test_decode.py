"""The decode path (short queries against a long or paged KV cache) against the float64 reference.

Triton's decode kernels run under its interpreter here (tiny sizes, 16-wide tiles); the tiled
backend runs the paged calls as well. See Note [Decode kernels] in flexfa/codegen/triton/decode.py.
"""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa.codegen.triton import decode, decode_configs
from flexfa.reference import reference_attention
from tests.e2e.harness import INTERPRETER_TILES, Problem, check_attention, maker
from tests.mods import mask_mod, score_mod
from tests.tolerance import ThreeWay

# (Lq, group size, mask, score_mod, splits): every Lq and GQA ratio, with masks that differ per
# head, leave rows empty, or differ per batch element; "separate": 3 splits merged by their own kernel.
CASES = [
    (1, 1, "noop", None, None),
    (1, 4, "causal", "alibi", None),
    (1, 8, "key_padding", "relative_bias_per_head", 3),
    (4, 1, "head_dependent", "softcap", 1),
    (4, 4, "document_per_batch", "alibi_slope_table", None),
    (4, 8, "strictly_causal", None, 2),
    (16, 1, "sliding_window", "relative_bias_per_head", None),
    (16, 4, "head_dependent", "alibi", 5),
    (4, 4, "sliding_window_bidirectional", None, "separate"),
    (16, 8, "prefix_lm", None, None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"Lq{c[0]}-G{c[1]}-{c[2]}-{c[3]}-s{c[4]}")
def test_decode_against_reference(case, decode_calls):
    len_q, group, mask_name, score_name, splits = case
    p = Problem(batch=2, heads_q=2 * group, heads_kv=2, len_q=len_q, len_kv=75, head_dim=16)
    if splits == "separate":  # the merge as its own kernel (Note [Fused merge]: fused by default)
        options = {"decode_splits": 3, "decode_merge": "separate"}
    else:
        options = {"decode_splits": splits} if splits else None
    with torch.no_grad():  # learnable captures too: decoding is inference
        check_attention(
            p,
            score_mod=maker(score_mod(score_name), p.shape) if score_name else None,
            mask_mod=mask_mod(mask_name).build(p.shape, seed=1).fn,
            block_size=16,
            kernel_options=options,
            backend="triton",
            grad=False,
            context=str(case),
        )
    assert len(decode_calls) == 1
    assert all(int(c.count_nonzero()) == 0 for c in decode._counters.values())  # left at 0


def test_decode_float16_default_block_mask(decode_calls):
    p = Problem(
        batch=1, heads_q=4, heads_kv=1, len_q=3, len_kv=300, head_dim=32, dtype=torch.float16
    )
    with torch.no_grad():
        check_attention(p, mask_mod=flexfa.masks.causal, backend="triton", grad=False)
    assert len(decode_calls) == 1


def test_hand_built_block_lists_are_authoritative(decode_calls):
    """A block listed full attends everywhere, an unlisted one nowhere (ROW_STATES), per head."""
    B, Hq, Hkv, Lq, Lkv, E = 1, 4, 2, 2, 64, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, n, E, generator=g) for h, n in ((Hq, Lq), (Hkv, Lkv), (Hkv, Lkv)))
    # Per head (one q-block of 16): partial blocks and full blocks of 16 keys.
    partial_n = torch.tensor([[[1]], [[0]], [[2]], [[1]]]).reshape(1, Hq, 1)
    partial_i = torch.tensor([[0, 0, 0, 0], [0, 0, 0, 0], [1, 3, 0, 0], [2, 0, 0, 0]]).reshape(
        1, Hq, 1, 4
    )
    full_n = torch.tensor([1, 2, 0, 1]).reshape(1, Hq, 1)
    full_i = torch.tensor([[3, 0, 0, 0], [0, 2, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]).reshape(
        1, Hq, 1, 4
    )
    bm = flexfa.BlockMask.from_kv_blocks(
        partial_n.int(), partial_i.int(), full_n.int(), full_i.int(), BLOCK_SIZE=16,
        mask_mod=flexfa.masks.causal, seq_lengths=(Lq, Lkv),
    )  # fmt: skip
    assert not bm.tiles_from_mask
    out, lse = flexfa.attention(
        q, k, v, block_mask=bm, enable_gqa=True, return_lse=True, backend="triton",
        kernel_options={"decode_splits": 2},
    )  # fmt: skip
    ref, ref_lse = reference_attention(
        q.double(), k.double(), v.double(), block_mask=bm, enable_gqa=True
    )
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    assert len(decode_calls) == 1


def test_gradients_take_the_attention_kernels(decode_calls):
    q = torch.randn(1, 2, 2, 16, requires_grad=True)
    k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    out = flexfa.attention(q, k, v, backend="triton", kernel_options={"block_m": 16, "block_n": 16})
    out.sum().backward()
    assert not decode_calls and q.grad is not None
    with torch.no_grad():
        again = flexfa.attention(q, k, v, backend="triton")
    assert len(decode_calls) == 1
    torch.testing.assert_close(again, out.detach(), atol=1e-5, rtol=1e-5)


def test_a_repeated_decode_call_reuses_its_prepared_plan(monkeypatch, decode_calls):
    """Note [Decode host time]: a repeated inference call passes the same spec, whose prepared
    plan is found without building its key (the key's first step, the device's capability, is
    not asked again), and its output is the first call's."""
    torch.manual_seed(11)
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    opts = dict(INTERPRETER_TILES, decode_splits=2)

    def call():
        with torch.no_grad():
            return flexfa.attention(q, k, v, enable_gqa=True, backend="triton", kernel_options=opts)

    first = call()

    def asked(device):
        raise AssertionError("the prepared plan was looked up by its key again")

    monkeypatch.setattr(decode, "_capability", asked)
    again = call()
    assert len(decode_calls) == 2
    torch.testing.assert_close(again, first, atol=0, rtol=0)


def test_a_repeated_decode_call_launches_its_specs_kernels(decode_calls):
    """Note [Decode launches by spec]: once a spec's kernels are known, a repeated call launches
    them without the direct launch's fingerprint, and q at another address alignment (a new
    specialization for Triton) goes through the direct launch again."""
    torch.manual_seed(12)
    buf = torch.randn(1 * 4 * 1 * 16 + 1)
    k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    opts = dict(INTERPRETER_TILES, decode_splits=1)

    def call(q):
        with torch.no_grad():
            flexfa.attention(q, k, v, enable_gqa=True, backend="triton", kernel_options=opts)

    aligned, shifted = buf[:64].view(1, 4, 1, 16), buf[1:].view(1, 4, 1, 16)
    call(aligned)
    spec, prep = list(decode._by_spec.values())[-1]
    specs = len(decode._by_spec)
    log = []

    class Fake:  # the direct launch, as the GPU would have it
        def __call__(self, grid, args):
            log.append(("direct", args[0].data_ptr() & 15))

        def compiled_for(self, args):
            return ("kernel", args[0].data_ptr() & 15)

        def call_compiled(self, compiled, grid, args, stream):
            assert compiled == ("kernel", args[0].data_ptr() & 15)
            log.append(("known", compiled[1]))

    prep.direct, prep.by_spec, prep.last_spec = (Fake(), None), {}, None
    call(aligned)
    assert prep.by_spec == {}, "a spec seen once is not kept"
    for q in (aligned, aligned, shifted, shifted, aligned):
        call(q)
    assert len(decode._by_spec) == specs, "every call passed the same spec"
    assert log == [("direct", 0)] * 2 + [("known", 0), ("direct", 4), ("known", 4), ("known", 0)]
    assert {key[0] for key in prep.by_spec[id(spec)].kernels} == {0, 4}


class _Through:
    """A direct launch that runs every launch it gets (through Triton's interpreter) and says, as
    the GPU would, that it knows the compiled kernel (Note [Decode launches by spec])."""

    def __init__(self, real, log):
        self.real, self.log = real, log

    def __call__(self, grid, args):
        self.log.append("direct")
        self.real(grid, args)

    def compiled_for(self, args):
        return ("kernel", args[0].data_ptr() & 15)

    def call_compiled(self, compiled, grid, args, stream):
        self.log.append("known")
        self.real(grid, args)


@pytest.mark.parametrize("merge", ["fused", "separate"])
def test_decode_calls_share_their_scratch_and_grow_it(merge, decode_calls):
    """Note [Decode scratch per stream]: the splits' partial outputs (and the fused merge's
    counters) of one thread's calls (a stream's, on a GPU) come from one kept buffer; a call of a
    larger layout grows it, and a smaller call after it still gives its reference output."""
    g = torch.Generator().manual_seed(4)
    opts = dict(INTERPRETER_TILES, decode_splits=2, decode_merge=merge)
    k, v = (torch.randn(3, 2, 75, 16, generator=g) for _ in range(2))
    check = ThreeWay(torch.float32)
    decode.clear_caches()

    def call(batch, len_q, name):
        q = torch.randn(batch, 4, len_q, 16, generator=g)
        kb, vb = k[:batch], v[:batch]
        with torch.no_grad():
            out = flexfa.attention(
                q, kb, vb, enable_gqa=True, backend="triton", kernel_options=opts
            )
        ref = reference_attention(q, kb, vb, enable_gqa=True)[0]
        eager = reference_attention(q, kb, vb, enable_gqa=True, dtype=torch.float32)[0]
        check(name, out, eager, ref)

    call(1, 1, "small")
    (first,) = decode._partials.values()
    call(1, 1, "small again")
    assert next(iter(decode._partials.values())) is first, "the same buffer, not a new one"
    call(3, 16, "large")  # 3 x 2 KV heads x 2 splits x 32 rows x 17 floats: more than kept
    (grown,) = decode._partials.values()
    assert grown.numel() > first.numel()
    call(1, 1, "small after the large")
    check.assert_ok()
    assert len(decode._partials) == 1 and len(decode_calls) == 4
    assert len(decode._counters) == (merge == "fused")
    assert all(int(c.count_nonzero()) == 0 for c in decode._counters.values())  # left at 0


@pytest.mark.parametrize("case", ["plain", "alibi_window", "paged", "separate_merge"])
def test_repeated_decode_calls_fill_the_arguments_kept_for_their_spec(case, decode_calls):
    """Note [Decode arguments by spec]: once a spec's kernels are known, a repeated call's
    arguments are those kept from an earlier call with the call's own tensors put in. With every
    launch run, each call with new query values gives the bits of the same call with every
    argument built anew (a new spec: the memo off), and a q of other strides under the same spec
    builds them again."""
    from flexfa import api

    g = torch.Generator().manual_seed(3)
    opts = dict(INTERPRETER_TILES, decode_splits=2)
    score = mask = None
    if case == "paged":
        _, kp, vp, table, kv_lens, _ = _paged_problem([37, 0, 64, 5], 16, len_q=1)
        k, v = kp.float(), vp.float()
        extra = dict(page_table=table, kv_lens=kv_lens)
        B, Hq = 4, 4
    else:
        B, Hq = 2, 4
        k, v = (torch.randn(B, 2, 75, 16, generator=g) for _ in range(2))
        extra = {}
    if case == "alibi_window":
        score = flexfa.mods.alibi
        mask = flexfa.create_block_mask(
            flexfa.masks.sliding_window(20), B, Hq, 1, 75, BLOCK_SIZE=16
        )
    if case == "separate_merge":
        opts = dict(INTERPRETER_TILES, decode_splits=3, decode_merge="separate")

    def call(q, memo=True):
        eligible = api._memo_eligible
        if not memo:
            api._memo_eligible = lambda *a: False
        try:
            with torch.no_grad():
                return flexfa.attention(
                    q, k, v, score, mask, enable_gqa=True, return_lse=True, backend="triton",
                    kernel_options=opts, **extra,
                )  # fmt: skip
        finally:
            api._memo_eligible = eligible

    queries = [torch.randn(B, Hq, 1, 16, generator=g) for _ in range(6)]
    call(queries[0])  # the first (logged) launches
    spec, prep = list(decode._by_spec.values())[-1]
    log = []
    split, merge = prep.direct
    prep.direct = (_Through(split, log), _Through(merge, log) if merge else None)
    prep.by_spec, prep.last_spec = {}, None
    kept = [call(q) for q in queries]
    per = 2 if merge else 1  # launches per call
    assert log == ["direct"] * 2 * per + ["known"] * 4 * per, log  # kept from the second repeat
    # The same spec with a q of other strides: its arguments are built again.
    strided = torch.randn(B, 1, Hq, 16, generator=g).transpose(1, 2)
    log.clear()
    with torch.no_grad():
        out = decode.run(spec, strided, k, v)[0]
    assert log == ["direct"] * per, log
    assert out.transpose(1, 2).is_contiguous()  # Note [Output layout]: q's stride order
    for q, got in zip([*queries, strided], [*kept, (out, None)], strict=True):
        built = call(q, memo=False)  # a new spec each: every argument built
        for name, a, b in zip(("out", "lse"), got, built):
            assert a is None or torch.equal(a, b), (
                f"{case}: {name} differs from the call built anew"
            )


@pytest.mark.parametrize(
    "mask_name, len_kv, paged, dense",
    [
        (None, 75, False, True),  # a last tile past Lkv
        (None, 64, False, True),
        ("wide_window", 75, False, True),  # a mask that keeps every tile
        ("causal", 75, False, False),
        (None, 0, True, True),  # pages, per-sequence lengths
    ],
)
def test_dense_decode_walks_every_block_without_lists(mask_name, len_kv, paged, dense):
    """Note [Dense decode]: with every tile full the kernel walks the blocks below kv_len without
    reading its lists, and gives the listed walk's output and LSE bit for bit (same tiles, same
    order); other masks keep the listed walk."""
    from flexfa.api import build_spec

    torch.manual_seed(5)
    G, Hkv, Lq, E = 4, 2, 3, 16
    q = torch.randn(2, G * Hkv, Lq, E)
    mask = {
        None: None,
        "wide_window": flexfa.masks.sliding_window(1000, causal=False),
        "causal": flexfa.masks.causal,
    }[mask_name]
    extra = {}
    if paged:
        q, kp, vp, table, kv_lens, pages = _paged_problem([37, 50], 16, len_q=Lq)
        q, k, v = q.float(), kp.float(), vp.float()
        extra = dict(page_table=table, kv_lens=kv_lens)
    else:
        k, v = torch.randn(2, Hkv, len_kv, E), torch.randn(2, Hkv, len_kv, E)
    outs = []
    for walk in (True, False):
        opts = dict(INTERPRETER_TILES, decode_splits=2, decode_dense=walk)
        if not paged:
            spec = build_spec(
                q, k, v, flexfa.mods.alibi, mask, enable_gqa=True, kernel_options=opts
            )
            assert decode.prepared(spec).constexprs["DENSE"] is (dense and walk)
        with torch.no_grad():
            outs.append(
                flexfa.attention(
                    q, k, v, flexfa.mods.alibi, mask, enable_gqa=True, return_lse=True,
                    backend="triton", kernel_options=opts, **extra,
                )
            )  # fmt: skip
    (out, lse), (listed, listed_lse) = outs
    assert torch.equal(out, listed) and torch.equal(lse, listed_lse)
    if paged:
        ref, _ = _paged_reference(q.double(), pages, flexfa.mods.alibi, None)
    else:
        ref, _ = reference_attention(
            q, k, v, flexfa.mods.alibi, mask, enable_gqa=True, dtype=torch.float64
        )
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_decode_dense_option_is_checked():
    from flexfa.api import build_spec

    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 40, 16)
    spec = build_spec(q, k, k, None, None, kernel_options={"decode_dense": "yes"})
    with pytest.raises(
        ValueError, match=r"kernel_options\['decode_dense'\] must be True, False or 'auto'"
    ):
        decode.prepared(spec)


@pytest.mark.parametrize("block_m", [16, 64])
def test_decode_row_tiles_of_another_size(block_m, decode_calls):
    """kernel_options['decode_block_m'] sets the rows per program: 24 rows (G=8, Lq=3) as two
    16-row tiles, or one 64-row tile, under a mask that leaves rows empty; the same attention."""
    p = Problem(batch=2, heads_q=16, heads_kv=2, len_q=3, len_kv=75, head_dim=16)
    with torch.no_grad():
        check_attention(
            p,
            score_mod=maker(score_mod("alibi"), p.shape),
            mask_mod=mask_mod("strictly_causal").build(p.shape, seed=2).fn,
            block_size=16,
            kernel_options={"decode_block_m": block_m, "decode_splits": 2},
            backend="triton",
            grad=False,
            context=f"decode_block_m={block_m}",
        )
    assert len(decode_calls) == 1
    _spec, prep = list(decode._by_spec.values())[-1]
    assert (prep.config.block_m, prep.tiles) == (block_m, -(-24 // block_m))


def test_decode_block_m_option_is_checked():
    from flexfa.api import build_spec

    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 40, 16)
    spec = build_spec(q, k, k, None, None, kernel_options={"decode_block_m": 24})
    with pytest.raises(ValueError, match=r"decode_block_m'\] must be a power of two >= 16, got 24"):
        decode.prepared(spec)


def test_decode_option_turns_the_path_off(decode_calls):
    q, k, v = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 40, 16), torch.randn(1, 1, 40, 16)
    flexfa.attention(q, k, v, backend="triton", kernel_options={"decode": False})
    assert not decode_calls
    with pytest.raises(ValueError, match="decode"):
        flexfa.attention(q, k, v, backend="triton", kernel_options={"decode": "yes"})


# -- paged KV ------------------------------------------------------------------------------------


def _paged_problem(lens, page_size, heads_q=4, heads_kv=2, len_q=3, max_pages=None, seed=0):
    """Random pools with the sequences' pages in random order; returns inputs and the dense K/V."""
    g = torch.Generator().manual_seed(seed)
    B, E = len(lens), 16
    max_pages = max_pages or max(-(-n // page_size) for n in lens) + 1
    num_pages = B * max_pages + 3
    k_pages = torch.randn(num_pages, heads_kv, page_size, E, generator=g, dtype=torch.float64)
    v_pages = torch.randn(num_pages, heads_kv, page_size, E, generator=g, dtype=torch.float64)
    perm = torch.randperm(num_pages, generator=g)
    page_table = torch.full((B, max_pages), -7, dtype=torch.int32)  # unused entries: garbage
    dense = []
    for b, n in enumerate(lens):
        used = -(-n // page_size)
        pages = perm[b * max_pages : b * max_pages + used]
        page_table[b, :used] = pages.int()
        k = k_pages[pages].permute(1, 0, 2, 3).reshape(heads_kv, -1, E)[:, :n]
        v = v_pages[pages].permute(1, 0, 2, 3).reshape(heads_kv, -1, E)[:, :n]
        dense.append((k[None], v[None]))
    q = torch.randn(B, heads_q, len_q, E, generator=g, dtype=torch.float64)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    return q, k_pages, v_pages, page_table, kv_lens, dense


def _paged_reference(q, dense, score_mod, mask_mod):
    outs, lses = [], []
    for b, (k, v) in enumerate(dense):
        if k.shape[2] == 0:
            outs.append(torch.zeros_like(q[b : b + 1]))
            lses.append(torch.full(q[b : b + 1].shape[:3], -torch.inf, dtype=q.dtype))
            continue
        # The reference sees batch element 0: mods that read b get it through a shifted closure.
        o, l = reference_attention(
            q[b : b + 1], k, v, score_mod, mask_mod and _at_batch(mask_mod, b), enable_gqa=True
        )
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def _at_batch(mask, b):
    return lambda _b, h, q_idx, kv_idx: mask(_b + b, h, q_idx, kv_idx)


@pytest.mark.parametrize("backend", ["triton", "tiled"])
@pytest.mark.parametrize("page_size", [16, 32])
def test_paged_against_reference(backend, page_size):
    lens = [37, 0, 64, 5]  # a partial last page, an empty sequence, a full one
    q, kp, vp, table, kv_lens, dense = _paged_problem(lens, page_size)
    dtype = torch.float32 if backend == "triton" else torch.float64
    window = flexfa.masks.sliding_window(20, causal=False)
    out, lse = flexfa.attention(
        q.to(dtype), kp.to(dtype), vp.to(dtype), flexfa.mods.alibi, window,
        page_table=table, kv_lens=kv_lens, enable_gqa=True, return_lse=True, backend=backend,
    )  # fmt: skip
    ref, ref_lse = _paged_reference(q, dense, flexfa.mods.alibi, window)
    eager, eager_lse = _paged_reference(q.float().double(), dense, flexfa.mods.alibi, window)
    check = ThreeWay(dtype)
    check("out", out, eager.to(dtype), ref)
    check("lse", lse.double(), eager_lse, ref_lse)
    check.assert_ok()
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()  # the empty sequence


def test_paged_pages_smaller_than_a_tile():
    """Page size 16 under 32-key tiles: each column finds its own page."""
    lens = [45, 18]
    q, kp, vp, table, kv_lens, dense = _paged_problem(lens, 16, len_q=2)
    out = flexfa.attention(
        q.float(), kp.float(), vp.float(), page_table=table, kv_lens=kv_lens, enable_gqa=True,
        backend="triton", kernel_options={"decode_block_n": 32, "decode_splits": 2},
    )  # fmt: skip
    ref, _ = _paged_reference(q, dense, None, None)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_paged_mods_see_logical_positions_and_batch():
    """A key-padding mask written for a contiguous cache works unchanged on pages."""
    lens = [40, 21]
    q, kp, vp, table, kv_lens, dense = _paged_problem(lens, 16, len_q=2)
    keep = torch.tensor([30, 7], dtype=torch.int32)

    def padding(b, h, q_idx, kv_idx):
        return kv_idx < keep[b]

    for backend, dtype in (("triton", torch.float32), ("tiled", torch.float64)):
        out = flexfa.attention(
            q.to(dtype), kp.to(dtype), vp.to(dtype), block_mask=padding,
            page_table=table, kv_lens=kv_lens, enable_gqa=True, backend=backend,
        )  # fmt: skip
        ref, _ = _paged_reference(q, dense, None, padding)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_paged_errors_are_clear():
    q, kp, vp, table, kv_lens, _ = _paged_problem([20, 9], 16)
    call = dict(enable_gqa=True, backend="tiled")
    bad = table.clone()
    bad[1, 0] = kp.shape[0]
    with pytest.raises(ValueError, match=r"page_table\[1, 0\]"):
        flexfa.attention(q, kp, vp, page_table=bad, kv_lens=kv_lens, **call)
    with pytest.raises(ValueError, match=r"kv_lens\[0\]"):
        flexfa.attention(
            q, kp, vp, page_table=table, kv_lens=torch.tensor([99, 1], dtype=torch.int32), **call
        )
    with pytest.raises(ValueError, match="int32"):
        flexfa.attention(q, kp, vp, page_table=table.long(), kv_lens=kv_lens, **call)
    with pytest.raises(ValueError, match="both page_table and kv_lens"):
        flexfa.attention(q, kp, vp, page_table=table, **call)
    with pytest.raises(ValueError, match="inference"):
        flexfa.attention(q.requires_grad_(), kp, vp, page_table=table, kv_lens=kv_lens, **call)


def test_paged_kv_cache_decode_loop():
    """Prefill, token-by-token appends across page boundaries, a freed and reused slot."""
    g = torch.Generator().manual_seed(3)
    B, Hkv, Hq, E, P = 2, 2, 4, 16, 16
    cache = flexfa.PagedKVCache(num_pages=12, batch=B, heads_kv=Hkv, page_size=P, head_dim=E)
    ks = [torch.randn(1, Hkv, 0, E) for _ in range(B)]
    vs = [torch.randn(1, Hkv, 0, E) for _ in range(B)]

    def step(tokens, seqs):
        k = torch.randn(len(seqs), Hkv, tokens, E, generator=g)
        v = torch.randn(len(seqs), Hkv, tokens, E, generator=g)
        cache.append(k, v, seqs)
        for i, s in enumerate(seqs):
            ks[s] = torch.cat([ks[s], k[i : i + 1]], 2)
            vs[s] = torch.cat([vs[s], v[i : i + 1]], 2)

    step(14, [0, 1])
    for _ in range(4):
        step(1, [0, 1])
    cache.free(1)
    ks[1], vs[1] = ks[1][:, :, :0], vs[1][:, :, :0]
    step(3, [1])
    assert cache.kv_lens.tolist() == [18, 3] and cache.pages_in_use == 3
    q = torch.randn(B, Hq, 1, E, generator=g)
    for backend in ("tiled", "triton"):
        out = cache.attention(q, enable_gqa=True, backend=backend)
        for b in range(B):
            ref, _ = reference_attention(q[b : b + 1], ks[b], vs[b], enable_gqa=True)
            torch.testing.assert_close(out[b : b + 1], ref.float(), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="out of pages"):
        cache.reserve(0, 170)


@pytest.mark.parametrize("group", [1, 4])
def test_decode_with_broadcast_kv(group, decode_calls):
    """One K/V (batch 1) shared by every query batch element, read with batch stride 0."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 2 * group, 4, 16, generator=g)
    k, v = (torch.randn(1, 2, 75, 16, generator=g) for _ in range(2))
    causal = mask_mod("causal").build(Problem(batch=3, heads_q=2 * group).shape).fn
    with torch.no_grad():
        out, lse = flexfa.attention(
            q, k, v, block_mask=causal, enable_gqa=group > 1, return_lse=True, backend="triton"
        )
    assert len(decode_calls) == 1 and decode_calls[0].kv_broadcast
    kx, vx = (t.expand(3, -1, -1, -1) for t in (k, v))
    out_e, lse_e = reference_attention(q, kx, vx, None, causal, enable_gqa=group > 1)
    out_r, lse_r = reference_attention(
        *(t.double() for t in (q, kx, vx)), None, causal, enable_gqa=group > 1
    )
    check = ThreeWay(torch.float32, context=f"decode broadcast K/V, group {group}")
    check("out", out, out_e, out_r)
    check("lse", lse, lse_e, lse_r)
    check.assert_ok()


@pytest.mark.gpu
@pytest.mark.parametrize("len_q", [1, 4, 16, 64])
@pytest.mark.parametrize("options", [{"decode_merge": "separate"}, {}], ids=["separate", "fused"])
def test_decode_on_gpu(len_q, options, decode_calls):
    """Compiled decode kernels, bf16, D=128, ragged length, ALiBi and a sliding window; contiguous
    and paged (64-key and 16-key pages)."""
    dev, dt = "cuda", torch.bfloat16
    B, Hq, Hkv, Lkv, E = 2, 8, 2, 1000, 128
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, Hq, len_q, E, device=dev, dtype=dt, generator=g)
    k = torch.randn(B, Hkv, Lkv, E, device=dev, dtype=dt, generator=g)
    v = torch.randn(B, Hkv, Lkv, E, device=dev, dtype=dt, generator=g)
    window = flexfa.masks.sliding_window(300, causal=False)
    args = (flexfa.mods.alibi, window)
    ref, ref_lse = reference_attention(q, k, v, *args, enable_gqa=True)
    eager, eager_lse = reference_attention(q, k, v, *args, enable_gqa=True, dtype=dt)
    check = ThreeWay(dt)
    with torch.no_grad():
        out, lse = flexfa.attention(
            q, k, v, *args, enable_gqa=True, return_lse=True, kernel_options=options
        )
        check("out", out, eager, ref)
        check("lse", lse, eager_lse.float(), ref_lse)
        for page in (64, 16):
            pages = -(-Lkv // page)
            pool_k = torch.zeros(B * pages, Hkv, page, E, device=dev, dtype=dt)
            pool_v = torch.zeros_like(pool_k)
            perm = torch.randperm(B * pages, device=dev)
            table = perm.view(B, pages).int()
            kp = torch.nn.functional.pad(k, (0, 0, 0, pages * page - Lkv))
            vp = torch.nn.functional.pad(v, (0, 0, 0, pages * page - Lkv))
            pool_k[perm] = kp.view(B, Hkv, pages, page, E).transpose(1, 2).reshape(-1, Hkv, page, E)
            pool_v[perm] = vp.view(B, Hkv, pages, page, E).transpose(1, 2).reshape(-1, Hkv, page, E)
            lens = torch.full((B,), Lkv, device=dev, dtype=torch.int32)
            bm = flexfa.create_block_mask(window, None, None, len_q, pages * page, device=dev)
            out_p = flexfa.attention(
                q, pool_k, pool_v, flexfa.mods.alibi, bm, enable_gqa=True, page_table=table,
                kv_lens=lens, kernel_options=options,
            )  # fmt: skip
            check(f"paged {page}", out_p, eager, ref)
    check.assert_ok()
    assert len(decode_calls) == 3


def test_a_block_mask_is_moved_once_per_device():
    """Per-BlockMask caches (decode lists) need the same moved BlockMask on every call."""
    from flexfa.blockmask.bind import resolve_block_mask

    bm = flexfa.create_block_mask(flexfa.masks.causal, None, None, 64, 64)
    meta = torch.device("meta")
    first = resolve_block_mask(bm, 1, 1, 64, 64, meta)
    assert first is not bm and first.device == meta
    assert resolve_block_mask(bm, 1, 1, 64, 64, meta) is first


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{"decode_merge": "separate"}, {}], ids=["separate", "fused"])
def test_decode_replays_in_a_cuda_graph(options):
    """A decode call captured with torch.cuda.graph (the fused merge's counters included, which
    come from the graph's pool) replays to the eager result, with new query values each time."""
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(1)
    k, v = (torch.randn(2, 2, 3000, 128, device=dev, dtype=dt, generator=g) for _ in range(2))
    q = torch.randn(2, 8, 1, 128, device=dev, dtype=dt, generator=g)

    def step():
        return flexfa.attention(q, k, v, enable_gqa=True, kernel_options=options)

    with torch.no_grad():
        step()  # plans, lists and compiled kernels come first, outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for _ in range(3):
            q.copy_(torch.randn(q.shape, device=dev, dtype=dt, generator=g))
            graph.replay()
            torch.testing.assert_close(out, step(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "len_q, dense, splits, stages",
    [
        (1, False, 4, 3),
        (4, False, 4, 3),
        (16, False, 4, 3),
        (1, True, 2, 3),
        (4, True, 2, 3),
        (8, True, 2, 3),
        (16, True, 2, 4),
    ],
)
def test_decode_splits_fill_one_wave_of_an_h200(monkeypatch, len_q, dense, splits, stages):
    """Note [Decode configs] on an sm90 device of 132 SMs (B=8, Hq=32, Hkv=8, 32k keys): one
    wave for every row tile, of two programs per SM, or of one where every tile is full: 16- and
    32-row tiles of 128 keys 3 stages deep, 64-row tiles of 64 keys 4 deep, as measured."""
    from flexfa.api import build_spec

    monkeypatch.setattr(decode_configs, "_num_sms", lambda device: 132)
    q = torch.empty(8, 32, len_q, 128, dtype=torch.bfloat16)
    k = v = torch.empty(8, 8, 32768, 128, dtype=torch.bfloat16)
    spec = build_spec(q, k, v, None, None, enable_gqa=True)
    cfg = decode.default_config(spec, (9, 0), 32768 // 128, 1, dense_lists=dense)
    assert (cfg.num_splits, cfg.num_stages) == (splits, stages), cfg
    assert cfg.block_m == max(16, 4 * len_q)
    assert cfg.block_n == (128 if dense and len_q < 16 else 64)
    assert cfg.dense


def test_narrower_decode_tiles_keep_two_programs_per_sm(monkeypatch):
    """Note [Decode configs]: 16-row tiles of a whole cache run one per SM with 128-key tiles;
    given 64-key tiles (kernel_options, or a BlockMask of 64-key blocks) they keep the launch
    measured for those: 4 stages, two programs per SM (4 splits at B * Hkv = 64)."""
    from flexfa.api import build_spec

    monkeypatch.setattr(decode_configs, "_num_sms", lambda device: 132)
    q = torch.empty(8, 32, 1, 128, dtype=torch.bfloat16)
    k = v = torch.empty(8, 8, 32768, 128, dtype=torch.bfloat16)
    narrow = flexfa.create_block_mask(flexfa.masks.noop_mask, None, None, 1, 32768, BLOCK_SIZE=64)
    for opts, mask in (({"decode_block_n": 64}, None), ({}, narrow)):
        spec = build_spec(q, k, v, None, mask, enable_gqa=True, kernel_options=opts)
        blocks = 32768 // spec.block_mask.block_size.kv
        cfg = decode.default_config(spec, (9, 0), blocks, 1, dense_lists=True)
        assert (cfg.block_n, cfg.num_splits, cfg.num_stages) == (64, 4, 4), (opts, cfg)


@pytest.mark.parametrize("len_q", [1, 16])
def test_decode_before_sm90_keeps_the_listed_walk(monkeypatch, len_q):
    """Note [Dense decode]: GPUs before sm_90 keep the listed walk by default, 2 stages deep
    (a deeper pipeline of 64-row tiles would not fit the shared memory of sm_86 and sm_89)."""
    from flexfa.api import build_spec

    monkeypatch.setattr(decode_configs, "_num_sms", lambda device: 84)
    q = torch.empty(8, 32, len_q, 128, dtype=torch.bfloat16)
    k = v = torch.empty(8, 8, 32768, 128, dtype=torch.bfloat16)
    spec = build_spec(q, k, v, None, None, enable_gqa=True)
    cfg = decode.default_config(spec, (8, 6), 32768 // 128, 1, dense_lists=True)
    assert not cfg.dense and cfg.num_stages == 2, cfg


def test_small_paged_decode_tiles_keep_the_listed_walk(monkeypatch):
    """Note [Dense decode]: row tiles under 64 rows of a paged cache keep the listed walk (4
    splits, 3 stages) by default; given decode_dense=True they walk dense with that launch
    shape (Note [Block ids a tile ahead])."""
    from flexfa.api import build_spec

    monkeypatch.setattr(decode_configs, "_num_sms", lambda device: 132)
    q = torch.empty(8, 32, 1, 128, dtype=torch.bfloat16)
    pages = torch.empty(8 * 512, 8, 64, 128, dtype=torch.bfloat16)
    table = torch.arange(8 * 512, dtype=torch.int32).view(8, 512)
    lens = torch.full((8,), 32768, dtype=torch.int32)
    for opts, dense in (({}, False), ({"decode_dense": True}, True)):
        spec = build_spec(
            q, pages, pages, None, None, enable_gqa=True, page_table=table, kv_lens=lens,
            kernel_options=opts,
        )  # fmt: skip
        cfg = decode.default_config(spec, (9, 0), 32768 // 128, 1, dense_lists=True)
        assert (cfg.dense, cfg.num_splits, cfg.num_stages) == (dense, 4, 3), cfg


def test_paged_64_row_tiles_keep_two_programs_per_sm(monkeypatch):
    """Note [Decode configs]: the 4-stage, one-program-per-SM launch of 64-row tiles is for
    contiguous caches; a paged cache's 64-row tiles walk dense 3 stages deep, two per SM (on an
    H200 the other launch took 1121-1288 us at 128k keys against 983)."""
    from flexfa.api import build_spec

    monkeypatch.setattr(decode_configs, "_num_sms", lambda device: 132)
    q = torch.empty(8, 32, 16, 128, dtype=torch.bfloat16)
    pages = torch.empty(8 * 512, 8, 64, 128, dtype=torch.bfloat16)
    table = torch.arange(8 * 512, dtype=torch.int32).view(8, 512)
    lens = torch.full((8,), 32768, dtype=torch.int32)
    spec = build_spec(q, pages, pages, None, None, enable_gqa=True, page_table=table, kv_lens=lens)
    cfg = decode.default_config(spec, (9, 0), 32768 // 128, 1, dense_lists=True)
    assert (cfg.block_m, cfg.dense, cfg.num_splits, cfg.num_stages) == (64, True, 4, 3), cfg


@pytest.mark.gpu
def test_repeated_decode_calls_with_moving_query_alignment_on_gpu():
    """Note [Decode launches by spec]: repeated calls with one spec launch the kernels kept for
    the alignment of q, k and v; a q at another address alignment (a view 1 element into a
    buffer) gets its own kernel, and every call matches the reference."""
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(3)
    k, v = (torch.randn(2, 2, 3000, 128, device=dev, dtype=dt, generator=g) for _ in range(2))
    buf = torch.randn(2 * 8 * 128 + 1, device=dev, dtype=dt, generator=g)
    aligned, shifted = buf[:-1].view(2, 8, 1, 128), buf[1:].view(2, 8, 1, 128)
    assert shifted.data_ptr() % 16 != 0
    check = ThreeWay(dt)
    with torch.no_grad():
        for i, q in enumerate((aligned, aligned, aligned, shifted, shifted, aligned)):
            out = flexfa.attention(q, k, v, flexfa.mods.alibi, enable_gqa=True)
            ref = reference_attention(q, k, v, flexfa.mods.alibi, enable_gqa=True)[0]
            eager = reference_attention(q, k, v, flexfa.mods.alibi, enable_gqa=True, dtype=dt)[0]
            check(f"call {i}", out, eager, ref)
    check.assert_ok()
    known = [e for p in decode._by_spec.values() for e in p[1].by_spec.values()]
    assert any(len(e.kernels) == 2 for e in known), "both alignments kept for one spec"


@pytest.mark.gpu
def test_decode_calls_on_two_streams_and_of_two_sizes_keep_their_scratch_apart():
    """Note [Decode scratch per stream]: calls on two streams, enqueued back to back with nothing
    in between, each use their stream's partial outputs and counters; a call of a larger layout
    grows a stream's buffers while the smaller calls before it may still run. Every output
    matches its reference."""
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(5)
    k, v = (torch.randn(4, 2, 3000, 128, device=dev, dtype=dt, generator=g) for _ in range(2))
    qs = [torch.randn(b, 8, 1, 128, device=dev, dtype=dt, generator=g) for b in (2, 2, 4, 2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    check = ThreeWay(dt)

    def call(q):
        return flexfa.attention(q, k[: q.shape[0]], v[: q.shape[0]], enable_gqa=True)

    with torch.no_grad():
        for q in qs:  # plans and kernels first
            call(q)
        torch.cuda.synchronize()
        outs = []
        for _ in range(3):
            for i, q in enumerate(qs):
                stream = streams[i % 2]
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    outs.append((q, call(q)))
        torch.cuda.synchronize()
    for i, (q, out) in enumerate(outs):
        kb, vb = k[: q.shape[0]], v[: q.shape[0]]
        ref = reference_attention(q, kb, vb, enable_gqa=True)[0]
        eager = reference_attention(q, kb, vb, enable_gqa=True, dtype=dt)[0]
        check(f"call {i}", out, eager, ref)
    check.assert_ok()
    assert all(int(c.count_nonzero()) == 0 for c in decode._counters.values())  # left at 0


@pytest.mark.gpu
def test_triton_launch_hooks_see_repeated_decode_launches():
    """Note [Compiled launches]: a repeated decode call launches its kernels without Triton's
    launch hooks while none is registered, and through Triton's own path, hooks called, once one
    is; the outputs are the same bits either way."""
    from triton import knobs

    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(6)
    k, v = (torch.randn(2, 2, 3000, 128, device=dev, dtype=dt, generator=g) for _ in range(2))
    q = torch.randn(2, 8, 1, 128, device=dev, dtype=dt, generator=g)
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    with torch.no_grad():
        for _ in range(3):  # the spec's kernels are known from its second call
            plain = flexfa.attention(q, k, v, enable_gqa=True)
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            hooked = flexfa.attention(q, k, v, enable_gqa=True)
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        again = flexfa.attention(q, k, v, enable_gqa=True)
    assert any("flexfa_decode" in name for name in seen), seen
    count = len(seen)
    torch.testing.assert_close(hooked, plain, rtol=0, atol=0)
    torch.testing.assert_close(again, plain, rtol=0, atol=0)
    assert len(seen) == count, "no hook once it is removed"


_PIPELINE_CHILD = """
import json, torch, flexfa
from flexfa.api import build_spec
from flexfa.codegen.triton import decode
from flexfa.codegen.triton.decode_configs import DecodeConfig
from flexfa.codegen.triton.offline import compile_launch

def window(b, h, q_idx, kv_idx):
    return q_idx + 8192 - kv_idx < 2048

def shared(lq, paged, mask, dense, stages):
    B, Hq, Hkv, D, L, page = 2, 8, 2, 128, 8192, 64
    q = torch.empty(B, Hq, lq, D, dtype=torch.bfloat16)
    kw = {}
    if paged:
        k = torch.empty(B * L // page, Hkv, page, D, dtype=torch.bfloat16)
        table = torch.randperm(B * L // page, dtype=torch.int32).view(B, -1)
        kw = dict(page_table=table, kv_lens=torch.full((B,), L, dtype=torch.int32))
    else:
        k = torch.empty(B, Hkv, L, D, dtype=torch.bfloat16)
    spec = build_spec(q, k, k, None, mask, enable_gqa=True, **kw)
    cfg = DecodeConfig(block_m=max(16, 4 * lq), block_n=64, num_splits=2, num_stages=stages,
                       dense=dense)
    out, lse = torch.empty_like(q), torch.empty(B, Hq, lq)
    launch = decode.launches(spec, q, k, k, out, lse, cfg, capability=(9, 0),
                             force_compiled=True)[0]
    return compile_launch(launch, 90).metadata.shared

print(json.dumps({
    "dense 16": shared(16, False, None, True, 3),
    "paged 16": shared(16, True, None, True, 3),
    "dense 1": shared(1, False, None, True, 3),
    "dense 1, 2 stages": shared(1, False, None, True, 2),
    "listed window 1": shared(1, False, window, False, 3),
    "paged listed 1": shared(1, True, None, False, 3),
}))
"""


def test_listed_and_paged_walks_pipeline_as_deep_as_the_dense_walk(tmp_path):
    """Note [Block ids a tile ahead]: compiled for sm_90, the walks through block lists and page
    tables hold as many K/V tiles in shared memory as the dense walk at the same stages (before,
    the pipeliner kept one tile in flight whatever the stages). Its own process: a real compile
    cannot share one with Triton's interpreter."""
    from tests.child import run_json

    got = run_json(_PIPELINE_CHILD, tmp_path)
    assert got["paged 16"] >= got["dense 16"], got
    assert got["dense 1"] > got["dense 1, 2 stages"], got
    assert got["listed window 1"] >= got["dense 1"], got
    assert got["paged listed 1"] >= got["dense 1"], got
