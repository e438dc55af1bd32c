"""The "fa4" backend without a GPU: registration, its reasons for refusing a call, and that
users who never ask for it never import cutlass or flash_attn."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import flexfa
from flexfa.api import build_spec
from flexfa.backends import fa4

ROOT = Path(__file__).resolve().parents[3]


def test_registered_first_for_auto_on_cuda():
    assert flexfa.backends.names()[:2] == ["fa4", "triton"]
    assert fa4.Fa4Backend.auto_device_types == frozenset({"cuda"})


def _cuda_spec(
    len_q=256, head_dim=128, dtype=torch.bfloat16, score_mod=None, grad=True, mask=None, **kw
):
    q = torch.randn(1, 2, len_q, head_dim, dtype=dtype, requires_grad=grad)
    spec = build_spec(q, q, q, score_mod, mask or flexfa.masks.causal, **kw)
    return dataclasses.replace(spec, device=torch.device("cuda"))


def test_auto_takes_fa4_only_where_it_measured_fastest(monkeypatch):
    # Note [Which backend auto picks]
    monkeypatch.setattr(fa4, "missing_package", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    prefers = fa4.Fa4Backend().auto_prefers
    assert prefers(_cuda_spec())
    assert prefers(_cuda_spec(score_mod=flexfa.mods.softcap(30.0), dtype=torch.float16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # choosing fa4 warns about nothing
        assert flexfa.backends.select("auto", _cuda_spec()).name == "fa4"
    assert prefers(_cuda_spec(head_dim=80, grad=False))  # the forward runs at any head dim
    table = torch.randn(2, 65, dtype=torch.bfloat16)
    assert prefers(_cuda_spec(score_mod=flexfa.mods.relative_bias(table, 32)))  # no grad: fine
    declined = {
        "decode-sized queries": _cuda_spec(len_q=64),
        "a padded backward": _cuda_spec(head_dim=80),
        "16-bit captured gradients": _cuda_spec(
            score_mod=flexfa.mods.relative_bias(table.clone().requires_grad_(), 32)
        ),
        "Triton's kernel options": _cuda_spec(kernel_options={"decode": False}),
        "deterministic": _cuda_spec(deterministic=True),
        "float32, which fa4 refuses": _cuda_spec(dtype=torch.float32),
        "a CPU call": _cuda_spec().__class__(
            **{**_cuda_spec().__dict__, "device": torch.device("cpu")}
        ),
    }
    # Masks: native ones whatever their partial tiles, block-sparse ones with few partial tiles.
    docs = torch.arange(1024).div(200, rounding_mode="floor").view(1, -1)
    document = flexfa.masks.and_masks(flexfa.masks.causal, flexfa.masks.document(docs))
    window = _cuda_spec(len_q=1024, mask=flexfa.masks.sliding_window(100))
    prefix = _cuda_spec(len_q=1024, mask=flexfa.masks.prefix_lm(256))
    assert window.block_mask.partial_fraction > 0.25 and prefers(window)
    assert prefix.block_mask.partial_fraction < 0.25 and prefers(prefix)
    declined["a document mask, mostly partial tiles"] = _cuda_spec(len_q=1024, mask=document)
    assert declined["a document mask, mostly partial tiles"].block_mask.partial_fraction > 0.25
    # Without a backward, up to half the tiles partial: documents of 512 tokens, 40% partial.
    halves = torch.arange(1024).div(512, rounding_mode="floor").view(1, -1)
    halves = flexfa.masks.and_masks(flexfa.masks.causal, flexfa.masks.document(halves))
    assert prefers(_cuda_spec(len_q=1024, mask=halves, grad=False))
    assert not prefers(_cuda_spec(len_q=1024, mask=halves))
    assert not prefers(_cuda_spec(len_q=1024, mask=document, grad=False))  # all tiles partial
    declined["a mask_mod on every tile (head dim 256)"] = _cuda_spec(
        len_q=1024, head_dim=256, mask=flexfa.masks.prefix_lm(256)
    )
    for why, spec in declined.items():
        assert not prefers(spec), why
    # fa4 still runs 16-bit captured gradients when asked, and says how they are computed.
    answer = fa4.Fa4Backend().supports(declined["16-bit captured gradients"])
    assert answer.ok and "delta from the rounded bfloat16 output" in answer.reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert not prefers(_cuda_spec())  # sm100: compiled here, never run


def test_cpu_inputs_are_refused_with_a_reason():
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    answer = fa4.Fa4Backend().supports(build_spec(q, q, q))
    assert not answer and ("CUDA" in answer.reason or "not installed" in answer.reason)


def test_missing_package_reason(monkeypatch):
    fa4.missing_package.cache_clear()
    real = fa4.metadata.version

    def version(dist):
        if dist == "flash-attn-4":
            raise fa4.metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(fa4.metadata, "version", version)
    try:
        assert fa4.missing_package() == "flash-attn-4 is not installed (pip install 'flexfa[fa4]')"
        q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
        assert (
            "flash-attn-4 is not installed" in fa4.Fa4Backend().supports(build_spec(q, q, q)).reason
        )
    finally:
        fa4.missing_package.cache_clear()


def test_head_dim_rules_per_arch():
    assert fa4.head_dims_supported(128, 128, 9) is None
    assert fa4.head_dims_supported(256, 256, 9) is None
    assert "divisible by 8" in fa4.head_dims_supported(68, 68, 9)
    assert "sm90 takes head dims 8..256" in fa4.head_dims_supported(264, 264, 9)
    assert fa4.head_dims_supported(192, 128, 10) is None
    assert "sm100" in fa4.head_dims_supported(160, 160, 10)


def test_other_backends_never_import_cutlass_or_flash_attn():
    child = (
        "import sys, torch, flexfa\n"
        "q = torch.randn(1, 2, 16, 16)\n"
        "flexfa.attention(q, q, q, block_mask=flexfa.masks.causal, backend='tiled')\n"
        "print(flexfa.explain_backend(q, q, q))\n"
        "print(sorted(m for m in sys.modules if m == 'cutlass' or m.startswith('flash_attn')))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run(
        [sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "fa4: no" in res.stdout
    assert res.stdout.strip().splitlines()[-1] == "[]"


def test_backward_head_dims():
    # Note [Padded backward]: the next verified sm90 head dim, both dims equal; nothing elsewhere.
    pad = fa4.backward_head_dim
    for head_dim in (64, 96, 128, 192, 256):
        assert pad(head_dim, head_dim, 9) is None
    assert [pad(d, d, 9) for d in (8, 56, 72, 80, 88, 104, 120, 136, 200)] == (
        [64, 64, 96, 96, 96, 128, 128, 192, 256]
    )
    assert pad(64, 128, 9) == pad(128, 64, 9) == 128 and pad(192, 128, 9) == 192
    assert pad(80, 80, 10) is None and pad(64, 128, None) is None


@pytest.mark.parametrize(
    "heads_q, heads_kv, head_dim, head_dim_v, padded",
    [(2, 2, 80, 80, 96), (4, 2, 64, 128, 128), (2, 2, 128, 64, 128), (2, 1, 40, 40, 64)],
)
def test_padded_backward_equals_the_unpadded_one(
    monkeypatch, heads_q, heads_kv, head_dim, head_dim_v, padded
):
    """Note [Padded backward], with a float64 reference standing in for FA4: the backward gets
    q, k, v, the output and dO zero-padded to the verified head dim, and the gradients it
    returns, cut back, equal those of the call's own head dims."""
    from flexfa.codegen.cute import backend, launch
    from flexfa.reference import reference_attention

    seen = {}
    gqa = heads_q != heads_kv

    def forward(q, k, v, *, out, scale, **kw):
        o, lse = reference_attention(q, k, v, None, flexfa.masks.causal, scale=scale,
                                     enable_gqa=gqa)  # fmt: skip
        return out.copy_(o), lse

    def backward(q, k, v, out, dout, lse, dlse, *, scale, **kw):
        seen["dims"] = {t.shape[-1] for t in (q, k, v, out, dout)}
        seen["padding_is_zero"] = all(
            not t[..., n:].any()
            for t, n in ((q, head_dim), (k, head_dim), (v, head_dim_v), (dout, head_dim_v))
        )
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():  # autograd runs this inside a backward
            out, lse = reference_attention(*leaves, None, flexfa.masks.causal, scale=scale,
                                           enable_gqa=gqa)  # fmt: skip
            return torch.autograd.grad((out, lse), leaves, (dout, dlse))

    monkeypatch.setattr(launch, "forward", forward)
    monkeypatch.setattr(launch, "backward", backward)
    monkeypatch.setattr(backend, "hooks_for", lambda s, m, g: launch.Hooks(None, None, None, None))
    monkeypatch.setattr(backend, "_arch_major", lambda device: 9)
    torch.manual_seed(0)
    f64 = torch.float64
    # q as a (B, L, H, E) buffer seen as (B, H, L, E); dO sliced; dLSE expanded, as lse.sum()
    # hands it (layouts autograd really gives the backward).
    q = torch.randn(1, 37, heads_q, head_dim, dtype=f64).transpose(1, 2).requires_grad_()
    k = torch.randn(1, heads_kv, 37, head_dim, dtype=f64, requires_grad=True)
    v = torch.randn(1, heads_kv, 37, head_dim_v, dtype=f64, requires_grad=True)
    spec = build_spec(q, k, v, None, flexfa.masks.causal, enable_gqa=gqa)
    assert backend.make_call(spec).bwd_head_dim == padded
    out, lse = backend.run(spec, q, k, v)
    dout = torch.randn(*out.shape[:-1], 2 * head_dim_v, dtype=f64)[..., ::2]
    dlse = torch.randn(1, 1, 1, dtype=f64).expand_as(lse)
    got = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    assert seen == {"dims": {padded}, "padding_is_zero": True}
    o, l = reference_attention(q, k, v, None, flexfa.masks.causal, enable_gqa=gqa)
    want = torch.autograd.grad((o, l), (q, k, v), (dout, dlse))
    for name, a, b in zip("qkv", got, want):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"d{name}: {m}")


def test_backward_with_a_score_mod_keeps_the_native_mask():
    # Note [Backward with a score_mod]: FA4's own tiles, no mask_mod for a native mask.
    from flexfa.codegen.cute.backend import plan_call
    from flexfa.frontend import trace_mask_mod, trace_score_mod

    causal = trace_mask_mod(flexfa.masks.causal)
    score = trace_score_mod(flexfa.mods.softcap(20.0))
    call = plan_call(score, causal, len_q=256, len_kv=256, needs_grad=True, scale=0.1)
    assert call.lowering.kind == call.bwd_lowering.kind == "causal"
    assert call.hooks.mask_mod is None
    no_mod = plan_call(None, causal, len_q=256, len_kv=256, needs_grad=True, scale=0.1)
    assert no_mod.hooks.mask_mod is None


def test_captured_tensors_are_row_major_in_their_storage_type():
    # Note [Aux tensor layouts], Note [Captured tensors by address]
    from flexfa.codegen.cute.launch import captured_tensor

    table = torch.randn(5, 3).t()  # not contiguous
    cases = (
        (table, (3, 5), torch.float32),
        (torch.tensor(0.5), (1,), torch.float32),
        (torch.ones(4, 1, dtype=torch.bool), (4, 1), torch.uint8),
        (torch.arange(6, dtype=torch.int8).view(2, 3), (2, 3), torch.int32),
        (torch.zeros(1, 1, 2)[..., :1], (1, 1, 1), torch.float32),  # strides (2, 2, 2)
    )
    for t, shape, dtype in cases:
        a = captured_tensor(t)
        assert a.shape == shape and a.dtype == dtype
        assert a.stride() == tuple(torch.empty(shape).stride())
        assert torch.equal(a.to(t.dtype).reshape(t.shape), t)
    assert captured_tensor(table.t()).data_ptr() == table.data_ptr()  # no copy when not needed


def test_aux_scalars_hold_lifted_floats_then_addresses_and_sizes():
    """The launcher's aux_scalars follow the emitter's AuxLayout (Note [Captured tensors by
    address]); a fake tensor's address is 0."""
    import cutlass
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flexfa.codegen.cute.emit import AuxLayout
    from flexfa.codegen.cute.launch import aux_scalars, captured_tensor
    from flexfa.frontend import trace_mask_mod, trace_score_mod

    table = torch.randn(4, 65, requires_grad=True)
    ids = torch.zeros(300, dtype=torch.bool)

    def mod(score, b, h, q_idx, kv_idx, w=0.5):
        return score * w + table[h, q_idx - kv_idx + 32]

    score = trace_score_mod(mod)
    mask = trace_mask_mod(lambda b, h, q_idx, kv_idx: ids[q_idx] | ids[kv_idx])
    aux = AuxLayout.of(score, mask, score.grad_slots())
    grad = torch.zeros(4, 65)
    tensors = [captured_tensor(table), captured_tensor(ids), grad]
    got = aux_scalars(aux, (0.5,), tensors)
    f32, i64, i32 = cutlass.Float32, cutlass.Int64, cutlass.Int32
    # w | table: address, 2 sizes | ids: address, 1 size | gradient of table: address, 2 sizes
    assert [type(x) for x in got] == [f32, i64, i32, i32, i64, i32, i64, i32, i32]
    assert [got[aux.address(p)].value for p in range(3)] == [t.data_ptr() for t in tensors]
    sizes = [got[aux.size(p, d)].value for p, d in ((0, 0), (0, 1), (1, 0), (2, 1))]
    assert sizes == [4, 65, 300, 65] and got[0].value == 0.5
    assert aux_scalars(AuxLayout(0, (), (), ()), ()) is None
    with pytest.raises(AssertionError):  # a tensor the layout does not expect
        aux_scalars(aux, (0.5,), [captured_tensor(table), ids, grad])
    with FakeTensorMode():
        fake = [torch.empty(t.shape, dtype=t.dtype, device="cuda") for t in tensors]
        assert aux_scalars(aux, (0.5,), fake)[aux.address(2)].value == 0


def test_autograd_wiring_with_stand_ins_for_fa4(monkeypatch):
    """The autograd Function around FA4, with FA4's entry points replaced by stand-ins: which
    lowering each pass gets, the aux-tensor list of each pass, and captured gradients written
    into their buffers come back in the capture's dtype."""
    from flexfa.codegen.cute import backend, launch

    seen = {}

    def forward(q, k, v, *, out, scale, lowering, hooks, tensors, **kw):
        seen["fwd"] = (lowering.kind, [tuple(a.shape) for a in tensors])
        return out.copy_(q), torch.zeros(q.shape[:3])

    def backward(q, k, v, out, dout, lse, dlse, *, lowering, tensors, **kw):
        seen["bwd"] = (lowering.kind, [tuple(a.shape) for a in tensors], dlse is not None)
        tensors[-1].add_(2.0)  # the gradient buffer of the one captured tensor
        return dout.clone(), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(launch, "forward", forward)
    monkeypatch.setattr(launch, "backward", backward)
    monkeypatch.setattr(backend, "hooks_for", lambda s, m, g: launch.Hooks(None, None, None, None))
    table = torch.randn(4, 65, dtype=torch.bfloat16, requires_grad=True)
    q = torch.randn(1, 4, 64, 32, dtype=torch.bfloat16, requires_grad=True)
    spec = build_spec(q, q, q, flexfa.mods.relative_bias(table, 32), flexfa.masks.causal)
    out, lse = backend.run(spec, q, q, q)
    dq, dtable = torch.autograd.grad(out.float().sum() + lse.sum(), [q, table])
    assert seen["fwd"] == ("causal", [(4, 65)])
    # The backward keeps FA4's causal mask (Note [Backward with a score_mod]) and gets one float32
    # gradient buffer after the captured tensors.
    assert seen["bwd"] == ("causal", [(4, 65), (4, 65)], True)
    assert dtable.dtype == torch.bfloat16 and bool((dtable == 2.0).all())
    assert torch.equal(dq, torch.ones_like(q))


def test_output_takes_the_stride_order_of_q(monkeypatch):
    """Note [Output layout]: FA4 writes into an output laid out like q (a (B, L, H, E) buffer
    seen as (B, H, L, E) here), as torch's FLASH backend hands it one; the backward reads it."""
    from flexfa.codegen.cute import backend, launch

    seen = {}

    def forward(q, k, v, *, out, **kw):
        seen["fwd"] = out.data_ptr()
        return out.fill_(0.5), torch.zeros(q.shape[:3])

    def backward(q, k, v, out, dout, lse, dlse, **kw):
        seen["bwd"] = out.data_ptr()
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(launch, "forward", forward)
    monkeypatch.setattr(launch, "backward", backward)
    monkeypatch.setattr(backend, "hooks_for", lambda s, m, g: launch.Hooks(None, None, None, None))
    q = torch.randn(2, 48, 4, 32, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 4, 40, 32, dtype=torch.bfloat16)
    v = torch.randn(2, 4, 40, 16, dtype=torch.bfloat16, requires_grad=True)
    spec = build_spec(q, k, v, None, None)
    out, _ = backend.run(spec, q, k, v)
    assert out.shape == (2, 4, 48, 16) and out.transpose(1, 2).is_contiguous()
    out.float().sum().backward()
    assert seen["fwd"] == seen["bwd"] == out.data_ptr()


def test_gqa_backward_with_a_score_mod_runs_on_repeated_kv(monkeypatch):
    """Note [GQA in FA4's score_mod backward]: FA4 gets K/V repeated per query head, and dK, dV
    come back summed over each group of query heads."""
    from flexfa.codegen.cute import backend, launch

    seen = {}

    def forward(q, k, v, *, out, scale, lowering, hooks, tensors, **kw):
        seen["fwd_heads"] = k.shape[1]
        return out.copy_(q), torch.zeros(q.shape[:3])

    def backward(q, k, v, out, dout, lse, dlse, **kw):
        seen["bwd_heads"] = (k.shape[1], v.shape[1])
        assert torch.equal(k[:, 0], k[:, 1]) and torch.equal(k[:, 2], k[:, 3])
        head = torch.arange(4, dtype=q.dtype).view(1, 4, 1, 1)
        return torch.zeros_like(q), torch.ones_like(k) * head, torch.ones_like(v)

    monkeypatch.setattr(launch, "forward", forward)
    monkeypatch.setattr(launch, "backward", backward)
    monkeypatch.setattr(backend, "hooks_for", lambda s, m, g: launch.Hooks(None, None, None, None))
    q = torch.randn(1, 4, 64, 32, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, 64, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    spec = build_spec(q, k, v, flexfa.mods.softcap(20.0), flexfa.masks.causal, enable_gqa=True)
    out, _ = backend.run(spec, q, k, v)
    dk, dv = torch.autograd.grad(out.float().sum(), [k, v])
    assert seen == {"fwd_heads": 2, "bwd_heads": (4, 4)}
    assert dk.shape == k.shape and dk[0, 0].unique().tolist() == [1.0]  # heads 0 + 1
    assert dk[0, 1].unique().tolist() == [5.0] and bool((dv == 2.0).all())  # heads 2 + 3


def test_captured_gradients_refuse_a_backward_on_grouped_kv(monkeypatch):
    """Note [Captured gradients in the FA4 backward]: the hooks sum a gradient indexed by h over
    a warp, which holds one head only when FA4's backward sees K/V repeated per query head; a
    call planned otherwise stops with an error instead of adding heads together."""
    import dataclasses

    from flexfa.codegen.cute import backend, launch

    monkeypatch.setattr(launch, "backward", lambda *a, **kw: pytest.fail("FA4 was called"))
    monkeypatch.setattr(backend, "hooks_for", lambda s, m, g: launch.Hooks(None, None, None, None))
    slopes = torch.rand(4, requires_grad=True)

    def learned_alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    q = torch.randn(1, 4, 64, 32, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 64, 32, dtype=torch.bfloat16) for _ in range(2))
    spec = build_spec(q, k, v, learned_alibi, flexfa.masks.causal, enable_gqa=True)
    call = backend.make_call(spec)
    assert call.bwd_kv_group == 2 and call.grad_slots == (0,)
    lse = torch.zeros(1, 4, 64)
    with pytest.raises(RuntimeError, match=r"as many K/V heads as query heads.*got 2 for 4"):
        backend.backward(
            dataclasses.replace(call, bwd_kv_group=1), q, k, v, q, lse, q, None, (slopes,)
        )


def test_block_sparse_lists_by_default_where_wired(monkeypatch):
    """Note [Block-sparse lists for FA4]: the option decides when given; otherwise the lists are
    used wherever `why_not_sparse` allows them (sm90 and sm100, head dims <= 128, blocks that
    divide FA4's)."""
    from flexfa.codegen.cute import backend

    q = torch.randn(1, 2, 256, 64, dtype=torch.bfloat16)
    spec = build_spec(q, q, q, None, flexfa.masks.prefix_lm(100))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = dataclasses.replace(spec, device=torch.device("cuda"))
    assert backend.uses_block_sparse(cuda)
    assert not backend.uses_block_sparse(
        dataclasses.replace(cuda, kernel_options={"block_sparse": False})
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert backend.uses_block_sparse(cuda)  # sm100: coarsened to 256-row q blocks
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not backend.uses_block_sparse(cuda)  # no lists off sm90 / sm100
    assert backend.uses_block_sparse(dataclasses.replace(cuda, kernel_options={"block_sparse": 1}))
    assert not backend.uses_block_sparse(spec)  # a CPU spec never reaches FA4


def test_support_notes_the_padded_backward(monkeypatch):
    # Note [Padded backward]: explain_backend says how the backward will run.
    if fa4.missing_package() is not None:
        pytest.skip(fa4.missing_package())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    q = torch.randn(1, 2, 64, 80, dtype=torch.bfloat16, requires_grad=True)
    spec = dataclasses.replace(build_spec(q, q, q, None, None), device=torch.device("cuda"))
    answer = fa4.Fa4Backend().supports(spec)
    assert answer.ok and "head dim 96 on zero-padded inputs" in answer.reason
    with torch.no_grad():
        spec = dataclasses.replace(build_spec(q, q, q, None, None), device=torch.device("cuda"))
    assert fa4.Fa4Backend().supports(spec) == fa4.Support.yes()
