"""The trace cache (Note [Trace cache] in flexfa/frontend/cache.py): reuse exactly when safe."""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa.frontend import trace_mask_mod, trace_score_mod
from flexfa.frontend.cache import Uncacheable, fingerprint, traces


def test_same_factory_and_values_share_a_trace():
    misses = traces.misses
    a = trace_score_mod(flexfa.mods.softcap(30.0))
    b = trace_score_mod(flexfa.mods.softcap(30.0))
    assert a is b
    c = trace_score_mod(flexfa.mods.softcap(20.0))
    # A new value of a lifted float reuses the trace (Note [Lifted scalars]).
    assert c is not a and c.output is a.output and c.scalar_values == (20.0,)
    assert traces.misses <= misses + 1


def test_lifted_floats_of_defaults_and_partials_reuse_one_trace():
    import functools

    lambdas = [lambda s, b, h, q, kv, c=c: s + c * 0.01 * (kv - q) for c in (1.0, 2.0, 3.0)]
    misses = traces.misses
    traced = [trace_score_mod(m) for m in lambdas]
    assert traces.misses == misses + 1
    assert len({t.key for t in traced}) == 1
    assert [t.scalar_values for t in traced] == [(1.0,), (2.0,), (3.0,)]

    def scaled(score, b, h, q_idx, kv_idx, factor):
        return score * factor

    p1, p2 = (trace_score_mod(functools.partial(scaled, factor=f)) for f in (0.5, 0.25))
    assert p1.output is p2.output and p2.scalar_values == (0.25,)


def test_a_new_captured_tensor_is_a_new_trace_bound_to_it():
    t1 = torch.randn(4)
    t2 = torch.randn(4)

    def make(t):
        def bias(score, b, h, q_idx, kv_idx):
            return score + t[h]

        return bias

    first = trace_score_mod(make(t1))
    assert trace_score_mod(make(t1)) is first
    second = trace_score_mod(make(t2))
    assert second.tensors[0] is t2 and first.tensors[0] is t1
    # Same IR, so the same compiled kernels.
    assert second.key == first.key


def test_in_place_updates_keep_the_trace():
    ids = torch.zeros(64, dtype=torch.int32)
    mask = flexfa.masks.document(ids)
    first = trace_mask_mod(mask)
    ids[10:] = 1
    assert trace_mask_mod(mask) is first  # values are bound at run time, not traced


def test_rebinding_a_global_retraces():
    namespace: dict = {"torch": torch, "SCALE": 2.0}
    exec(
        "def scaled(score, b, h, q_idx, kv_idx):\n    return score * SCALE\n",
        namespace,
    )
    scaled = namespace["scaled"]
    first = trace_score_mod(scaled)
    namespace["SCALE"] = 3.0
    second = trace_score_mod(scaled)
    assert second is not first
    assert "3.0" in second.format() and "2.0" in first.format()


def test_unknown_objects_make_a_mod_uncacheable_but_still_traceable():
    class Holder:
        def __init__(self):
            self.scale = 2.0

        def __eq__(self, other):  # an object the fingerprint cannot see into
            return False

        __hash__ = None

    holder = [Holder()]

    def uses_object(score, b, h, q_idx, kv_idx):
        return score * holder[0].scale

    try:
        fingerprint(uses_object)
        raise AssertionError("expected Uncacheable")
    except Uncacheable:
        pass
    before = traces.uncacheable
    first = trace_score_mod(uses_object)
    holder[0].scale = 5.0
    second = trace_score_mod(uses_object)
    assert "5.0" in second.format() and "2.0" in first.format()
    assert traces.uncacheable == before + 2


def test_heads_bound_mods_are_reused():
    assert flexfa.mods.alibi.bind(8) is flexfa.mods.alibi.bind(8)
    assert trace_score_mod(flexfa.mods.alibi.bind(8)) is trace_score_mod(flexfa.mods.alibi.bind(8))


def test_a_module_mod_is_cached_by_its_parameters():
    class Bias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.zeros(4))

        def forward(self, score, b, h, q_idx, kv_idx):
            return score + self.table[h]

    bias = Bias()
    first = trace_score_mod(bias)
    assert trace_score_mod(bias) is first and first.tensors[0] is bias.table
    bias.table = torch.nn.Parameter(torch.zeros(4))  # a new parameter: traced again, bound to it
    assert trace_score_mod(bias).tensors[0] is bias.table


def test_rebound_keeps_what_the_ir_decides_and_binds_the_rest() -> None:
    """`TracedMod.rebound` gives the same key and variables as a fresh computation (it carries
    them over instead of walking the IR again), with the new tensors, and changes nothing else."""
    import dataclasses

    table = torch.randn(8)
    traced = trace_score_mod(lambda s, b, h, q, kv: s + table[q % 8])
    key, variables = traced.key, traced.variables  # computed and cached on `traced`
    other = torch.randn(8)
    new = traced.rebound(tensors=(other,))
    assert new.tensors[0] is other and traced.tensors[0] is table
    fresh = dataclasses.replace(traced, tensors=(other,))  # nothing cached on it
    assert new.key == fresh.key == key and new.variables == fresh.variables == variables
    with pytest.raises(TypeError, match="rebound changes only"):
        traced.rebound(output=traced.output)
