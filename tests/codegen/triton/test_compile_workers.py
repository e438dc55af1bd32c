"""Compile workers (Note [Compile workers]): a worker process compiles a generated kernel into
Triton's cache under the key the asking process computes, so that process only loads it. Runs on
the CPU: the kernel is compiled for sm_90, nothing is launched."""

from __future__ import annotations

import os

import pytest
import torch

import flexfa
from flexfa.codegen.triton.offline import _specialized_source, meta_device_launches
from flexfa.runtime import workers


@pytest.fixture
def triton_cache(tmp_path, monkeypatch):
    from triton import knobs

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path / "triton"))
    return tmp_path / "triton"


def _entries(root) -> set[str]:
    return set(os.listdir(root)) if root.exists() else set()


def _preprocess_launch():
    from flexfa.api import build_spec

    q = torch.empty(1, 2, 128, 64, dtype=torch.bfloat16)
    with flexfa.config.override(triton_interpret=False):
        spec = build_spec(q, q, q, None, flexfa.masks.causal)
        launches = meta_device_launches(spec, capability=(9, 0))
    return next(kl for kl in launches if "preprocess" in kl.name)


def _job(kl, target, **extra) -> tuple[workers.Job, object, dict]:
    """A worker's job for the launch `kl` on `target`, with its Triton source and options."""
    import sys

    src, options = _specialized_source(kl, target)
    module = sys.modules[kl.kernel.fn.__module__]
    job = workers.Job(
        source=module.__loader__.get_source(module.__name__),
        filename=module.__file__,
        module=module.__name__,
        kernel=kl.kernel.fn.__name__,
        signature=src.signature,
        constexprs=src.constants,
        attrs=src.attrs,
        options=options,
        target=target,
        **extra,
    )
    return job, src, options


def test_a_workers_kernel_is_the_one_the_process_loads(triton_cache) -> None:
    import triton
    from triton.backends.compiler import GPUTarget

    kl = _preprocess_launch()
    target = GPUTarget("cuda", 90, 32)
    job, src, options = _job(kl, target)
    pool = workers._Pool(1)
    try:
        answer = pool.run(job)
        assert answer is not None and answer["ok"], answer
        after_worker = _entries(triton_cache)
        assert after_worker, "the worker wrote nothing to Triton's cache"
        # The asking process compiles the same specialization: a cache hit, same kernel.
        compiled = triton.compile(src, target=target, options=options)
        assert compiled.hash == answer["hash"]
        assert _entries(triton_cache) == after_worker, "the process compiled the kernel again"
        # A second job on the same worker reuses the executed module.
        again = pool.run(job)
        assert again is not None and again["ok"] and again["hash"] == answer["hash"]
    finally:
        pool.close()


def test_a_moved_cache_directory_reaches_the_workers(triton_cache, tmp_path, monkeypatch) -> None:
    """Note [Compile workers]: a job carries the asking process's Triton cache directory as it is
    at the job (torch.compile moves it to Inductor's when it first compiles), so the worker
    compiles into the directory the process now reads, and the process only loads the kernel."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    kl = _preprocess_launch()
    target = GPUTarget("cuda", 90, 32)
    pool = workers._Pool(1)  # started with the first cache directory
    try:
        moved = tmp_path / "moved"
        monkeypatch.setenv("TRITON_CACHE_DIR", str(moved))
        monkeypatch.setattr(knobs.cache, "dir", str(moved))
        job, src, options = _job(kl, target, cache_dir=workers._triton_cache_dir())
        assert job.cache_dir == str(moved)
        answer = pool.run(job)
        assert answer is not None and answer["ok"], answer
        written = _entries(moved)
        assert written, "the worker compiled into the cache directory it started with"
        assert not _entries(triton_cache), "the worker wrote into the directory the process left"
        compiled = triton.compile(src, target=target, options=options)
        assert compiled.hash == answer["hash"]
        assert _entries(moved) == written, "the process compiled the kernel again"
    finally:
        pool.close()


def test_a_failed_job_is_reported_and_the_worker_stays(triton_cache) -> None:
    from triton.backends.compiler import GPUTarget

    bad = workers.Job(
        source="import triton\n",
        filename="<flexfa-test>",
        module="flexfa_test_worker_module",
        kernel="missing",
        signature={},
        constexprs={},
        attrs={},
        options={},
        target=GPUTarget("cuda", 90, 32),
    )
    pool = workers._Pool(1)
    try:
        answer = pool.run(bad)
        assert answer is not None and not answer["ok"]
        assert "missing" in answer["error"]
        assert pool.run(bad) is not None, "the worker did not survive a failed job"
        assert len(pool.all) == 1
    finally:
        pool.close()


def test_a_dead_worker_is_replaced_then_given_up(triton_cache) -> None:
    from triton.backends.compiler import GPUTarget

    job = workers.Job("", "<x>", "m", "k", {}, {}, {}, {}, GPUTarget("cuda", 90, 32))
    pool = workers._Pool(1)
    try:
        for failures in range(1, workers._MAX_FAILURES + 1):
            pool.all[0].proc.kill() if pool.all else None
            if pool.all:
                pool.all[0].proc.wait()
            assert pool.run(job) is None
            assert pool.failures == failures
        assert not pool.all, "a worker was started after the last allowed failure"
        assert pool.run(job) is None  # no worker left: no wait
    finally:
        pool.close()


def test_compile_workers_setting(monkeypatch) -> None:
    monkeypatch.setenv("FLEXFA_COMPILE_WORKERS", "2")
    assert flexfa.config.compile_workers == 2
    monkeypatch.setenv("FLEXFA_COMPILE_WORKERS", "0")
    assert flexfa.config.compile_workers == 0 and not workers.enabled()
    monkeypatch.setenv("FLEXFA_COMPILE_WORKERS", "many")
    with pytest.raises(ValueError, match="FLEXFA_COMPILE_WORKERS"):
        _ = flexfa.config.compile_workers
    monkeypatch.delenv("FLEXFA_COMPILE_WORKERS")
    assert 1 <= flexfa.config.compile_workers <= 4


def test_the_hook_captures_on_the_asking_thread_only(monkeypatch) -> None:
    import threading

    from triton import knobs

    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: calls.append(kw) or None)
    monkeypatch.setattr(workers, "_hook_installed", False)
    assert workers._install_hook()

    def triton_compiles(tag):  # what Triton does before compiling a kernel
        return knobs.runtime.jit_cache_hook(key=tag, compile={"key": tag})

    other = []
    thread = threading.Thread(target=lambda: other.append(triton_compiles("other thread")))

    def warm():
        thread.start()
        thread.join()
        assert triton_compiles("captured") is True  # Triton is told to skip the compile

    got = workers.capture(warm)
    assert got == {"key": "captured", "compile": {"key": "captured"}}
    # Another thread's compile went on, through the hook that was there before.
    assert other == [None] and [c["key"] for c in calls] == ["other thread"]
    assert triton_compiles("later") is None and calls[-1]["key"] == "later"


def test_a_mismatch_gives_the_workers_up_with_a_warning(monkeypatch) -> None:
    class Compiled:
        hash = "abc"

    monkeypatch.setattr(workers, "_given_up", False)
    monkeypatch.setattr(workers, "stats", workers.WorkerStats())
    workers.note_loaded("abc", Compiled())
    assert workers.stats.reused == 1 and workers.enabled()
    with pytest.warns(UserWarning, match="compiled twice"):
        workers.note_loaded("other", Compiled())
    assert workers.stats.mismatched == 1 and not workers.enabled()
