"""Note [Direct FA4 launches]: FA4's compiled forward called by flexfa itself, checked on the CPU
against a stand-in of FA4's entry point with its structure: a compile cache (wrapped as
`jitcache.install` wraps FA4's), a compiled function given detached tensors, block lists
broadcast over heads and the aux scalars in an AuxData."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from flexfa.codegen.cute import direct, jitcache
from flexfa.config import config


class AuxData(NamedTuple):  # FA4's, in flash_attn/cute/utils.py
    tensors: tuple | None = None
    scalars: tuple | None = None


def _kernel(q, out, lse, scale, aux, lists, flag):
    """The 'compiled kernel': writes what the test can check from every argument."""
    out.copy_(q * scale + aux.scalars[0] + lists[0].sum() + (1 if flag else 0))
    lse.copy_(q.sum(-1))


class _FakeFA4:
    """FA4's `_flash_attn_fwd` reduced to its structure."""

    def __init__(self, own_tensor: bool = False):
        self.entries = 0
        self.own_tensor = own_tensor
        self.compile_cache = jitcache._Routed({}, None)

    def forward(self, t: dict, scalars: tuple, scale: float, flag: bool = True) -> None:
        self.entries += 1
        key = (t["q"].shape, t["q"].dtype, flag)
        if key not in self.compile_cache:
            self.compile_cache[key] = _kernel
        lists = (t["cnt"].expand(2, *t["cnt"].shape[1:]),)  # broadcast over heads
        if self.own_tensor:
            lists = (torch.zeros(2, 3),)
        self.compile_cache[key](
            t["q"].detach(), t["out"], t["lse"], scale, AuxData(None, scalars), lists, flag=flag
        )  # a keyword argument too


def _call(fa4: _FakeFA4, step: int, rows: int = 3) -> tuple[dict, tuple]:
    q = torch.randn(2, rows, 4)
    tensors = {
        "q": q,
        "k": torch.randn(2, rows, 4),
        "v": torch.randn(2, rows, 4),
        "out": torch.empty(2, rows, 4),
        "lse": torch.empty(2, rows),
        "cnt": torch.full((1, 3), float(step)),
    }
    scalars = (float(step),)
    direct.launch(tensors, scalars, lambda: fa4.forward(tensors, scalars, 0.5), extra=(0.5,))
    return tensors, scalars


def _expected(tensors: dict, scalars: tuple) -> torch.Tensor:
    return tensors["q"] * 0.5 + scalars[0] + 2 * tensors["cnt"].sum() + 1


@pytest.fixture(autouse=True)
def _fresh():
    direct.reset()
    yield
    direct.reset()


def test_forward_is_replayed_from_the_third_call_of_a_signature():
    fa4 = _FakeFA4()
    for step in range(6):
        tensors, scalars = _call(fa4, step)
        assert torch.equal(tensors["out"], _expected(tensors, scalars)), step
        assert torch.equal(tensors["lse"], tensors["q"].sum(-1)), step
    # Two recorded calls through FA4's entry point, then the compiled function alone, given the
    # new tensors, the new scalars and the lists broadcast again.
    assert fa4.entries == 2
    assert direct.counts == {"fa4": 2, "direct": 4}


def test_a_new_signature_is_recorded_again():
    fa4 = _FakeFA4()
    for step in range(3):
        _call(fa4, step)
    tensors, scalars = _call(fa4, 3, rows=5)  # other sizes: FA4's entry point again
    assert torch.equal(tensors["out"], _expected(tensors, scalars))
    assert fa4.entries == 3


def test_a_tensor_fa4_made_itself_keeps_every_call_on_its_entry_point():
    fa4 = _FakeFA4(own_tensor=True)
    for step in range(4):
        tensors, scalars = _call(fa4, step)
        assert torch.equal(tensors["out"], tensors["q"] * 0.5 + step + 1)
    assert fa4.entries == 4 and direct.counts == {"fa4": 4}
    assert "a tensor of its own" in direct.why_not(tensors, scalars, (0.5,))


def test_calls_that_differ_for_one_signature_are_not_replayed():
    """FA4 making other calls for the same signature (here: a constant that follows the step)
    keeps the signature on FA4's entry point."""
    fa4 = _FakeFA4()
    for step in range(4):
        q = torch.randn(2, 3, 4)
        t = {"q": q, "k": q, "v": q, "out": torch.empty(2, 3, 4), "lse": torch.empty(2, 3),
             "cnt": torch.zeros(1, 3)}  # fmt: skip
        direct.launch(t, (0.0,), lambda t=t, s=step: fa4.forward(t, (0.0,), 0.5, s % 2 == 0), ())
        assert torch.equal(t["out"], q * 0.5 + (1 if step % 2 == 0 else 0))
    assert fa4.entries == 4
    assert direct.why_not(t, (0.0,), ()) == "FA4 made other calls for the same signature"


def test_turned_off_every_call_goes_through_fa4():
    fa4 = _FakeFA4()
    with config.override(fa4_direct=False):
        for step in range(3):
            _call(fa4, step)
    assert fa4.entries == 3 and direct.counts == {"fa4": 3}


def test_recording_is_empty_outside_and_sees_calls_inside():
    cache = jitcache._Routed({"k": _kernel}, None)
    assert cache["k"] is _kernel
    with jitcache.recording() as calls:
        fn = cache["k"]
        q, out, lse = torch.ones(1, 2), torch.empty(1, 2), torch.empty(1)
        fn(q, out, lse, 1.0, AuxData(None, (0.0,)), (torch.zeros(1),), False)
    assert len(calls) == 1 and calls[0][0] is _kernel and calls[0][1][0] is q
    assert cache["k"] is _kernel
