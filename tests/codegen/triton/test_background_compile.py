"""`compiling_in_background` (Note [Concurrent compiles]): a cold kernel whose caller has another
way to its result is compiled and loaded on the thread pool, never waited for. Triton's objects
are stood in for by fakes, so this runs on a CPU."""

from __future__ import annotations

import threading

import pytest

from flexfa.config import config
from flexfa.runtime import launch as launch_mod


class FakeCompiled:
    def __init__(self) -> None:
        self.loaded = 0

    def _init_handles(self) -> None:
        self.loaded += 1


@pytest.fixture
def concurrent(monkeypatch):
    monkeypatch.setattr(launch_mod, "concurrent_enabled", lambda: True)
    monkeypatch.setattr(launch_mod.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch_mod.torch.cuda, "device", lambda index: _NoContext())
    monkeypatch.setattr(launch_mod, "_background", {})
    monkeypatch.setattr(launch_mod, "_asked_once", set())
    with config.override(log_compiles=False, compile_workers=0):
        yield


class _NoContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def no_start_up(monkeypatch):
    """Triton's start-up (Note [Triton's start-up]) left out: its own tests are below."""
    started = []
    monkeypatch.setattr(launch_mod, "start_runtime", lambda with_workers: started.append(1))
    return started


def test_cold_kernel_compiles_once_then_is_ready(concurrent, no_start_up) -> None:
    """Note [Background compiles from the second call]: the first call notes the kernel, the
    second starts its compile (and Triton's start-up), later ones launch it once it is ready."""
    release = threading.Event()
    compiled = FakeCompiled()
    calls = []

    def warm():
        calls.append(1)
        release.wait(10)
        return compiled

    key = ("kernel", "cuda:0", 16)
    assert launch_mod.compiling_in_background(key, "demo", None, warm)  # noted only
    assert key not in launch_mod._background and not calls and not no_start_up
    assert launch_mod.compiling_in_background(key, "demo", None, warm)  # started
    assert launch_mod.compiling_in_background(key, "demo", None, warm)  # still compiling
    release.set()
    launch_mod._background[key].result(10)
    assert not launch_mod.compiling_in_background(key, "demo", None, warm)  # ready: launch it
    assert calls == [1], "compiled more than once"
    assert compiled.loaded == 1, "the compiled kernel was not loaded (launcher built) off-thread"


def test_a_launched_or_serial_kernel_is_never_deferred(concurrent, monkeypatch) -> None:
    def warm():
        raise AssertionError("must not compile")

    key = ("kernel", "cuda:0", 32)
    monkeypatch.setattr(launch_mod, "_launched", {key})
    assert not launch_mod.compiling_in_background(key, "demo", None, warm)
    monkeypatch.setattr(launch_mod, "_launched", set())
    monkeypatch.setattr(launch_mod, "concurrent_enabled", lambda: False)
    assert not launch_mod.compiling_in_background(key, "demo", None, warm)


def test_a_failed_background_compile_leaves_the_launch_to_compile(
    concurrent, no_start_up, caplog
) -> None:
    def warm():
        raise RuntimeError("ptxas died")

    key = ("kernel", "cuda:0", 64)
    assert launch_mod.compiling_in_background(key, "demo", None, warm)  # noted only
    assert launch_mod.compiling_in_background(key, "demo", None, warm)  # started
    future = launch_mod._background[key]
    with pytest.raises(RuntimeError):
        future.result(10)
    # Ready to launch: the launch compiles it again and reports any error itself.
    assert not launch_mod.compiling_in_background(key, "demo", None, warm)
    assert key not in launch_mod._background


def test_triton_start_up_runs_once_off_thread_and_compiles_wait_for_it(
    concurrent, monkeypatch
) -> None:
    """Note [Triton's start-up]: one start-up on the pool, whatever the number of calls; compiles
    and first launches wait for it; the worker processes start once, when asked for."""
    release = threading.Event()
    started, pools = [], []

    def start_up(device: int) -> None:
        started.append(threading.current_thread().name)
        release.wait(10)

    monkeypatch.setattr(launch_mod, "_runtime", None)
    monkeypatch.setattr(launch_mod, "_workers_started", False)
    monkeypatch.setattr(launch_mod, "_start_runtime", start_up)
    monkeypatch.setattr(launch_mod.workers, "start", lambda: pools.append(1))
    monkeypatch.setattr(launch_mod.workers, "enabled", lambda: True)
    launch_mod.start_runtime(with_workers=False)
    launch_mod.start_runtime(with_workers=False)
    launch_mod.start_runtime(with_workers=True)
    launch_mod.start_runtime(with_workers=True)
    order = []

    def first_launch() -> None:
        order.append("launch")

    waiter = threading.Thread(
        target=lambda: launch_mod.run_logged(("start-up test",), "demo", first_launch)
    )
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and order == [], "a first launch did not wait for the start-up"
    order.append("start-up done")
    release.set()
    waiter.join(10)
    launch_mod._runtime.result(10)
    assert order == ["start-up done", "launch"]
    assert len(started) == 1 and started[0] != threading.current_thread().name, started
    for _ in range(50):  # the workers' start is queued behind the start-up on the pool
        if pools:
            break
        threading.Event().wait(0.05)
    assert pools == [1], f"worker processes started {len(pools)} times"
    launch_mod.runtime_ready()  # done: returns at once


def test_a_failed_start_up_is_left_to_the_first_compile(concurrent, monkeypatch) -> None:
    """A start-up that raises (no C compiler, a broken Triton install) does not raise where
    flexfa waits for it: the first compile meets the same problem and reports it itself."""

    def broken(device: int) -> None:
        raise RuntimeError("no host compiler")

    monkeypatch.setattr(launch_mod, "_runtime", None)
    monkeypatch.setattr(launch_mod, "_workers_started", False)
    monkeypatch.setattr(launch_mod, "_start_runtime", broken)
    launch_mod.start_runtime(with_workers=False)
    launch_mod._runtime.exception(10)  # finished, with its error
    launch_mod.runtime_ready()  # does not raise
    ran = []
    launch_mod.run_logged(("failed start-up test",), "demo", lambda: ran.append(1))
    assert ran == [1]


def test_calls_ask_for_the_start_up_once_per_level(monkeypatch) -> None:
    """Eager calls ask for the start-up once, and for the workers once a call wants gradients;
    later calls stop at one module-level test (Note [Triton's start-up])."""
    import torch

    import flexfa.api as api

    asked = []
    monkeypatch.setattr(api, "_triton_level", 0)
    monkeypatch.setattr(
        launch_mod, "start_runtime", lambda with_workers: asked.append(with_workers)
    )
    x = torch.randn(1, 1, 4, 8)
    y = x.clone().requires_grad_()
    for q in (x, x, y, y, x):
        api._start_triton(q, x, x)
    assert asked == [False, True], asked
    with torch.no_grad():
        api._start_triton(y, x, x)
    assert asked == [False, True], asked


def test_only_calls_that_run_triton_start_it(monkeypatch) -> None:
    """Note [Triton's start-up]: a call `auto` sends to fa4 starts nothing on the pool (it would
    slow FA4's compile); one sent to triton, or asking for it, does."""
    import torch

    import flexfa
    import flexfa.api as api

    class Chosen:
        def __init__(self, name: str) -> None:
            self.name = name

        def run(self, spec, q, k, v):
            return torch.zeros_like(q), torch.zeros(q.shape[:3])

    asked = []
    monkeypatch.setattr(api, "_triton_level", 0)
    monkeypatch.setattr(api, "_start_triton", lambda q, k, v: asked.append(1))
    monkeypatch.setattr(api, "_on_cuda", lambda q: True)
    x = torch.randn(1, 1, 4, 8)
    for name, backend, starts in (("fa4", "auto", False), ("triton", "auto", True)):
        asked.clear()
        api._memo.clear()
        monkeypatch.setattr(api.backends, "select", lambda backend, spec, n=name: Chosen(n))
        with torch.no_grad():
            flexfa.attention(x, x, x, backend=backend)
        assert bool(asked) == starts, (name, asked)
    asked.clear()
    monkeypatch.setattr(api.backends, "select", lambda backend, spec: Chosen("triton"))
    flexfa.attention(x, x, x, backend="triton")
    assert asked, "an explicit triton call starts it before building its spec"
    api._memo.clear()
