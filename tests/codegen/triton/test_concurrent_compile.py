"""Note [Concurrent compiles]: the kernels of a cold backward are compiled at the same time."""

from __future__ import annotations

import contextlib
import threading

import pytest

import flexfa
from flexfa.codegen.triton import launch as tlaunch
from flexfa.codegen.triton.params import FwdConfig, KernelKey, ModuleKey


class _Kernel:
    """Stands for a JIT function: `warmup` waits until every kernel of the list is compiling."""

    def __init__(self, barrier: threading.Barrier, fail: bool = False) -> None:
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
    with flexfa.config.override(triton_interpret=False):
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
    tlaunch.warm_up(launches)
    assert [len(k.warmed) for k in kernels] == [1, 1, 0]
