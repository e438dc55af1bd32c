"""Interned, immutable nodes; topological order; structural digests stable across processes."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from flexfa.ir import Capture, DType, Op
from flexfa.ir import build as irb
from flexfa.ir.nodes import digest_of, toposort

q, kv, s = irb.var("q_idx"), irb.var("kv_idx"), irb.var("score")


def test_building_twice_gives_the_same_object():
    assert irb.sub(q, kv) is irb.sub(q, kv)
    assert irb.add(s, irb.const(1.5)) is irb.add(s, irb.const(1.5))
    assert irb.sub(q, kv) is not irb.sub(kv, q)


def test_interning_distinguishes_types_and_constant_bits():
    assert irb.const(1) is not irb.const(True)  # int 1 and bool True are different constants
    assert irb.const(1) is not irb.const(1, DType.INT64)
    assert irb.const(1.0) is not irb.const(1)
    assert irb.const(0.0) is not irb.const(-0.0)  # distinct bits, distinct nodes
    assert irb.const(float("nan")) is irb.const(float("nan"))


def test_captures_intern_by_value():
    a = irb.capture(Capture(0, "t", DType.FLOAT32, 1))
    assert a is irb.capture(Capture(0, "t", DType.FLOAT32, 1))
    assert a is not irb.capture(Capture(0, "t", DType.FLOAT16, 1))
    with pytest.raises(ValueError):
        Capture(-1, "t", DType.FLOAT32, 1)


def test_nodes_are_immutable():
    node = irb.add(s, s)
    with pytest.raises(AttributeError, match="immutable"):
        node.op = Op.SUB
    with pytest.raises(AttributeError):
        node.srcs = ()


def test_nodes_are_dict_keys_and_pickle_to_themselves():
    node = irb.mul(irb.sub(q, kv), irb.const(2))
    assert {node: 1}[irb.mul(irb.sub(q, kv), irb.const(2))] == 1
    assert pickle.loads(pickle.dumps(node)) is node


def test_toposort_puts_sources_first_and_shares_subexpressions():
    d = irb.sub(q, kv)
    root = irb.add(irb.mul(d, d), d)
    order = toposort([root])
    position = {id(n): i for i, n in enumerate(order)}
    for n in order:
        assert all(position[id(src)] < position[id(n)] for src in n.srcs)
    assert sum(n is d for n in order) == 1
    assert order[-1] is root


def test_digest_is_structural():
    a = irb.add(s, irb.const(0.5))
    assert a.digest == irb.add(s, irb.const(0.5)).digest
    assert a.digest != irb.add(s, irb.const(0.25)).digest
    assert a.digest != irb.sub(s, irb.const(0.5)).digest
    assert digest_of([a, s]) != digest_of([s, a])  # the roots' order is part of it
    named = [irb.capture(Capture(0, name, DType.FLOAT32, 0)) for name in ("x", "y")]
    assert named[0].digest != named[1].digest  # names appear in generated code


_DIGEST_SCRIPT = textwrap.dedent(
    """
    import torch
    import flexfa
    from flexfa.frontend import trace_score_mod, trace_mask_mod
    table = torch.zeros(4, 17)
    mod = trace_score_mod(flexfa.mods.relative_bias(table))
    mask = trace_mask_mod(flexfa.masks.and_masks(flexfa.masks.causal, flexfa.masks.chunked(64)))
    print(mod.output.digest, mask.output.digest, mod.key)
    """
)


def test_digest_is_stable_across_processes():
    """Digests key on-disk caches: they must not depend on hash seeds or object addresses."""
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run(
        [sys.executable, "-c", _DIGEST_SCRIPT], capture_output=True, text=True, env=env, check=True
    )
    namespace: dict = {}
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        exec(_DIGEST_SCRIPT, namespace)
    assert result.stdout.split() == buffer.getvalue().split()
    assert len(result.stdout.split()[0]) == 64
