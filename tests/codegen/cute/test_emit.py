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
    assert "flexfa_atomic_add(c0, view3, (h, cutlass.Int32(1)))" in bwd
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
