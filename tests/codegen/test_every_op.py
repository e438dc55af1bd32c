"""Every op of the IR through every backend: each backend either generates code for a mod that
uses the op (forward and backward) or refuses the call in `supports()` with a reason, so that
`backend="auto"` never picks a backend that then fails (Note [Every op has a CuTe lowering] in
flexfa/codegen/cute/emit.py). A new `Op` fails `test_the_table_covers_every_op` until a mod
using it is added below."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import flexfa
from flexfa.api import build_spec
from flexfa.backends import fa4
from flexfa.backends.triton import TritonBackend
from flexfa.codegen.cute import emit as cute_emit
from flexfa.codegen.cute import module as cute_module
from flexfa.codegen.triton import module as triton_module
from flexfa.ir.nodes import Op, toposort

_TABLE = torch.rand(4, 3)


def _f(cond):
    return torch.where(cond, 1.0, 0.0)


# One score_mod per op, each of which uses the op (checked by `test_each_mod_uses_its_op`).
MODS = {
    Op.CONST: lambda s, b, h, q, kv: s + 1.5,
    Op.VAR: lambda s, b, h, q, kv: s * (h + 1),
    Op.CAPTURE: lambda s, b, h, q, kv: s + _TABLE[h, kv % 3],
    Op.SCALAR: lambda s, b, h, q, kv, c=0.25: s * c,
    Op.LOAD: lambda s, b, h, q, kv: s * _TABLE[h % 4, q % 3],
    Op.NEG: lambda s, b, h, q, kv: -s * 0.5 + s * s,
    Op.NOT: lambda s, b, h, q, kv: s + ((~(q - kv)) & 3) * 0.5,
    Op.ABS: lambda s, b, h, q, kv: s.abs(),
    Op.SIGN: lambda s, b, h, q, kv: s + torch.sign(s),
    Op.EXP: lambda s, b, h, q, kv: torch.exp(s * 0.1),
    Op.EXP2: lambda s, b, h, q, kv: torch.exp2(s * 0.1),
    Op.LOG: lambda s, b, h, q, kv: torch.log(s * s + 1.0),
    Op.LOG2: lambda s, b, h, q, kv: torch.log2(s * s + 1.0),
    Op.SQRT: lambda s, b, h, q, kv: torch.sqrt(s * s + 1.0),
    Op.RSQRT: lambda s, b, h, q, kv: torch.rsqrt(s * s + 1.0),
    Op.TANH: lambda s, b, h, q, kv: 5.0 * torch.tanh(s / 5.0),
    Op.SIGMOID: lambda s, b, h, q, kv: torch.sigmoid(s),
    Op.ERF: lambda s, b, h, q, kv: F.gelu(s),  # the attention-gym's GELU score_mod
    Op.SIN: lambda s, b, h, q, kv: s + torch.sin(s),
    Op.COS: lambda s, b, h, q, kv: s + torch.cos(s),
    Op.FLOOR: lambda s, b, h, q, kv: s + torch.floor(s),
    Op.CEIL: lambda s, b, h, q, kv: s + torch.ceil(s),
    Op.CAST: lambda s, b, h, q, kv: s + q.to(torch.float32) * 0.01,
    Op.ADD: lambda s, b, h, q, kv: s + s * 0.5,
    Op.SUB: lambda s, b, h, q, kv: s - (kv - q) * 0.01,
    Op.MUL: lambda s, b, h, q, kv: s * s,
    Op.TRUEDIV: lambda s, b, h, q, kv: s / (s * s + 1.0),
    Op.FLOORDIV: lambda s, b, h, q, kv: s + ((q - kv) // 3) * 0.01,
    Op.MOD: lambda s, b, h, q, kv: s + ((q - kv) % 3) * 0.01,
    Op.POW: lambda s, b, h, q, kv: (s * s + 1.0) ** 0.75,
    Op.MIN: lambda s, b, h, q, kv: torch.minimum(s, s * 0.5),
    Op.MAX: lambda s, b, h, q, kv: torch.maximum(s, s * 0.5),
    Op.LT: lambda s, b, h, q, kv: s + _f(q < kv),
    Op.LE: lambda s, b, h, q, kv: s + _f(q <= kv),
    Op.EQ: lambda s, b, h, q, kv: s + _f(q == kv),
    Op.NE: lambda s, b, h, q, kv: s + _f(q != kv),
    Op.AND: lambda s, b, h, q, kv: s + _f((q < kv) & (h == 1)),
    Op.OR: lambda s, b, h, q, kv: s + _f((q < kv) | (h == 1)),
    Op.XOR: lambda s, b, h, q, kv: s + ((q ^ kv) & 1) * 0.5,
    Op.SHL: lambda s, b, h, q, kv: s + ((q << 2) - kv) * 0.01,
    Op.SHR: lambda s, b, h, q, kv: s + ((q - kv) >> 1) * 0.01,
    Op.WHERE: lambda s, b, h, q, kv: torch.where(s > 0, s, s * 0.1),
}


def all_ops(s, b, h, q, kv, c=0.25):
    """Every mod above in one score_mod (the combined mod the compile test compiles)."""
    total = s
    for mod in MODS.values():
        total = total + 0.01 * mod(s, b, h, q, kv)
    return total + c


def _spec(score_mod, *, device="cpu", dtype=torch.float32, length=24, head_dim=16):
    q = torch.randn(1, 2, length, head_dim, dtype=dtype, requires_grad=True)
    spec = build_spec(q, q, q, score_mod, flexfa.masks.causal)
    return dataclasses.replace(spec, device=torch.device(device))


def test_the_table_covers_every_op():
    assert set(MODS) == set(Op), f"ops without a mod in this test: {set(Op) - set(MODS)}"


@pytest.mark.parametrize("op", list(Op), ids=lambda op: op.name)
def test_each_mod_uses_its_op(op):
    traced = _spec(MODS[op]).score_mod
    assert op in {n.op for n in toposort([traced.output])}, traced.format()


@pytest.mark.parametrize("op", list(Op), ids=lambda op: op.name)
def test_every_op_runs_on_tiled(op):
    q, k, v = (torch.randn(1, 2, 13, 8, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    out = flexfa.attention(q, k, v, score_mod=MODS[op], block_mask=flexfa.masks.causal,
                           backend="tiled")  # fmt: skip
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("op", list(Op), ids=lambda op: op.name)
def test_every_op_generates_triton_or_is_refused(op):
    spec = _spec(MODS[op])
    with flexfa.config.override(triton_interpret=True):
        answer = TritonBackend().supports(spec)
    if not answer:
        assert answer.reason
        return
    source = triton_module.render(spec.score_mod, spec.mask, spec.score_mod.grad_slots())
    compile(source, "<triton module>", "exec")  # valid Python


def _fake_gpu(monkeypatch, major=9):
    monkeypatch.setattr(fa4, "missing_package", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))


@pytest.mark.parametrize("op", list(Op), ids=lambda op: op.name)
def test_every_op_generates_cute_or_is_refused(op, monkeypatch):
    _fake_gpu(monkeypatch)
    spec = _spec(MODS[op], device="cuda", dtype=torch.bfloat16)
    answer = fa4.Fa4Backend().supports(spec)
    if not answer:
        assert op.name in answer.reason, answer.reason
        return
    rendered = cute_module.render(spec.score_mod, None, spec.score_mod.grad_slots())
    compile(rendered.source, "<cute module>", "exec")  # valid Python
    assert op in cute_emit.LOWERED_OPS


def _as_mask(op):
    """A mask_mod whose block mask analysis, proofs and generated code meet `op` (on a float
    made from the indices where the score_mod used the score)."""

    def mask_mod(b, h, q_idx, kv_idx):
        x = (q_idx - kv_idx).to(torch.float32) * 0.25
        return (MODS[op](x, b, h, q_idx, kv_idx) > 0.5) | (q_idx == kv_idx)

    return mask_mod


@pytest.mark.parametrize("op", list(Op), ids=lambda op: op.name)
def test_every_op_in_a_mask_mod_runs_or_is_refused(op, monkeypatch):
    mask = _as_mask(op)
    q = torch.randn(1, 2, 24, 16, dtype=torch.float64)
    out = flexfa.attention(q, q, q, block_mask=mask, backend="tiled")
    assert torch.isfinite(out).all()
    spec = build_spec(q.float(), q.float(), q.float(), None, mask)
    with flexfa.config.override(triton_interpret=True):
        if TritonBackend().supports(spec):
            compile(triton_module.render(None, spec.mask, frozenset()), "<triton>", "exec")
    _fake_gpu(monkeypatch)
    spec = dataclasses.replace(
        build_spec(q.bfloat16(), q.bfloat16(), q.bfloat16(), None, mask),
        device=torch.device("cuda"),
    )
    answer = fa4.Fa4Backend().supports(spec)
    if answer:
        compile(cute_module.render(None, spec.mask, frozenset()).source, "<cute>", "exec")
    else:
        assert op.name in answer.reason, answer.reason


def test_fa4_refuses_an_op_it_cannot_lower_and_auto_moves_on(monkeypatch, request):
    # Note [Every op has a CuTe lowering]: were erf without a lowering, GELU would be refused.
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(cute_emit, "LOWERED_OPS", cute_emit.LOWERED_OPS - {Op.ERF})
    fa4._unlowered_ops_of.cache_clear()  # answers are kept per IR
    request.addfinalizer(fa4._unlowered_ops_of.cache_clear)
    spec = _spec(MODS[Op.ERF], device="cuda", dtype=torch.bfloat16)
    answer = fa4.Fa4Backend().supports(spec)
    assert not answer and "ERF" in answer.reason and "CuTe" in answer.reason, answer
    assert not fa4.Fa4Backend().auto_prefers(spec)
    assert flexfa.backends.select("auto", spec).name == "triton"


def test_gelu_is_chosen_for_fa4_and_lowered_with_cute_erf(monkeypatch):
    # The call that failed on the H200: the gym's GELU score_mod, bfloat16, auto.
    _fake_gpu(monkeypatch)
    spec = _spec(MODS[Op.ERF], device="cuda", dtype=torch.bfloat16, length=256, head_dim=128)
    assert fa4.Fa4Backend().supports(spec)
    assert flexfa.backends.select("auto", spec).name == "fa4"
    rendered = cute_module.render(spec.score_mod, None, frozenset())
    assert "cute.math.erf(" in rendered.source


@pytest.mark.slow
@pytest.mark.skipif(fa4.missing_package() is not None, reason=str(fa4.missing_package()))
def test_a_mod_with_every_op_compiles_into_fa4_for_sm90(tmp_path):
    """The generated hooks of `all_ops` compile into FA4's sm_90a forward and backward (no GPU
    needed: flexfa's offline compile, in a fresh process)."""
    from tests.codegen.cute.test_compile import MMA, export, kernel

    got = export(tmp_path, "sm_90a", f"{__file__}:all_ops", "causal")
    assert "cute.math.erf(" in got["mods"] and " << " in got["mods"] and " >> " in got["mods"]
    for which in ("flash_fwd", "flash_bwd_sm"):
        assert MMA["sm_90a"] in kernel(got["ptx"], which)
    # erf expanded in place into MLIR's rational approximation (Note [erf in generated CuTe
    # source]): 2/sqrt(pi) - 1 in float32 is one of its coefficients.
    assert "0f3E0375D4" in kernel(got["ptx"], "flash_fwd")
