"""Launching generated kernels: a launch as data, and the first-launch compile log."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

from flexfa.config import config
from flexfa.runtime import workers

log = logging.getLogger("flexfa")

_COMPILE_LOG_SECONDS = 1.0


@dataclasses.dataclass(frozen=True, eq=False)
class KernelLaunch:
    """One kernel launch as data: which kernel, grid, arguments, constexprs and options.

    `launch()` runs it; `flexfa.codegen.triton.offline.compile_launch` compiles the same launch for
    a GPU architecture without a GPU (tests and `python -m flexfa export --ptx` use that).
    """

    name: str
    kernel: Any
    grid: tuple[int, int]
    args: tuple
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    key: Hashable  # the generator's key of the kernel (codegen/triton/params.py: KernelKey)
    label: str

    def arg_names(self) -> list[str]:
        return [n for n in self.kernel.arg_names if n not in self.constexprs]


_launched: set[tuple] = set()


def run_logged(fast_key: tuple, label: str, run) -> None:
    """Call `run()` (a kernel launch); the first time for `fast_key`, time it and log it at INFO
    level if it took long (a compile) or FLEXFA_LOG_COMPILES is set, else at DEBUG level."""
    if fast_key in _launched:
        run()
        return
    runtime_ready()
    start = time.perf_counter()
    run()
    if torch.cuda.is_available() and not config.triton_interpret:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    _launched.add(fast_key)
    level = (
        logging.INFO if (elapsed > _COMPILE_LOG_SECONDS or config.log_compiles) else logging.DEBUG
    )
    log.log(
        level,
        "flexfa: %s kernel ready in %.2f s (compiled or loaded on first use)",
        label,
        elapsed,
    )


# Note [Concurrent compiles]
# The first backward compiles its kernels (preprocess, dK/dV, dQ) at their first launches, one
# after another, and a cold backward took the sum of their compile times. They are independent
# (no kernel's compile needs another's), so `warm_up` compiles every kernel of a list that has not
# been launched yet at once, on a small thread pool, with Triton's `warmup` (compile with the
# exact arguments of the launch, do not run); the launches that follow find their binaries in
# Triton's cache. Triton's frontend holds the GIL, but its MLIR/LLVM passes and ptxas release it,
# which is where most of a compile goes. A warm-up that fails only costs the time it took: the
# launch compiles again and reports any error itself.
# A forward that will be followed by a backward starts those compiles already (`prewarm`, with
# stand-in tensors shaped like the backward's), so they overlap the forward's own compile and run;
# the backward then waits only for what is still compiling. A compile on the pool also loads the
# kernel (`_init_handles`): Triton builds each signature's C launcher with the host compiler at a
# kernel's first launch, about 0.3 s apiece with a cold cache on the H200, which was left on the
# critical path otherwise. A kernel whose result the caller can get another way (the block-mask
# kernel of Note [Fused analysis], whose lists the general path also builds) is not waited for
# at all: `compiling_in_background` starts its compile (from the second call that asks: Note
# [Background compiles from the second call]) and the caller takes the other way until it is
# ready, so a cold first call no longer waits seconds for that compile before the forward's.
# The pool's threads have worker processes do the compiling (Note [Compile workers] in
# workers.py), so that they do not slow the compile the caller waits for by holding the GIL.
# FLEXFA_CONCURRENT_COMPILE=0 turns all of this off.
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_pending: dict[tuple, concurrent.futures.Future] = {}


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="flexfa-compile")
        return _pool


def concurrent_enabled() -> bool:
    """Whether kernels are compiled on the thread pool (Note [Concurrent compiles])."""
    return config.concurrent_compile and not config.triton_interpret and torch.cuda.is_available()


class ArgStandIn:
    """A tensor argument as Triton's specialization sees it (its dtype and whether its address is a
    multiple of 16), holding no reference to the tensor (Note [Compiles hold no tensors])."""

    __slots__ = ("_low_bits", "dtype")

    def __init__(self, tensor: torch.Tensor):
        self.dtype = tensor.dtype
        self._low_bits = tensor.data_ptr() & 15

    def data_ptr(self) -> int:
        return self._low_bits


# Note [Compiles hold no tensors]
# A compile on the pool runs for seconds after the call that started it has returned, and
# `prewarm`'s launches carry the forward's output, its LSE and stand-ins made by the forward. Under
# `torch.compile(mode="reduce-overhead")` those are blocks of the CUDA graph's private pool, and a
# compile still holding them when the graph trees check the pool ("tensor(s) in the cudagraph
# pool not tracked as outputs") fails the step (an H200 run of tests/e2e/test_compile.py did, when
# the backward's compile outlived the warm-up run). A compile reads nothing of a tensor but what
# Triton specializes on, its dtype and the alignment of its address, so `_submit` hands the pool
# `ArgStandIn`s (Triton takes any object with `dtype` and `data_ptr()` as a pointer argument, as
# its own `MockTensor`), and the tensors are freed when their caller lets them go. On the H200
# (Triton 3.6) a one-off check (bench/prewarm_check.py, in git history) found every backward kernel compiled once, on the
# pool, and none compiled again at its launch: the stand-ins give the launches' specializations.


def _without_tensors(kl: KernelLaunch) -> KernelLaunch:
    args = tuple(ArgStandIn(a) if isinstance(a, torch.Tensor) else a for a in kl.args)
    return dataclasses.replace(kl, args=args)


def _submit(cold: list[KernelLaunch]) -> list[concurrent.futures.Future]:
    device = torch.cuda.current_device()
    cold = [_without_tensors(kl) for kl in cold]

    def compile_one(kl: KernelLaunch) -> None:
        _compile_and_load(
            kl.label,
            device,
            kl.kernel,
            lambda: kl.kernel.warmup(
                *kl.args, grid=kl.grid, num_warps=kl.num_warps, num_stages=kl.num_stages,
                **kl.constexprs,
            ),
        )  # fmt: skip

    return [_executor().submit(compile_one, kl) for kl in cold]


def _compile_and_load(label: str, device: int, kernel: Any, warm: Callable[[], Any]) -> None:
    """Compile a kernel with `warm()` (a Triton `warmup` call), in a worker process where there are
    workers (Note [Compile workers]), and load it for launching: its module and its launcher
    (Note [Concurrent compiles])."""
    runtime_ready()
    start = time.perf_counter()
    with torch.cuda.device(device):
        worker_hash = workers.compile_in_worker(kernel, warm) if workers.enabled() else None
        compiled = warm()
        workers.note_loaded(worker_hash, compiled)
        init = getattr(compiled, "_init_handles", None)
        if init is not None:
            init()
    log.log(
        logging.INFO if config.log_compiles else logging.DEBUG,
        "flexfa: %s kernel compiled concurrently in %.2f s",
        label,
        time.perf_counter() - start,
    )


# Note [Triton's start-up]
# A process's first Triton compile pays Triton's one-time start-up: importing its compiler,
# hashing its own installation into every cache key (`triton_key`: it reads libtriton, 0.38 s on
# the H200) and creating its CUDA driver, which builds Triton's C helper module with the host
# compiler when Triton's cache is cold (0.38 s). In a cold first call the main thread met both
# inside the forward's compile, on the call's critical path (docs/performance.md, "Where a cold
# first call goes"). `start_runtime`, called as a call on CUDA (or a background compile, Note
# [Background compiles from the second call]) begins, does them on the compile pool, and starts
# the compile workers when the call will have background compiles, while the call traces its mods
# and builds its block mask.
# `flexfa.attention` asks once per level (start-up, then workers for the first call that wants
# gradients) and later calls stop at one module-level test; torch.compile never traces it. Calls
# that run FA4's kernels do not ask: they use no Triton kernel, and the start-up and the worker
# processes ran on the pool during their first call's FA4 compile (Note [Background compiles from
# the second call]).
# Every flexfa path into Triton (a first launch, a compile on the pool, a direct launch's first
# call) waits for it first with `runtime_ready` (free once it is done), so Triton's driver, which
# Triton creates lazily and without a lock, is created by that one thread: two threads creating
# it at once, as a pool thread and the main thread could before, each built the helper module.
_runtime: concurrent.futures.Future | None = None
_workers_started = False
_runtime_lock = threading.Lock()


def start_runtime(with_workers: bool) -> None:
    """Start Triton's one-time start-up on the compile pool and return at once (Note [Triton's
    start-up]); with `with_workers`, start the compile worker processes too. Does nothing once
    started, or where compiles are not concurrent."""
    global _runtime, _workers_started
    if (_runtime is not None and (_workers_started or not with_workers)) or (
        not concurrent_enabled()
    ):
        return
    with _runtime_lock:
        if _runtime is None:
            _runtime = _executor().submit(_start_runtime, torch.cuda.current_device())
        if with_workers and not _workers_started:
            _workers_started = True
            if workers.enabled():
                _executor().submit(workers.start)


def _start_runtime(device: int) -> None:
    from triton.runtime.driver import driver

    with torch.cuda.device(device):
        driver.active.get_current_device()  # creates the driver, with its C helper module
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # another Triton: it computes its key where it needs it
        return
    triton_key()


def runtime_ready() -> None:
    """Wait until the start-up `start_runtime` began has finished (at once if none was begun or
    it is done); a start-up that failed is left to the first compile, which reports any error."""
    future = _runtime
    if future is not None and not future.done():
        with contextlib.suppress(Exception):
            future.result()


_background: dict[tuple, concurrent.futures.Future] = {}
_asked_once: set[tuple] = set()  # cold kernels asked for once (Note [Background compiles ...])


# Note [Background compiles from the second call]
# `compiling_in_background` used to start a cold block-list kernel's compile at the first call
# that asked for it. Most BlockMasks are built once (a training run's causal or document mask), and
# then that compile, with the compile workers it started, was work nobody used, on the pool while
# the first attention call compiled its own kernels. So the first call only notes the kernel (the
# general path answers it), and the second, the sign of a mask built per step (packed batches,
# masks over per-batch tensors), starts the compile, with Triton's start-up and the compile
# workers (block masks no longer start them earlier). Per-step masks take the kernel one build
# later; one-off masks never compile it. What it gives a cold fa4 call could not be measured: on
# the H200 one run gave 3.65 s (prefix-LM) and 2.86 s (ALiBi + causal) with that work on the pool
# and 2.61 and 1.94 s for the call once it had finished (it took 1.3 s), but two runs with
# nothing on the pool gave 2.82 and 4.06 s, and 4.57 and 5.16 s, on another machine: FA4's own
# compile varies by more than that.


def wait_for_background() -> None:
    """Wait until every compile `compiling_in_background` started has finished (for tests and
    benchmarks that want the kernels, not the other way to their results)."""
    for future in list(_background.values()):
        with contextlib.suppress(Exception):  # reported when the kernel is next asked for
            future.result()


def compiling_in_background(
    fast_key: tuple, label: str, kernel: Any, warm: Callable[[], Any]
) -> bool:
    """For a kernel whose launch can wait, because the caller has another way to the same result:
    True while the kernel is cold (the first call only notes it; the second starts its compile on
    the thread pool, Note [Background compiles from the second call]) and while it compiles,
    False once it is ready to launch, or when compiles are not concurrent (under TRITON_INTERPRET,
    without CUDA, FLEXFA_CONCURRENT_COMPILE=0), where the launch compiles it. `warm()` compiles
    `kernel` without launching (Note [Concurrent compiles])."""
    if fast_key in _launched or not concurrent_enabled():
        return False
    future = _background.get(fast_key)
    if future is None:
        if fast_key not in _asked_once:
            _asked_once.add(fast_key)
            return True
        start_runtime(with_workers=True)  # Note [Triton's start-up]
        device = torch.cuda.current_device()
        _background[fast_key] = _executor().submit(_compile_and_load, label, device, kernel, warm)
        return True
    if not future.done():
        return True
    del _background[fast_key]
    if future.exception() is not None:  # the launch compiles it again and raises if it must
        log.debug("flexfa: background compile of %s failed: %s", label, future.exception())
    return False


def _wait(kl: KernelLaunch, future: concurrent.futures.Future) -> None:
    try:
        future.result()
    except Exception as e:  # the launch compiles it again and raises if it must
        log.debug("flexfa: concurrent compile of %s failed: %s", kl.label, e)


def prewarm(launches: list[KernelLaunch]) -> None:
    """Start compiling the kernels of `launches` not launched or compiling yet, and return at
    once (Note [Concurrent compiles]); `warm_up` and `launch` wait for them."""
    if not concurrent_enabled():
        return
    cold = [kl for kl in launches if _fast_key(kl) not in _launched | _pending.keys()]
    for kl, future in zip(cold, _submit(cold)):
        _pending[_fast_key(kl)] = future


def _await_pending(kl: KernelLaunch) -> bool:
    future = _pending.pop(_fast_key(kl), None)
    if future is None:
        return False
    _wait(kl, future)
    return True


def warm_up(launches: list[KernelLaunch]) -> None:
    """Compile the kernels of `launches` not launched before, concurrently (Note [Concurrent
    compiles]), after waiting for those `prewarm` started. Does nothing under TRITON_INTERPRET."""
    if not concurrent_enabled():
        return
    start = time.perf_counter()
    awaited = [kl for kl in launches if _pending and _await_pending(kl)]
    cold = [kl for kl in launches if _fast_key(kl) not in _launched and kl not in awaited]
    if len(cold) < 2 and not awaited:
        return
    if len(cold) >= 2:
        for kl, future in zip(cold, _submit(cold)):
            _wait(kl, future)
    log.log(
        logging.INFO if config.log_compiles else logging.DEBUG,
        "flexfa: %d kernels compiled concurrently (%d started earlier), waited %.2f s",
        len(cold) + len(awaited),
        len(awaited),
        time.perf_counter() - start,
    )


def _fast_key(kl: KernelLaunch) -> tuple:
    return (
        id(kl.kernel),
        kl.num_warps,
        kl.num_stages,
        kl.key.dtype,
        kl.key.config,
        kl.key.constexprs,
    )


_direct: dict[tuple, DirectLaunch] = {}
_FINGERPRINTS_KEPT = 64


def launch(kl: KernelLaunch) -> None:
    """Run a launch, logging the first launch of each specialization if it takes long (a compile);
    later launches of the same kernel and constexprs are direct (Note [Direct launches])."""
    key = _fast_key(kl)
    if key in _launched:
        direct = _direct.get(key)
        if direct is None:
            direct = _direct[key] = DirectLaunch(
                kl.kernel, kl.constexprs, kl.num_warps, kl.num_stages
            )
        direct(kl.grid, kl.args)
        return
    run = lambda: kl.kernel[kl.grid](
        *kl.args, num_warps=kl.num_warps, num_stages=kl.num_stages, **kl.constexprs
    )
    if _pending:  # a compile of this kernel may have been started by prewarm
        _await_pending(kl)
    run_logged(key, kl.label, run)


def direct_default(kernel: Any, constexprs: dict) -> DirectLaunch:
    """The `DirectLaunch` of `kernel` with these constexprs and Triton's default options."""
    key = (id(kernel), *constexprs.items())
    direct = _direct.get(key)
    if direct is None:
        direct = _direct[key] = DirectLaunch(kernel, constexprs, None, None)
    return direct


def launch_default(
    fast_key: tuple, label: str, kernel: Any, grid: tuple[int, ...], args: tuple, constexprs: dict
) -> None:
    """`kernel[grid](*args, **constexprs)` with Triton's default options, through `run_logged`
    the first time for `fast_key` and directly after that (Note [Direct launches]). Callers on a
    hot path try `direct_default(kernel, constexprs).try_call(grid, args)` first."""
    if fast_key in _launched:
        direct_default(kernel, constexprs)(grid, args)
        return
    run_logged(fast_key, label, lambda: kernel[grid](*args, **constexprs))


# Note [Direct launches]
# `kernel[grid](*args, **constexprs)` goes through Triton's `JITFunction.run` on every call: it
# reads its knobs, binds and specializes every argument, builds a cache key from the
# specialization and the options (a string of the options dict) and looks the compiled kernel up,
# before the launch itself. For a decode step at 4k keys (tens of microseconds on the GPU) that
# per-call work is a large share of the step. A `DirectLaunch` keeps, per *fingerprint* of the
# arguments, the `CompiledKernel` that Triton's own path returned for them, and calls it directly
# (`CompiledKernel[grid](*all_args)`, Triton's public launcher of a compiled kernel). The
# fingerprint holds everything Triton specializes a kernel on that can vary between calls with the
# same constexprs and options: each tensor's dtype and address modulo 16, each integer's and
# bool's value, the type of every other argument, and the current device. A fingerprint not seen
# yet is reduced to the specialization itself (an integer's class: equal to 1, divisible by 16,
# and its width, which is what Triton specializes integers on), and a known specialization gives
# its kernel without Triton's path: a length that grows every decode step keeps its kernel. The
# fingerprints, cheaper to compute than the classes, are kept for the last few dozen values. A new fingerprint goes through `JITFunction.run` once
# (which compiles or finds the specialization) and is remembered. Under TRITON_INTERPRET there is
# no compiled kernel, and every call goes through the JIT function; FLEXFA_DIRECT_LAUNCH=0 does the
# same on a GPU.
# Every launch takes this path after its first (logged) one: `launch` keeps a `DirectLaunch` per
# kernel, options and constexprs (`_fast_key`); the decode path keeps its own in its cached plan,
# which also spares it building `KernelLaunch` records (Note [Decode host time]). The packed
# block-list kernel's integers (a batch's lengths) are new at almost every call, so its launches
# ask for the specialization alone (`try_call(..., new_ints=True)`), without a fingerprint that
# would not be found and would push the kept ones out. On the H200 a
# direct launch cost about 28 us of host time less than Triton's path (docs/performance.md).
class DirectLaunch:
    """Launch one Triton kernel with fixed constexprs and options, skipping `JITFunction.run`'s
    per-call work after the first call with each argument fingerprint (Note [Direct launches])."""

    __slots__ = (
        "_by_specialization",
        "_compiled",
        "_constexpr_values",
        "constexprs",
        "kernel",
        "num_stages",
        "num_warps",
    )

    def __init__(
        self,
        kernel: Any,
        constexprs: dict[str, Any],
        num_warps: int | None,
        num_stages: int | None,
    ):
        self.kernel = kernel
        self.constexprs = constexprs
        self.num_warps = num_warps
        self.num_stages = num_stages
        names = list(kernel.arg_names)
        tail = names[len(names) - len(constexprs) :] if constexprs else []
        # The generated kernels declare their constexprs last, so the full argument list of a
        # launch is the positional arguments followed by the constexprs in declaration order.
        self._constexpr_values: tuple | None = (
            tuple(constexprs[n] for n in tail)
            if set(tail) == set(constexprs) and config.direct_launch
            else None
        )
        self._compiled: dict[tuple, Any] = {}  # by fingerprint
        self._by_specialization: dict[tuple, Any] = {}

    def __call__(self, grid: tuple[int, ...], args: list | tuple) -> None:
        if self._constexpr_values is None or config.triton_interpret:
            self._jit(grid, args)
            return
        device = torch.cuda.current_device()
        key = _fingerprint(args, device)
        compiled = self._compiled.get(key)
        if compiled is None:
            spec = _specialization(args, device)
            compiled = self._by_specialization.get(spec)
            if compiled is None:
                compiled = self._jit(grid, args)
                if compiled is not None and hasattr(compiled, "__getitem__"):
                    self._by_specialization[spec] = compiled
                    self._remember(key, compiled)
                return
            self._remember(key, compiled)
        run_compiled(compiled, grid, args, self._constexpr_values)

    def try_call(
        self, grid: tuple[int, ...], args: list | tuple, *, new_ints: bool = False
    ) -> bool:
        """Launch directly if this specialization was launched through this object before;
        otherwise launch nothing and return False. `new_ints`: the integer arguments are new at
        almost every call (a packed batch's lengths), so look the specialization up at once,
        without the fingerprint that would not be found."""
        if self._constexpr_values is None or config.triton_interpret:
            return False
        device = torch.cuda.current_device()
        if new_ints:
            compiled = self._by_specialization.get(_specialization(args, device))
            if compiled is None:
                return False
        else:
            key = _fingerprint(args, device)
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._by_specialization.get(_specialization(args, device))
                if compiled is None:
                    return False
                self._remember(key, compiled)
        run_compiled(compiled, grid, args, self._constexpr_values)
        return True

    def compiled_for(self, args: list | tuple) -> Any:
        """The compiled kernel a direct call with `args` would launch, or None when there is none
        yet (or under the interpreter)."""
        if self._constexpr_values is None or config.triton_interpret:
            return None
        device = torch.cuda.current_device()
        found = self._compiled.get(_fingerprint(args, device))
        if found is None:
            found = self._by_specialization.get(_specialization(args, device))
        return found

    def call_compiled(
        self, compiled: Any, grid: tuple[int, ...], args: list | tuple, stream: int | None = None
    ) -> None:
        """Launch `compiled` (from `compiled_for` with arguments of the same specialization) on
        `stream` (a raw CUDA stream), by default the current one."""
        run_compiled(compiled, grid, args, self._constexpr_values, stream)

    def _remember(self, key: tuple, compiled: Any) -> None:
        if len(self._compiled) >= _FINGERPRINTS_KEPT:  # lengths that change every call
            self._compiled.clear()
        self._compiled[key] = compiled

    def _jit(self, grid: tuple[int, ...], args: list | tuple) -> Any:
        runtime_ready()
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        options = {k: v for k, v in options.items() if v is not None}  # None: Triton's default
        return self.kernel[grid](*args, **options, **self.constexprs)


# Note [Compiled launches]
# `CompiledKernel[grid](*args)`, Triton's launcher of a compiled kernel, makes a closure, asks
# Triton's driver for the current device and stream, builds launch metadata for the launch hooks,
# and hands the hook chains to its C launcher, which calls them around the launch. None of that
# is needed when no launch hook is registered (profilers such as proton register them): then
# `run_compiled` calls the same launcher (`CompiledKernel.run`, with the kernel's function and
# packed metadata, as the closure does) on the current stream read by torch's C functions (as
# Triton's driver reads it), with no metadata and no hooks. Anything else (a hook, a kernel whose
# handles are not loaded yet, a Triton whose kernels lack these attributes) takes Triton's own
# path. On the H200's host a 4k decode step's split kernel took 13.1 us of host time through
# Triton's closure and 9.0 us through `CompiledKernel.run` (docs/performance.md).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_raw_stream_of = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream
)
_runtime_knobs: Any = None


def current_raw_stream(index: int | None = None) -> int:
    """The current CUDA stream of GPU `index` (default: the current GPU) as an integer handle."""
    return _raw_stream_of(_current_device() if index is None else index)


def _hooks_idle() -> bool:
    """Whether no Triton launch hook is registered (Note [Compiled launches])."""
    global _runtime_knobs
    if _runtime_knobs is None:
        from triton import knobs

        _runtime_knobs = knobs.runtime
    enter, leave = _runtime_knobs.launch_enter_hook, _runtime_knobs.launch_exit_hook
    # Triton's hook chains keep their hooks in `calls`; a hook set by hand is a plain function.
    return (enter is None or not getattr(enter, "calls", True)) and (
        leave is None or not getattr(leave, "calls", True)
    )


def run_compiled(
    compiled: Any,
    grid: tuple[int, ...],
    args: list | tuple,
    tail: tuple = (),
    stream: int | None = None,
) -> None:
    """`compiled[grid](*args, *tail)` on `stream` (default: the current stream), without Triton's
    per-call Python where no launch hook needs it (Note [Compiled launches])."""
    grid = (*grid, 1, 1)[:3]  # Triton's launcher takes 3 dims
    function = getattr(compiled, "function", None)
    if function is None or not _hooks_idle():
        if stream is None:
            compiled[grid](*args, *tail)
        else:
            compiled[grid](*args, *tail, stream=stream)
        return
    if stream is None:
        stream = current_raw_stream()
    compiled.run(
        grid[0], grid[1], grid[2], stream, function, compiled.packed_metadata, None, None, None,
        *args, *tail,
    )  # fmt: skip


def _fingerprint(args: list | tuple, device: int) -> tuple:
    """The arguments' values where Triton's specialization may depend on them, on the current
    GPU `device`: a fast key, finer than Triton's own (Note [Direct launches])."""
    return (
        device,
        *[
            a
            if type(a) is int or type(a) is bool
            else (a.dtype, a.data_ptr() & 15)
            if isinstance(a, torch.Tensor)
            else type(a)
            for a in args
        ],
    )


def _specialization(args: list | tuple, device: int) -> tuple:
    """What Triton's specialization of a launch on the current GPU `device` depends on, exactly
    (Note [Direct launches]). An integer's class is what Triton specializes it on: equal to 1,
    divisible by 16, and its type (i32, i64 or u64), written out rather than called per integer;
    lengths that change from call to call share a class, and a kernel."""
    return (
        device,
        *[
            (a == 1, a % 16 == 0, -0x80000000 <= a <= 0x7FFFFFFF, a >= 1 << 63)
            if type(a) is int
            else a
            if type(a) is bool
            else (a.dtype, a.data_ptr() & 15)
            if isinstance(a, torch.Tensor)
            else type(a)
            for a in args
        ],
    )
