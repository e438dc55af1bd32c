"""`DirectLaunch` (Note [Direct launches]): which calls reuse a compiled kernel and which go back
through the JIT function. Triton's objects are stood in for by fakes that record calls, so this
runs on a CPU without the interpreter's slow path."""

from __future__ import annotations

import pytest
import torch

from flexfa.config import config
from flexfa.runtime import launch as launch_mod
from flexfa.runtime.launch import DirectLaunch


class FakeCompiled:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", self.name, grid, args))


class FakeJit:
    """Compiles (returns a new FakeCompiled) for every specialization Triton would tell apart."""

    arg_names = ("X", "n", "scale", "BLOCK", "EVEN")

    def __init__(self):
        self.log: list = []
        self.compiled: dict = {}

    def __getitem__(self, grid):
        def run(*args, num_warps, num_stages, **constexprs):
            x, n, _ = args
            spec = (x.dtype, x.data_ptr() % 16 == 0, n % 16 == 0, n == 1)
            kernel = self.compiled.setdefault(
                spec, FakeCompiled(self.log, f"k{len(self.compiled)}")
            )
            self.log.append(("jit", kernel.name, grid, args, constexprs))
            return kernel

        return run


@pytest.fixture
def compiled_mode(monkeypatch):
    monkeypatch.setattr(launch_mod.torch.cuda, "current_device", lambda: 0)
    with config.override(triton_interpret=False):
        yield


def test_second_call_with_the_same_fingerprint_skips_the_jit(compiled_mode):
    jit = FakeJit()
    dl = DirectLaunch(jit, {"BLOCK": 64, "EVEN": True}, num_warps=4, num_stages=2)
    x = torch.zeros(64)
    dl((2, 1, 1), [x, 32, 0.5])
    dl((2, 1, 1), [x, 32, 0.5])
    dl((3, 1, 1), [x, 32, 0.25])  # another grid and float value: same kernel
    assert [e[0] for e in jit.log] == ["jit", "direct", "direct"]
    # The direct call passes every argument, constexprs last in declaration order.
    assert jit.log[1] == ("direct", "k0", (2, 1, 1), (x, 32, 0.5, 64, True))
    assert jit.log[2][2] == (3, 1, 1) and jit.log[2][3][2] == 0.25


def test_a_new_specialization_goes_through_the_jit(compiled_mode):
    jit = FakeJit()
    dl = DirectLaunch(jit, {"BLOCK": 64, "EVEN": True}, num_warps=4, num_stages=2)
    x = torch.zeros(64)
    for args in ([x, 32, 0.5], [x, 32, 0.5]):
        dl((1,), args)
    before = len(jit.log)
    dl((1,), [x, 33, 0.5])  # an integer Triton may specialize differently
    dl((1,), [x[1:], 32, 0.5])  # an address not 16-byte aligned
    dl((1,), [x.to(torch.float64), 32, 0.5])  # another dtype
    kinds = [(e[0], e[1]) for e in jit.log[before:]]
    assert kinds == [("jit", "k1"), ("jit", "k2"), ("jit", "k3")], kinds


def test_constexprs_not_last_or_interpreter_always_use_the_jit(compiled_mode):
    jit = FakeJit()
    dl = DirectLaunch(jit, {"n": 3}, num_warps=4, num_stages=2)  # "n" is not at the end
    x = torch.zeros(16)
    for _ in range(3):
        dl((1,), [x, 32, 0.5])
    assert [e[0] for e in jit.log] == ["jit"] * 3
    jit2 = FakeJit()
    dl2 = DirectLaunch(jit2, {"BLOCK": 64, "EVEN": True}, num_warps=4, num_stages=2)
    with config.override(triton_interpret=True):
        for _ in range(3):
            dl2((1,), [x, 32, 0.5])
    assert [e[0] for e in jit2.log] == ["jit"] * 3


def test_launch_goes_direct_after_the_first_launch(compiled_mode):
    """`launch` (every Triton launch of the attention kernels) logs and runs the first launch of a
    specialization through the JIT function, and later ones through a cached DirectLaunch."""
    from flexfa.codegen.triton.params import KernelKey
    from flexfa.runtime.launch import KernelLaunch

    jit = FakeJit()
    key = KernelKey(None, "k", "bf16", 64, 64, None, (("BLOCK", 64), ("EVEN", True)))
    x = torch.zeros(64)

    def kl(n):
        return KernelLaunch(
            "k", jit, (2, 1), (x, n, 0.5), {"BLOCK": 64, "EVEN": True}, 4, 2, key, "k"
        )

    try:
        for n in (32, 32, 32, 33):
            launch_mod.launch(kl(n))
        # 1st: logged JIT launch; 2nd: the DirectLaunch's first (JIT) call; 3rd: direct;
        # 4th: an integer Triton specializes differently, so Triton's path again.
        assert [e[0] for e in jit.log] == ["jit", "jit", "direct", "jit"], jit.log
    finally:
        fast = launch_mod._fast_key(kl(32))
        launch_mod._launched.discard(fast)
        launch_mod._direct.pop(fast, None)


def test_turned_off_every_call_goes_through_the_jit(compiled_mode):
    jit = FakeJit()
    with config.override(direct_launch=False):
        dl = DirectLaunch(jit, {"BLOCK": 64, "EVEN": True}, num_warps=4, num_stages=2)
    x = torch.zeros(64)
    for _ in range(3):
        dl((1,), [x, 32, 0.5])
    assert [e[0] for e in jit.log] == ["jit"] * 3


def test_a_new_length_of_a_known_specialization_stays_direct(compiled_mode):
    """A length that changes every call (a growing KV cache) finds the kernel of its
    specialization class without Triton's path, and the fingerprints kept stay bounded."""
    jit = FakeJit()
    dl = DirectLaunch(jit, {"BLOCK": 64, "EVEN": True}, num_warps=4, num_stages=2)
    x = torch.zeros(64)
    dl((1,), [x, 32, 0.5])
    for n in range(48, 48 + 16 * 200, 16):  # divisible by 16, like 32
        dl((1,), [x, n, 0.5])
    assert [e[0] for e in jit.log] == ["jit"] + ["direct"] * 200
    assert {e[3][1] for e in jit.log[1:]} == set(range(48, 48 + 16 * 200, 16))
    assert len(dl._compiled) <= launch_mod._FINGERPRINTS_KEPT
    dl((1,), [x, 1, 0.5])  # 1 is a constant to Triton
    dl((1,), [x, 1 << 31, 0.5])  # past int32
    dl((1,), [x, 49, 0.5])  # another residue mod 16: the class of 33
    assert [e[0] for e in jit.log[-3:]] == ["jit"] * 3


def test_launch_default_goes_direct_after_its_first_launch(compiled_mode):
    """`launch_default` (the packing kernels): Triton's default options, so no num_warps or
    num_stages is passed, and direct launches after the first of its key."""
    jit = FakeJit()
    seen = []

    def run(*args, **kw):
        seen.append(sorted(kw))
        return FakeJit.__getitem__(jit, None)(*args, num_warps=None, num_stages=None, **kw)

    class NoOptions(FakeJit):
        def __getitem__(self, grid):
            return run

    k = NoOptions()
    x = torch.zeros(64)
    fast = ("packing-test", id(k))
    try:
        for n in (32, 64, 96):
            launch_mod.launch_default(fast, "t", k, (2,), (x, n, 0.5), {"BLOCK": 64, "EVEN": True})
        assert [e[0] for e in jit.log] == ["jit", "jit", "direct"], jit.log
        assert seen == [["BLOCK", "EVEN"], ["BLOCK", "EVEN"]]
    finally:
        launch_mod._launched.discard(fast)
        launch_mod._direct.pop((id(k), ("BLOCK", 64), ("EVEN", True)), None)


def test_try_call_launches_only_a_known_specialization(compiled_mode):
    """`try_call` (the packing kernels' hot path) launches nothing for a specialization it has not
    launched, and launches directly one it has, whatever the lengths within its class."""
    jit = FakeJit()
    dl = DirectLaunch(jit, {"BLOCK": 64, "EVEN": True}, num_warps=4, num_stages=2)
    x = torch.zeros(64)
    assert not dl.try_call((1,), [x, 32, 0.5]) and jit.log == []
    dl((1,), [x, 32, 0.5])  # through the JIT function
    assert dl.try_call((4,), [x, 4096, 0.5])
    assert not dl.try_call((4,), [x, 33, 0.5])  # another class
    assert [e[0] for e in jit.log] == ["jit", "direct"] and jit.log[1][3][1] == 4096
    with config.override(triton_interpret=True):
        assert not dl.try_call((4,), [x, 32, 0.5])


def test_try_call_with_new_ints_looks_up_the_specialization_alone(compiled_mode):
    """`try_call(..., new_ints=True)` (a packed batch's lengths, new at every call) launches a
    known specialization without computing or keeping argument fingerprints, and still launches
    nothing for an unknown one."""
    jit = FakeJit()
    dl = DirectLaunch(jit, {"BLOCK": 64, "EVEN": True}, num_warps=4, num_stages=2)
    x = torch.zeros(64)
    assert not dl.try_call((1,), [x, 48, 0.5], new_ints=True) and jit.log == []
    dl((1,), [x, 32, 0.5])  # through the JIT function: one fingerprint kept
    kept = dict(dl._compiled)
    for n in (4096, 160, 8192):
        assert dl.try_call((2,), [x, n, 0.5], new_ints=True)
    assert not dl.try_call((2,), [x, 33, 0.5], new_ints=True)  # another class
    assert dl._compiled == kept
    assert [e[0] for e in jit.log] == ["jit", "direct", "direct", "direct"]
    assert [e[3][1] for e in jit.log[1:]] == [4096, 160, 8192]
