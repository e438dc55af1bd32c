"""Compile workers: background compiles of Triton kernels in separate processes.

# Note [Compile workers]
# The kernels of a cold call compile concurrently (Note [Concurrent compiles] in launch.py), but on
# threads of one process they share its GIL: Triton's front end and part of its passes hold it. On
# the H200's host, four background compiles (the block-mask kernel and the backward's three)
# stretched the forward's own compile, which the first call waits for, from 1.3 s to 2.8 s
# (`bench/triton_vs_flex.py --compile --log`). So a background compile is done by a worker
# process instead:
#   1. The pool thread asks Triton for the kernel as a launch would (`warmup` with the launch's
#      arguments), with Triton's `jit_cache_hook` answering "skip" for this thread only: Triton's
#      own launch path computes the key, signature, constexprs, attributes and options of this
#      specialization on this GPU and hands them to the hook, and compiles nothing.
#   2. A worker (compile_worker.py, started as a script with this Python and environment, which
#      imports Triton and nothing of flexfa or torch) executes the generated module from its source
#      under the same name and file name, and compiles that specialization into Triton's cache,
#      building the launcher's C module as well.
#   3. The pool thread asks Triton again, without the hook: Triton finds the kernel in its cache
#      under the same key and only loads it.
# Nothing depends on a worker for correctness: in step 3 Triton compiles whatever its cache does
# not hold. `stats` counts how often the worker's kernel was the one loaded (`reused`, same hash)
# and how often not (`mismatched`: another Triton configuration in the worker); at the first
# mismatch the workers are given up for the process with a warning, since that kernel was compiled
# twice. Triton's cache directory can change after the workers start: torch.compile points
# TRITON_CACHE_DIR at Inductor's cache when it first compiles (and TRITON_PTXAS_PATH at torch's
# ptxas). A worker would then compile into the directory it started with, and the process, finding
# nothing in its new one, would compile the kernel again, with the same hash: unseen. So each job
# carries the process's cache directory at the job, and the worker compiles into it. The worker
# takes nothing else: Triton reads ptxas's version into its keys once per process, so a worker
# that followed TRITON_PTXAS_PATH would key its kernels by torch's ptxas where the process may still
# key them by the one it read first (on an H200, a worker following every TRITON_ variable gave one
# such mismatch in the four jobs after torch.compile's call, and the workers were given up; where
# the workers start only after torch.compile moved the path, the same mismatch can happen, and the
# warning says so). A one-off script (bench/compile_workers.py, in git history) on an H200 (cold flexfa training calls, a
# torch.compile'd FlexAttention call, then flexfa calls with new kernels): with the cache directory
# followed, none of the later kernels went to the old directory; before, 8 entries did, each
# compiled again by the process. A worker that fails or
# exits is replaced, and after `_MAX_FAILURES` failures the workers are given up too, with a
# warning. Workers start at the first background compile (all of them at once: each takes about as
# long to start as importing Triton) and end with the process. FLEXFA_COMPILE_WORKERS sets their
# number (0: compile on the pool threads, as before). The workers have run in tests on the CPU
# (tests/codegen/triton/test_compile_workers.py: a worker's kernel is the one the process then
# loads, also after its cache directory moved); the GPU test of a cold training step is
# tests/codegen/triton/test_gpu.py.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flexfa.config import config
from flexfa.runtime.compile_worker import read_frame, write_frame

log = logging.getLogger("flexfa")

SCRIPT = Path(__file__).with_name("compile_worker.py")
_MAX_FAILURES = 3
_ANSWER_SECONDS = 900.0  # far beyond any kernel's compile


@dataclasses.dataclass
class WorkerStats:
    """What the compile workers did in this process (for tests and `bench/`)."""

    jobs: int = 0  # specializations sent to a worker
    reused: int = 0  # ... whose compiled kernel the process then loaded from Triton's cache
    mismatched: int = 0  # ... where the process's own key differed, so it compiled again
    failed: int = 0  # jobs a worker could not do (the process compiled the kernel itself)
    started: int = 0  # worker processes started


stats = WorkerStats()


@dataclasses.dataclass(frozen=True)
class Job:
    """One kernel specialization for a worker: the generated module and Triton's compile inputs."""

    source: str
    filename: str
    module: str
    kernel: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    target: Any  # triton's GPUTarget
    # Triton's cache directory in the asking process at the job; the worker compiles into it.
    cache_dir: str | None = None

    def message(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class _Worker:
    def __init__(self) -> None:
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)  # workers compile for the GPU, always
        cache_dir = _triton_cache_dir()
        if cache_dir:
            env["TRITON_CACHE_DIR"] = cache_dir
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        stats.started += 1

    def run(self, job: Job) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        write_frame(self.proc.stdin, job.message())
        ready, _, _ = select.select([self.proc.stdout], [], [], _ANSWER_SECONDS)
        if not ready:  # a hung compile: the thread compiles the kernel itself
            raise RuntimeError(f"no answer from the compile worker in {_ANSWER_SECONDS} s")
        answer = read_frame(self.proc.stdout)
        if answer is None:
            raise RuntimeError(f"the compile worker exited (code {self.proc.poll()})")
        return answer

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=2)
        except Exception:
            self.proc.kill()


class _Pool:
    def __init__(self, size: int) -> None:
        self.size = size
        self.idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self.all: list[_Worker] = []
        self.failures = 0
        self.lock = threading.Lock()
        self.pid = os.getpid()
        for _ in range(size):
            self._start()

    def _start(self) -> None:
        worker = _Worker()
        self.all.append(worker)
        self.idle.put(worker)

    def run(self, job: Job) -> dict | None:
        while True:
            try:
                worker = self.idle.get(timeout=0.5)
                break
            except queue.Empty:
                if not self.all:  # every worker failed
                    return None
        try:
            answer = worker.run(job)
        except Exception as e:  # a dead or broken worker: replace it
            worker.close()
            with self.lock:
                self.all.remove(worker)
                self.failures += 1
                if self.failures < _MAX_FAILURES:
                    self._start()
            log.debug("flexfa: compile worker failed: %s", e)
            return None
        self.idle.put(worker)
        return answer

    def close(self) -> None:
        for worker in self.all:
            worker.close()


_pool: _Pool | None = None
_pool_lock = threading.Lock()
_given_up = False


def _triton_cache_dir() -> str | None:
    try:
        from triton import knobs

        return str(knobs.cache.dir)
    except Exception:
        return None


def _get_pool() -> _Pool | None:
    global _pool, _given_up
    if _given_up:
        return None
    with _pool_lock:
        if _pool is not None and _pool.pid != os.getpid():
            _pool = None  # a forked child: the parent's workers and pipes are the parent's
        if _pool is None:
            try:
                _pool = _Pool(config.compile_workers)
            except OSError as e:
                _given_up = True
                warnings.warn(
                    f"flexfa: cannot start compile worker processes ({e}); background compiles "
                    "run on threads of this process",
                    stacklevel=2,
                )
                return None
            atexit.register(_pool.close)
        if _pool.failures >= _MAX_FAILURES and not _pool.all:
            _given_up = True
            warnings.warn(
                "flexfa: compile worker processes failed repeatedly; background compiles run on "
                "threads of this process from now on (FLEXFA_COMPILE_WORKERS=0 does this "
                "from the start)",
                stacklevel=2,
            )
            return None
        return _pool


def start() -> None:
    """Start the worker processes now, if they are enabled and not running, so that they are
    ready when the first compile job comes (Note [Triton's start-up] in launch.py)."""
    if enabled():
        _get_pool()


def enabled() -> bool:
    return config.compile_workers > 0 and not _given_up


# -- what a launch would compile -----------------------------------------------------------------

_local = threading.local()
_hook_lock = threading.Lock()
_hook_installed = False


def _install_hook() -> bool:
    """Put flexfa's capturing hook in Triton's `jit_cache_hook`, keeping any hook already there for
    every thread that is not capturing. False if this Triton has no such hook."""
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return True
        try:
            from triton import knobs

            previous = knobs.runtime.jit_cache_hook
        except (ImportError, AttributeError):
            return False

        def hook(*args: Any, **kwargs: Any) -> Any:
            captured = getattr(_local, "captured", None)
            if captured is None:
                return previous(*args, **kwargs) if previous is not None else None
            captured.append(kwargs)
            return True  # Triton skips the compile

        knobs.runtime.jit_cache_hook = hook
        _hook_installed = True
        return True


def capture(warm: Callable[[], Any]) -> dict | None:
    """What `warm()` (a Triton `warmup` call on this thread) would compile, without compiling it:
    the keyword arguments Triton passes its `jit_cache_hook`, or None if it would compile nothing
    (the kernel is in Triton's memory) or the hook is not there."""
    if not _install_hook():
        return None
    _local.captured = []
    try:
        warm()
    finally:
        captured, _local.captured = _local.captured, None
    return captured[0] if captured else None


def job_for(kernel: Any, hook_kwargs: dict) -> Job | None:
    """A worker's job from what Triton handed its `jit_cache_hook` for `kernel`."""
    from triton.runtime.driver import driver

    module = sys.modules.get(kernel.fn.__module__)
    loader = getattr(module, "__loader__", None)
    if module is None or not hasattr(loader, "get_source"):
        return None
    compile_args = hook_kwargs["compile"]
    data = json.loads(compile_args["specialization_data"])
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()}
    return Job(
        source=loader.get_source(module.__name__),
        filename=module.__file__,
        module=module.__name__,
        kernel=kernel.fn.__name__,
        signature=compile_args["signature"],
        constexprs=compile_args["constants"],
        attrs=compile_args["configs"][0],
        options=options,
        target=driver.active.get_current_target(),
        cache_dir=_triton_cache_dir(),
    )


def compile_in_worker(kernel: Any, warm: Callable[[], Any]) -> str | None:
    """Have a worker compile what `warm()` would, into Triton's cache; returns the hash Triton gave
    the worker's kernel, or None if no worker compiled it (Note [Compile workers])."""
    pool = _get_pool()
    if pool is None:
        return None
    try:
        hook_kwargs = capture(warm)
        job = job_for(kernel, hook_kwargs) if hook_kwargs is not None else None
    except Exception as e:  # another Triton's internals: compile on this thread
        log.debug("flexfa: no compile job for %s: %s", getattr(kernel, "__name__", kernel), e)
        return None
    if job is None:
        return None
    stats.jobs += 1
    answer = pool.run(job)
    if answer is None or not answer.get("ok"):
        stats.failed += 1
        if answer is not None:
            log.debug("flexfa: compile worker could not compile %s: %s", job.kernel, answer)
        return None
    return answer["hash"]


def note_loaded(worker_hash: str | None, compiled: Any) -> None:
    """Count whether the process loaded the worker's kernel (Note [Compile workers]). The first
    time it did not, the process compiled the kernel a second time: workers are given up for the
    process, with a warning, so that no later compile is done twice."""
    global _given_up
    if worker_hash is None:
        return
    if getattr(compiled, "hash", None) == worker_hash:
        stats.reused += 1
        return
    stats.mismatched += 1
    if not _given_up:
        _given_up = True
        warnings.warn(
            "flexfa: a kernel compiled by a compile worker was not the one Triton loaded (another "
            "Triton configuration in the worker?), so it was compiled twice; background compiles "
            "run on threads of this process from now on (FLEXFA_COMPILE_WORKERS=0 does this from "
            "the start)",
            stacklevel=2,
        )
