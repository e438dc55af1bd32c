"""Note [Concurrent compiles]: the kernels of a cold backward are compiled at the same time."""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import pytest

import flexfa
from flexfa.codegen.triton.params import FwdConfig, KernelKey, ModuleKey
from flexfa.runtime import launch as tlaunch

_alive: list = []


class _Kernel:
    """Stands for a JIT function: `warmup` waits until every kernel of the list is compiling."""

    def __init__(self, barrier: threading.Barrier, fail: bool = False) -> None:
        _alive.append(self)  # launch keys hold id(kernel): no id may be reused by a later one
        self.barrier = barrier
        self.fail = fail
        self.warmed = []

    def warmup(self, *args, grid, num_warps, num_stages, **constexprs):
        self.barrier.wait(timeout=10)  # raises BrokenBarrierError if compiles ran one by one
        self.warmed.append((args, grid, constexprs))
        if self.fail:
            raise RuntimeError("compile failed")


def _launch(kernel, name: str) -> tlaunch.KernelLaunch:
    key = KernelKey(
        module=ModuleKey(None, None, (), "t", "v", "v", "v"),
        kernel=name,
        dtype="float16",
        head_dim=64,
        head_dim_v=64,
        config=FwdConfig(),
        constexprs=(("BLOCK_M", 64),),
    )
    return tlaunch.KernelLaunch(
        name=name, kernel=kernel, grid=(1, 1), args=(1, 2), constexprs={"BLOCK_M": 64},
        num_warps=4, num_stages=2, key=key, label=name,
    )  # fmt: skip


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(tlaunch.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tlaunch.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tlaunch.torch.cuda, "device", lambda _: contextlib.nullcontext())
    # Threads only: compile workers (Note [Compile workers]) would need real Triton kernels.
    with flexfa.config.override(triton_interpret=False, compile_workers=0):
        yield


def test_cold_kernels_compile_concurrently_and_failures_are_left_to_the_launch(fake_gpu):
    barrier = threading.Barrier(3)
    kernels = [_Kernel(barrier), _Kernel(barrier), _Kernel(barrier, fail=True)]
    tlaunch.warm_up([_launch(k, f"k{i}") for i, k in enumerate(kernels)])
    assert all(len(k.warmed) == 1 for k in kernels)
    assert kernels[0].warmed[0] == ((1, 2), (1, 1), {"BLOCK_M": 64})


def test_launched_kernels_are_not_compiled_again(fake_gpu):
    barrier = threading.Barrier(2)
    kernels = [_Kernel(barrier), _Kernel(barrier), _Kernel(barrier)]
    launches = [_launch(k, f"seen{i}") for i, k in enumerate(kernels)]
    tlaunch._launched.add(tlaunch._fast_key(launches[2]))
    try:
        tlaunch.warm_up(launches)
    finally:
        tlaunch._launched.discard(tlaunch._fast_key(launches[2]))
    assert [len(k.warmed) for k in kernels] == [1, 1, 0]


def test_prewarm_returns_at_once_and_the_backward_waits_for_it(fake_gpu):
    release = threading.Event()

    class Slow(_Kernel):
        def warmup(self, *args, grid, num_warps, num_stages, **constexprs):
            release.wait(timeout=10)
            self.warmed.append(args)

    kernels = [Slow(threading.Barrier(1)), Slow(threading.Barrier(1))]
    launches = [_launch(k, f"pre{i}") for i, k in enumerate(kernels)]
    tlaunch.prewarm(launches)  # returns while both compiles are blocked
    assert all(tlaunch._fast_key(kl) in tlaunch._pending for kl in launches)
    release.set()
    tlaunch.warm_up(launches)  # waits for them instead of compiling again
    assert [len(k.warmed) for k in kernels] == [1, 1]
    assert not any(tlaunch._fast_key(kl) in tlaunch._pending for kl in launches)


def test_switched_off_by_the_setting(fake_gpu):
    kernels = [_Kernel(threading.Barrier(1)), _Kernel(threading.Barrier(1))]
    with flexfa.config.override(concurrent_compile=False):
        tlaunch.warm_up([_launch(k, f"off{i}") for i, k in enumerate(kernels)])
    assert [len(k.warmed) for k in kernels] == [0, 0]


def test_a_forward_that_needs_a_backward_starts_its_compiles(monkeypatch, tmp_path):
    import torch

    from flexfa.codegen.triton import backend as tbackend

    started = []
    monkeypatch.setattr(tbackend, "concurrent_enabled", lambda: True)
    monkeypatch.setattr(tbackend, "prewarm", started.extend)
    table = torch.zeros(2, 9, requires_grad=True)

    def bias(score, b, h, q_idx, kv_idx):  # a learnable capture: the dQ kernel scatters into it
        return score + table[h, torch.clamp(q_idx - kv_idx, -4, 4) + 4]

    q, k, v = (torch.randn(1, 2, 24, 16, requires_grad=True) for _ in range(3))
    with flexfa.config.override(cache_dir=str(tmp_path)):  # a new plan
        flexfa.attention(q, k, v, score_mod=bias, block_mask=flexfa.masks.causal, backend="triton")
    assert [kl.name for kl in started] == ["bwd_preprocess", "bwd_dkdv", "bwd_dq"]
    assert started[2].constexprs["CAPTURE_MODE"] == 1


def test_a_pending_compile_holds_no_tensor_of_the_call(fake_gpu):
    """Note [Compiles hold no tensors]: under CUDA graphs a compile that outlives the call must
    not keep the call's tensors (blocks of the graph's pool) alive; it gets stand-ins that Triton
    specializes exactly as it does the tensors."""
    import weakref

    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    release = threading.Event()

    class Slow(_Kernel):
        def warmup(self, *args, grid, num_warps, num_stages, **constexprs):
            release.wait(timeout=10)
            self.warmed.append(args)

    base = torch.empty(64, dtype=torch.bfloat16)
    aligned, misaligned = base[:32], base[1:33]  # addresses 0 and 2 bytes past a 16-byte multiple
    watch = [weakref.ref(base)]
    kernel = Slow(threading.Barrier(1))
    kl = dataclasses.replace(_launch(kernel, "holds"), args=(aligned, misaligned, 7))
    del base
    tlaunch.prewarm([kl])
    del kl, aligned, misaligned
    assert watch[0]() is None, "the pending compile keeps the call's tensor alive"
    release.set()
    tlaunch._await_pending(_launch(kernel, "holds"))
    (args,) = kernel.warmed
    specialized = [native_specialize_impl(BaseBackend, a, False, True, True) for a in args[:2]]
    assert specialized == [("*bf16", "D"), ("*bf16", "")], specialized
    assert args[2] == 7
