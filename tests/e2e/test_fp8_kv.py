"""fp8 K/V (float8_e4m3fn, float8_e5m2) with a float16/bfloat16 query (Note [fp8 K/V] in
flexfa/spec.py).

The three-way rule (tests/tolerance.py) on the fp8 values: the truth is flexfa.reference in float64
on the fp8 K/V (upcast exactly), the eager same-dtype result upcasts K/V to q's dtype and runs the
reference in q's dtype, as torch's eager flex_attention does. Dequantization scales are captured
tensors of the score_mod (per head, or one per tensor). Triton runs under its interpreter with a
float16 query (its interpreter multiplies bfloat16 tiles incorrectly); bfloat16 runs on the tiled
backend here and on the GPU in the `gpu` test.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

import flexfa
from flexfa.compiled import compiled_attention
from flexfa.reference import reference_attention
from tests.e2e.harness import INTERPRETER_TILES
from tests.tolerance import ThreeWay

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _inputs(B, Hq, Hkv, Lq, Lkv, E, q_dtype, k_dtype, v_dtype, seed=0, device="cpu"):
    """q in q_dtype; k, v quantized to their (fp8) dtypes; a per-query-head K scale in float32."""
    g = torch.Generator().manual_seed(seed)

    def randn(*size, scale=1.0):
        return torch.randn(size, generator=g, dtype=torch.float64) * scale

    q = randn(B, Hq, Lq, E).to(device=device, dtype=q_dtype)
    k = randn(B, Hkv, Lkv, E, scale=3.0).to(device=device, dtype=k_dtype)
    v = randn(B, Hkv, Lkv, E, scale=2.0).to(device=device, dtype=v_dtype)
    k_scale = (torch.rand(Hq, generator=g, dtype=torch.float64) * 0.4 + 0.1).float().to(device)
    return q, k, v, k_scale


def _per_head(k_scale):
    def dequant_k(score, b, h, q_idx, kv_idx):
        return score * k_scale[h]

    return dequant_k


def _per_tensor(k_scale):
    scale0 = k_scale[0].clone()  # a 0-dim captured tensor

    def dequant_k(score, b, h, q_idx, kv_idx):
        return score * scale0

    return dequant_k


def _decode_causal(len_q, len_kv):
    """Causal with the queries at the end of the keys (decoding)."""
    offset = len_kv - len_q

    def mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return mask


def _check(out, lse, q, k, v, score_mod, mask_mod, context, **kw):
    ref, ref_lse = reference_attention(q, k, v, score_mod, mask_mod, **kw)
    eager, eager_lse = reference_attention(
        q, k.to(q.dtype), v.to(q.dtype), score_mod, mask_mod, dtype=q.dtype, **kw
    )
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    assert out.dtype == q.dtype and lse.dtype == lse_dtype
    check = ThreeWay(q.dtype, context=context)
    check("out", out, eager, ref)
    check("lse", lse, eager_lse, ref_lse)
    check.assert_ok()


# (backend, q dtype, k dtype, v dtype, Hq, Hkv, Lq, Lkv, scale kind, expects the decode path)
CASES = [
    ("tiled", torch.bfloat16, E4M3, E4M3, 4, 2, 13, 29, "head", False),
    ("tiled", torch.float16, E5M2, E5M2, 4, 2, 13, 29, "tensor", False),
    ("tiled", torch.bfloat16, E4M3, E5M2, 8, 2, 1, 37, "head", False),
    ("tiled", torch.bfloat16, E5M2, torch.bfloat16, 8, 2, 4, 37, "tensor", False),
    ("triton", torch.float16, E4M3, E4M3, 4, 2, 13, 29, "head", False),  # the prefill kernel
    ("triton", torch.float16, E5M2, E5M2, 2, 1, 21, 21, "tensor", False),
    ("triton", torch.float16, E4M3, E4M3, 8, 2, 1, 37, "head", True),
    ("triton", torch.float16, E5M2, E4M3, 8, 2, 4, 37, "head", True),
    ("triton", torch.float32, E4M3, E5M2, 4, 2, 4, 37, "tensor", True),  # torch takes fp32 q too
    ("tiled", torch.float64, E5M2, E4M3, 4, 2, 5, 19, "head", False),
]


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-k{str(c[2])[6:]}-v{str(c[3])[6:]}-Lq{c[6]}-{c[8]}",
)
def test_fp8_kv_matches_reference(case, decode_calls):
    backend, qd, kd, vd, Hq, Hkv, Lq, Lkv, kind, via_decode = case
    q, k, v, k_scale = _inputs(2, Hq, Hkv, Lq, Lkv, 16, qd, kd, vd)
    score_mod = _per_head(k_scale) if kind == "head" else _per_tensor(k_scale)
    mask_mod = _decode_causal(Lq, Lkv)
    options = None
    if backend == "triton":
        options = dict(INTERPRETER_TILES)
        if Lq > 4:
            options["decode"] = False
        if Lq == 4:
            options["decode_splits"] = 2  # the merge of split partial results too
    out, lse = flexfa.attention(
        q, k, v, score_mod, mask_mod, enable_gqa=Hq != Hkv, return_lse=True, backend=backend,
        kernel_options=options,
    )  # fmt: skip
    _check(out, lse, q, k, v, score_mod, mask_mod, str(case), enable_gqa=Hq != Hkv)
    assert len(decode_calls) == int(via_decode)


def _keys_inner(v):
    """The same values with V stored (B, H, E, L), keys its contiguous dim (a cache layout that
    spares the kernel fp8's byte-wise reads of V, docs/performance.md; it is not faster)."""
    return v.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("len_q", [1, 4])
def test_fp8_v_stored_keys_inner(len_q, decode_calls):
    q, k, v, k_scale = _inputs(2, 8, 2, len_q, 37, 16, torch.float16, E4M3, E4M3, seed=3)
    v = _keys_inner(v)
    assert v.stride(-2) == 1
    score_mod, mask_mod = _per_head(k_scale), _decode_causal(len_q, 37)
    options = dict(INTERPRETER_TILES, decode_splits=2)
    out, lse = flexfa.attention(
        q, k, v, score_mod, mask_mod, enable_gqa=True, return_lse=True, backend="triton",
        kernel_options=options,
    )  # fmt: skip
    _check(out, lse, q, k, v, score_mod, mask_mod, f"Lq={len_q}", enable_gqa=True)
    assert len(decode_calls) == 1


@pytest.mark.parametrize("backend", ["tiled", "triton"])
def test_fp8_paged_kv_cache(backend):
    """A paged fp8 cache (PagedKVCache in float8_e4m3fn) gives what the same keys give unpaged."""
    Hq, Hkv, E, page = 4, 2, 16, 16
    cache = flexfa.PagedKVCache(
        num_pages=12, batch=2, heads_kv=Hkv, page_size=page, head_dim=E, dtype=E4M3
    )
    q, k, v, k_scale = _inputs(2, Hq, Hkv, 1, 40, E, torch.float16, torch.float64, torch.float64)
    cache.append(k[:, :, :23], v[:, :, :23])
    cache.append(k[:, :, 23:], v[:, :, 23:])
    score_mod = _per_head(k_scale)
    with torch.no_grad():
        out, lse = cache.attention(q, score_mod, enable_gqa=True, return_lse=True, backend=backend)
    _check(out, lse, q, k.to(E4M3), v.to(E4M3), score_mod, None, backend, enable_gqa=True)


def test_reference_and_torch_eager_agree_on_fp8():
    """flexfa's float64 reference on fp8 K/V is torch's eager flex_attention on them."""
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v, k_scale = _inputs(1, 4, 2, 5, 11, 16, torch.float64, E4M3, E5M2)
    score_mod = _per_head(k_scale)
    want = flex_attention(q, k, v, score_mod, enable_gqa=True)
    got, _ = reference_attention(q, k, v, score_mod, enable_gqa=True)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_fp8_backward_raises_like_torch():
    q, k, v, k_scale = _inputs(1, 2, 2, 6, 9, 16, torch.bfloat16, E4M3, E4M3)
    with torch.no_grad():
        want = flexfa.attention(q, k, v, _per_head(k_scale))
    # A forward with q (or a captured scale) asking for gradients runs; its backward raises.
    for grad_of in ("q", "scale"):
        qg = q.clone().requires_grad_(grad_of == "q")
        sg = k_scale.clone().requires_grad_(grad_of == "scale")
        out, lse = flexfa.attention(qg, k, v, _per_head(sg), return_lse=True)
        assert out.requires_grad and lse.requires_grad
        torch.testing.assert_close(out, want, atol=0, rtol=0)
        with pytest.raises(RuntimeError, match="cannot differentiate attention with k of dtype"):
            out.sum().backward()
    with torch.no_grad():
        assert not flexfa.attention(q.requires_grad_(), k, v).requires_grad


def test_dtype_errors_are_clear():
    q, k, v, _ = _inputs(1, 2, 2, 4, 8, 16, torch.float16, E4M3, E4M3)
    with pytest.raises(TypeError, match="float8 is supported for k and v only"):
        flexfa.attention(k, k, v)
    with pytest.raises(
        TypeError, match=r"q, k and v must share a dtype, got torch\.float16, torch\.bfloat16"
    ):
        flexfa.attention(q, k.to(torch.bfloat16), v)
    with pytest.raises(TypeError, match=r"may also be float8"):
        flexfa.attention(q, k, v.float())
    pool = torch.zeros(4, 2, 16, 16, dtype=torch.bfloat16)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"q, k_pages and v_pages must share a dtype"):
        flexfa.attention(q, pool, pool.to(E4M3), page_table=table, kv_lens=lens)
    # What flexfa.attention calls while torch.compile traces: refused there for now.
    with pytest.raises(TypeError, match=r"not supported inside torch\.compile yet"):
        compiled_attention(
            q, k, v, None, None, scale=None, enable_gqa=False, backend="auto",
            kernel_options=None, deterministic=False,
        )  # fmt: skip


def test_backends_explain_fp8():
    """fa4 refuses fp8 K/V with a reason; the tiled and Triton kernels take them."""
    q, k, v, _ = _inputs(1, 2, 2, 4, 8, 16, torch.float16, E5M2, E5M2)
    text = flexfa.explain_backend(q, k, v)
    assert "fa4: no (FA4's kernels read K/V in q's dtype; float8 K/V" in text
    assert "tiled: yes" in text and "triton: yes" in text


_COMPILE_CHILD = textwrap.dedent(
    """
    import json, torch, flexfa
    from flexfa.api import build_spec
    from flexfa.codegen.triton import decode
    from flexfa.codegen.triton.offline import compile_launch
    from flexfa.export import compile_call
    result = {}
    for kd in (torch.float8_e4m3fn, torch.float8_e5m2):
        name = str(kd).removeprefix("torch.float8_")
        q = torch.empty(2, 32, 4, 128, dtype=torch.bfloat16)
        k = torch.empty(2, 8, 4096, 128, dtype=kd)
        scale = torch.ones(32)
        spec = build_spec(q, k, k, lambda s, b, h, i, j: s * scale[h], None, enable_gqa=True)
        out, lse = torch.empty_like(q), torch.empty(2, 32, 4)
        launches = decode.launches(spec, q, k, k, out, lse, capability=(9, 0), force_compiled=True)
        ptx = compile_launch(launches[0], 90).asm["ptx"]
        result["decode " + name] = {"sm90": ".target sm_90" in ptx, "block_n": launches[0].constexprs["BLOCK_N"],
                                    "cp_async": "cp.async" in ptx}
        q = torch.empty(1, 4, 256, 64, dtype=torch.bfloat16)
        k = torch.empty(1, 2, 256, 64, dtype=kd)
        kernels = compile_call(
            q, k, k, None, flexfa.masks.causal, enable_gqa=True, arch=90, with_backward=False
        )
        result["fwd " + name] = {"sm90": ".target sm_90" in kernels["fwd"].asm["ptx"],
                                 "wgmma": "wgmma" in kernels["fwd"].asm["ptx"],
                                 "cp_async": "cp.async" in kernels["fwd"].asm["ptx"]}
    print(json.dumps(result))
    """
)


def test_fp8_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    """The forward and decode kernels with bfloat16 q and fp8 K/V compile for sm_90 (in its own
    process: a real compile cannot share one with Triton's interpreter)."""
    from tests.child import run_json

    kernels = run_json(_COMPILE_CHILD, tmp_path)
    assert set(kernels) == {"decode e4m3fn", "fwd e4m3fn", "decode e5m2", "fwd e5m2"}
    for name, info in kernels.items():
        assert info["sm90"], name
        # Note [Offline compiles specialize as launches do]: pipelined loads, as on the GPU
        assert info["cp_async"], name
    assert kernels["fwd e4m3fn"]["wgmma"] and kernels["fwd e5m2"]["wgmma"]
    assert kernels["decode e4m3fn"]["block_n"] == 128  # Note [Decode configs]: fp8 tiles


@pytest.mark.gpu
@pytest.mark.parametrize("keys_inner", [False, True], ids=["v_rows", "v_keys_inner"])
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("len_q", [1, 4, 300])
def test_fp8_kv_on_gpu(kv_dtype, len_q, keys_inner, decode_calls):
    """Compiled kernels, bf16 q, fp8 K/V, D=128, GQA 4, a per-head K scale and a decode-causal
    mask at a ragged length; Lq=1 and 4 take the decode path, 300 the attention kernel; V as
    stored rows of keys, or keys inner."""
    dev = "cuda"
    B, Hq, Hkv, Lkv, E = 2, 8, 2, 1000, 128
    q, k, v, k_scale = _inputs(
        B, Hq, Hkv, len_q, Lkv, E, torch.bfloat16, kv_dtype, kv_dtype, device=dev
    )
    if keys_inner:
        v = _keys_inner(v)
    score_mod, mask_mod = _per_head(k_scale), _decode_causal(len_q, Lkv)
    with torch.no_grad():
        out, lse = flexfa.attention(q, k, v, score_mod, mask_mod, enable_gqa=True, return_lse=True)
    _check(out, lse, q, k, v, score_mod, mask_mod, f"Lq={len_q} {kv_dtype}", enable_gqa=True)
    assert len(decode_calls) == int(len_q <= 64)


@pytest.mark.gpu
@pytest.mark.parametrize("len_q", [1, 4])
def test_fp8_decode_makes_no_upcast_copy(len_q):
    """The decode call's peak memory stays far below one bf16 copy of K/V (they are read as fp8),
    and a paged fp8 cache gives what the contiguous one gives."""
    dev = "cuda"
    B, Hq, Hkv, Lkv, E = 2, 8, 2, 65536, 128
    q, k, v, k_scale = _inputs(B, Hq, Hkv, len_q, Lkv, E, torch.bfloat16, E4M3, E4M3, device=dev)
    score_mod = _per_head(k_scale)
    with torch.no_grad():
        flexfa.attention(q, k, v, score_mod, enable_gqa=True)  # compile, allocate caches
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = flexfa.attention(q, k, v, score_mod, enable_gqa=True)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        upcast_bytes = 2 * k.numel() * 2
        assert extra < upcast_bytes / 8, (
            f"{extra} bytes allocated; a bf16 K/V copy is {upcast_bytes}"
        )
        page = 128
        pages = Lkv // page
        perm = torch.randperm(B * pages, device=dev)
        table = perm.view(B, pages).int()

        def pool(x):
            flat = x.view(torch.uint8).view(B, Hkv, pages, page, E).transpose(1, 2)
            out = torch.empty(B * pages, Hkv, page, E, dtype=torch.uint8, device=dev)
            out[perm] = flat.reshape(-1, Hkv, page, E)
            return out.view(x.dtype)

        lens = torch.full((B,), Lkv, dtype=torch.int32, device=dev)
        out_p = flexfa.attention(
            q, pool(k), pool(v), score_mod, enable_gqa=True, page_table=table, kv_lens=lens
        )
    rel = float((out_p.float() - out.float()).norm() / out.float().norm())
    assert rel < 1e-2, f"paged fp8 differs from contiguous fp8 by {rel:.3g} (relative)"


@pytest.mark.parametrize(
    "k_dtype, v_dtype, q_scale", [(E4M3, E4M3, 1.0), (E5M2, E4M3, 1e-6), (E4M3, E5M2, 3e4)]
)
def test_fp8_decode_with_bfloat16_q_runs_float16_dots(k_dtype, v_dtype, q_scale):
    """Note [fp8 K/V in float16 dots]: with a bfloat16 q the decode kernel scales each q row by a
    power of 2 into float16's range, so rows far above float16's largest value (3e4 * randn) or
    far below its normal range (1e-6 * randn) decode as exactly as in bfloat16; rows of zeros
    too. Run through the decode kernel directly: flexfa's Triton backend declines bfloat16 under
    the interpreter only for its bfloat16 dots, which this path does not have."""
    from flexfa.api import build_spec
    from flexfa.codegen.triton import decode

    if not flexfa.config.triton_interpret:
        pytest.skip("runs the Triton decode kernel on the CPU under TRITON_INTERPRET=1")
    q, k, v, k_scale = _inputs(2, 8, 2, 3, 70, 32, torch.bfloat16, k_dtype, v_dtype)
    q = (q.float() * q_scale).to(torch.bfloat16)
    q[0, 1, 0] = 0.0
    mod = _per_head(k_scale)
    spec = build_spec(q, k, v, mod, None, enable_gqa=True, kernel_options={"decode_splits": 2})
    assert decode.applies(spec) and decode.prepared(spec).constexprs["F16_DOT"]
    out, lse = decode.run(spec, q, k, v)
    o64, l64 = reference_attention(q, k, v, mod, None, enable_gqa=True, dtype=torch.float64)
    oe, le = reference_attention(q, k, v, mod, None, enable_gqa=True, dtype=torch.bfloat16)
    check = ThreeWay(torch.bfloat16, context=f"k {k_dtype}, v {v_dtype}, q x {q_scale}")
    check("out", out, oe, o64)
    check("lse", lse, le, l64)
    check.assert_ok()
