"""docs/semantics.md lists every name the tracer takes; this test keeps the list and the tracer in
step, and checks that every listed name really traces."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from flexfa.frontend import ModTraceError, trace_score_mod
from flexfa.frontend.optable import TRACEABLE_NAMES
from flexfa.frontend.vector import SCALAR_SHAPE_METHODS, VECTOR_METHODS

DOC = Path(__file__).resolve().parents[2] / "docs" / "semantics.md"


def _listed(tag: str) -> set[str]:
    text = DOC.read_text()
    match = re.search(rf"<!-- {tag}:begin -->\s*```text\n(.*?)```\s*<!-- {tag}:end -->", text, re.S)
    assert match, f"docs/semantics.md has no {tag} block"
    return set(match.group(1).split())


def test_doc_lists_exactly_the_traceable_names():
    listed = _listed("traceable-names")
    assert listed - TRACEABLE_NAMES == set(), "listed in docs/semantics.md but not traceable"
    assert TRACEABLE_NAMES - listed == set(), "traceable but missing from docs/semantics.md"
    vector = _listed("vector-names")
    assert vector == {n for n in VECTOR_METHODS if not n.startswith("_")}
    assert _listed("scalar-shape-names") == SCALAR_SHAPE_METHODS


TABLE = torch.randn(8, 3)


def _call(name: str, x, y):
    """`name` applied to traced values, as a function, a method or a torch.nn.functional one."""
    for owner in (torch, torch.special, torch.nn.functional):
        fn = getattr(owner, name.removeprefix("special_"), None)
        if fn is not None and callable(fn):
            break
    else:
        fn = None
    if name in ("where",):
        return torch.where(x > 0, x, y)
    if name in ("to", "type"):
        return getattr(x, name)(torch.float32)
    if name == "type_as":
        return x.type_as(torch.zeros(()))
    if name in ("full_like", "new_full"):
        return getattr(torch, name)(x, 2.0) if name == "full_like" else x.new_full((), 2.0)
    if name.startswith("new_"):
        return getattr(x, name)(())
    for args in ((x,), (x, y)):
        for f in (fn, lambda *a: getattr(a[0], name)(*a[1:])):
            if f is None:
                continue
            try:
                return f(*args)
            except ModTraceError as e:
                if "cannot be traced" in str(e):
                    raise
            except (TypeError, AttributeError, RuntimeError):
                continue
    raise AssertionError(f"could not call {name!r}")


@pytest.mark.parametrize("name", sorted(TRACEABLE_NAMES))
def test_every_listed_name_traces(name):
    def score_mod(score, b, h, q_idx, kv_idx):
        if "shift" in name:
            x, y = q_idx, kv_idx % 3
        elif "logical" in name or "bitwise" in name:
            x, y = q_idx > 2, kv_idx > 1
        else:
            x, y = (score + q_idx).abs() + 0.5, score * 0.5 + 1.0
        out = _call(name, x, y)
        return score + out.to(torch.float32)

    trace_score_mod(score_mod)


@pytest.mark.parametrize(
    "name", ["sum", "mean", "prod", "any", "all", "amax", "amin", "max", "min"]
)
def test_every_listed_reduction_traces(name):
    def score_mod(score, b, h, q_idx, kv_idx):
        r = getattr(TABLE[q_idx] > 0 if name in ("any", "all") else TABLE[q_idx], name)(-1)
        r = r.values if name in ("max", "min") else r
        return score + r.to(torch.float32)

    trace_score_mod(score_mod)


_SHAPE_ARGS = {"unsqueeze": (-1,), "view": (1, 1), "reshape": ((-1,),)}


@pytest.mark.parametrize("name", sorted(SCALAR_SHAPE_METHODS))
def test_every_scalar_shape_method_traces(name):
    """Note [Shape operations on traced values]: a traced scalar takes these as a 0-d tensor,
    as a method and as a torch function; the result (one element) is used as a scalar."""
    for call in ("method", "function") if hasattr(torch, name) else ("method",):

        def score_mod(score, b, h, q_idx, kv_idx, call=call):
            x = score * 0.5 if name == "mean" else score
            args = _SHAPE_ARGS.get(name, ())
            fn = getattr(x, name) if call == "method" else lambda *a: getattr(torch, name)(x, *a)
            r = fn(*args)
            return score + (r if name != "numel" else float(r))

        trace_score_mod(score_mod)
