"""The generated CuTe DSL hooks: golden snapshots of whole modules, and what the emitter decides
(where captured tensors sit in aux_scalars, guarded loads, the gradient scatter, where constants
come from)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import flexfa
from flexfa.codegen.cute import emit
from flexfa.codegen.cute import module as cmodule
from flexfa.frontend import trace_mask_mod, trace_score_mod
from flexfa.ir.dtypes import DType
from tests.codegen import common

GOLDEN = Path(__file__).parent / "golden"


def _golden_cases():
    return common.golden_cases(prefix_lm=flexfa.masks.prefix_lm(100))


def _render(score_mod, mask_mod) -> str:
    score = trace_score_mod(score_mod)
    mask = trace_mask_mod(mask_mod)
    return cmodule.render(score, mask, score.grad_slots()).source


@pytest.mark.parametrize("name", sorted(_golden_cases()))
def test_golden_generated_source(name):
    """The generated module, byte for byte. After an intended change, regenerate with
    FLEXFA_UPDATE_GOLDEN=1 pytest tests/codegen/cute -k golden, and review the diff."""
    src = _render(*_golden_cases()[name])
    common.check_golden(src, GOLDEN / f"{name}.py.txt", name)


def test_generated_module_is_valid_python_with_fa4_signatures():
    src = _render(*_golden_cases()["relative_bias_prefix_lm"])
    tree = ast.parse(src)  # parses
    params = {
        f.name: [a.arg for a in f.args.args] for f in tree.body if isinstance(f, ast.FunctionDef)
    }
    hook = ["b_idx", "h_idx", "q_idx", "kv_idx", "seqlen_info", "aux_tensors", "aux_scalars"]
    assert params["score_mod_relative_bias"] == ["score_ssa", *hook]
    assert params["score_mod_bwd_relative_bias"] == ["grad_ssa", "score_ssa", *hook]
    assert params["mask_mod_prefix_lm"] == hook
    assert "SCORE_MOD = score_mod_relative_bias" in src
    assert "MASK_MOD = mask_mod_prefix_lm" in src


def test_aux_layout_orders_scalars_then_score_then_mask_then_gradients():
    """Note [Captured tensors by address]: lifted floats first, then each tensor's address and
    sizes - score_mod captures, mask_mod captures, gradient buffers."""
    a = torch.zeros(4, 3, requires_grad=True)
    c = torch.tensor(2.0)

    def two(score, b, h, q_idx, kv_idx, w=0.5):
        return score * a[h, 1] * w + c

    ids = torch.zeros(16, dtype=torch.bool)
    score = trace_score_mod(two)
    mask = trace_mask_mod(lambda b, h, q_idx, kv_idx: ids[q_idx] & ids[kv_idx])
    layout = emit.AuxLayout.of(score, mask, score.grad_slots())
    assert layout.lifted == 1 and layout.grad_slots == (0,)
    assert (layout.score_capture(1), layout.mask_capture(0), layout.grad_buffer(0)) == (1, 2, 3)
    assert layout.tensors == (
        (DType.FLOAT32, 2), (DType.FLOAT32, 1), (DType.BOOL, 1), (DType.FLOAT32, 2),
    )  # fmt: skip
    # w | a: address, 2 sizes | c: address, 1 size | ids | gradient of a
    assert [layout.address(p) for p in range(4)] == [1, 4, 6, 8]
    assert (layout.size(0, 1), layout.size(3, 1), layout.num_scalars) == (3, 10, 11)
    rendered = cmodule.render(score, mask, score.grad_slots())
    bwd = rendered.score_mod_bwd.source
    # d out / d a[h, 1] = score * w, scattered into the gradient buffer at position 3; no
    # scatter for c (it does not require grad).
    grad_view = "view3 = flexfa_view(cutlass.Float32, 4, aux_scalars[8], (aux_scalars[9], "
    assert grad_view + "aux_scalars[10]), (aux_scalars[10], 1))" in bwd
    assert "flexfa_atomic_add_uniform(acc0, view3, (h, cutlass.Int32(1)))" in bwd
    assert bwd.count("flexfa_atomic_add") == 1
    mask_src = rendered.mask_mod.source
    assert "view2 = flexfa_view(cutlass.Uint8, 1, aux_scalars[6], (aux_scalars[7],), (1,))" in (
        mask_src
    )
    assert "(view2[flexfa_clamp(q, view2.shape[0])] != 0)" in mask_src
    # A 0-d capture is read as element 0 of a one-element view.
    assert "view1[cutlass.Int32(0)].to(cutlass.Float32)" in rendered.score_mod.source


def test_loads_are_guarded_and_clamped():
    table = torch.zeros(8)

    def shifted(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx]

    traced = trace_score_mod(shifted)
    src = emit.emit_mod(traced, "f", emit.AuxLayout.of(traced, None, frozenset())).source
    # q - kv may be negative: both bounds are checked, and the read index is clamped into range.
    assert "(t0 >= 0) & (t0 < view0.shape[0])" in src
    assert "view0[flexfa_clamp(t0, view0.shape[0])]" in src


def test_backward_comes_from_autodiff():
    src = emit.emit_score_mod_bwd(
        trace_score_mod(flexfa.mods.softcap(20.0)),
        trace_score_mod(flexfa.mods.softcap(20.0)).gradient(),
        "g",
        emit.AuxLayout(1, (), (), ()),
    ).source
    # d/ds 20 tanh(s / 20) = 1 - tanh(s / 20)**2: the body recomputes tanh and multiplies grad.
    assert "cute.math.tanh(" in src
    assert "result[i] = grad * t" in src


class _Marked(emit.Constants):
    def literal(self, node):
        return "LITERAL" if node.dtype.is_float else super().literal(node)


def test_every_constant_comes_from_constants():
    """Note [Constants in generated CuTe source]: one place prints constants; lifted floats are
    read from FA4's run-time aux_scalars, never printed."""
    traced = trace_score_mod(flexfa.mods.softcap(30.0))
    src = emit.emit_mod(traced, "f", emit.AuxLayout(1, (), (), ()), _Marked()).source
    assert "aux_scalars[0]" in src and "30.0" not in src
    fixed = trace_score_mod(lambda s, b, h, q, kv: s * 0.5 + 1.0)  # constants of the mod's code
    src = emit.emit_mod(fixed, "g", emit.AuxLayout(0, (), (), ()), _Marked()).source
    assert "LITERAL" in src and "0.5" not in src and "aux_scalars[" not in src


def _bwd_source(score_mod) -> str:
    traced = trace_score_mod(score_mod)
    return cmodule.render(traced, None, traced.grad_slots()).score_mod_bwd.source


def test_gradient_of_an_index_reading_only_h_is_summed_per_call():
    """Note [Captured gradients in the FA4 backward]: slopes[h] is one element for the whole hook
    call and warp, so the call sums its elements in a register and the warp adds once, after the
    element loop."""
    slopes = torch.rand(4, requires_grad=True)

    def learned_alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    src = _bwd_source(learned_alibi)
    assert "    acc0 = cutlass.Float32(0.0)\n    for i in cutlass.range_constexpr(n):" in src
    assert "        c0 = flexfa_select((h < view1.shape[0]), (grad * t1).to(cutlass.Float32)" in src
    assert "        acc0 = acc0 + c0\n" in src
    assert "        result[i] = grad\n    flexfa_atomic_add_uniform(acc0, view1, h)\n" in src
    assert "flexfa_atomic_add_warp" not in src


def test_gradient_of_an_index_reading_q_or_kv_is_aggregated_per_warp_at_run_time():
    """Note [Captured gradients in the FA4 backward]: a clamped distance may or may not be the
    same across a call's elements and a warp's lanes; the call keeps each element's value and
    offset, and `flexfa_atomic_add_warp` decides at run time."""
    table = torch.zeros(4, 257, requires_grad=True)
    src = _bwd_source(flexfa.mods.relative_bias(table, 128))
    assert "    values0 = cute.make_rmem_tensor(n, cutlass.Float32)\n" in src
    assert "    offsets0 = cute.make_rmem_tensor(n, cutlass.Int32)\n" in src
    guard = "(h < view1.shape[0]) & (t3 < view1.shape[1]) & (t3 >= 0)"
    assert f"        values0[i] = flexfa_select({guard}, (grad).to(cutlass.Float32)" in src
    assert "        offsets0[i] = cute.crd2idx((h, t3), view1.layout)\n" in src
    assert "    flexfa_atomic_add_warp(values0, offsets0, view1)\n    return result.load()" in src
    assert "flexfa_atomic_add_uniform" not in src


def test_which_indices_are_warp_uniform():
    """Indices reading b, h, constants or loads so indexed are one element per warp; any read of q_idx, kv_idx or score (directly or through a load) is not."""
    perm = torch.tensor([2, 0, 3, 1])
    temp = torch.tensor(0.5, requires_grad=True)
    table = torch.zeros(4, 8, requires_grad=True)
    doc = torch.zeros(64, dtype=torch.int32)

    def mod(score, b, h, q_idx, kv_idx, shift=1):
        return (
            score * temp  # 0-d: index 0
            + table[perm[h], b + shift]  # a load indexed by h; b and a constant
            + table[h, doc[q_idx]]  # a load indexed by q_idx
            + table[h, (score > 0).to(torch.int64)]  # an index reading the score
        )

    traced = trace_score_mod(mod)
    loads = traced.gradient(traced.grad_slots()).loads
    uniform = [emit.warp_uniform_index(g.load) for g in loads]
    assert sorted(uniform) == [False, False, True, True], uniform
    src = _bwd_source(mod)
    assert src.count("flexfa_atomic_add_uniform(") == 2
    assert src.count("flexfa_atomic_add_warp(") == 2
