"""A process that compiles flexfa's Triton kernels into Triton's cache (Note [Compile workers]).

flexfa starts it as a script (`python compile_worker.py`), never by importing it: it imports
Triton and the standard library only, not flexfa or torch, so it is ready in a fraction of a
second. It reads jobs from stdin and answers on stdout, one pickled frame each (an 8-byte length,
then the pickle). A job is a generated module's source and the specialization of one launch of
one of its kernels; the answer says whether it compiled and Triton's hash of the result. Anything
Triton prints goes to stderr, never into the answers. The process ends when stdin closes.
"""

import os
import sys

# Run as a script, Python puts this file's folder first on sys.path, where flexfa's modules would
# shadow top-level names; the worker needs none of them.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import contextlib
import importlib.util
import linecache
import pickle
import struct
import time

_HEADER = struct.Struct("<Q")
_modules: dict = {}


def read_frame(stream):
    """The next object on `stream`, or None at its end."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


def write_frame(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


# `_SourceLoader` and `_module` do what flexfa.runtime.diskcache's `run_source` does; the worker cannot import
# it (importing flexfa imports torch, which would cost the worker seconds of start-up), and the two
# must execute a module the same way, or Triton would hash its kernels differently.
class _SourceLoader:
    def __init__(self, source: str) -> None:
        self.source = source

    def get_source(self, name: str) -> str:
        return self.source

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:  # pragma: no cover - executed below
        raise ImportError("executed by the compile worker")


def _module(source: str, filename: str, name: str):
    """Execute a generated module as flexfa does (same name, file name and source lines), so that
    Triton hashes its kernels exactly as in the process that asked."""
    key = (name, filename, source)
    module = _modules.get(key)
    if module is not None:
        return module
    loader = _SourceLoader(source)
    spec = importlib.util.spec_from_loader(name, loader, origin=filename)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = filename
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    sys.modules[name] = module
    exec(compile(source, filename, "exec", dont_inherit=True), module.__dict__)
    _modules[key] = module
    return module


def compile_job(job: dict) -> dict:
    """Compile one kernel specialization; Triton writes it to its cache."""
    import triton
    from triton.compiler import ASTSource

    if job.get("cache_dir"):  # the asking process's, which may have moved since this one started
        os.environ["TRITON_CACHE_DIR"] = job["cache_dir"]
    module = _module(job["source"], job["filename"], job["module"])
    fn = getattr(module, job["kernel"])
    src = ASTSource(fn, job["signature"], job["constexprs"], job["attrs"])
    start = time.perf_counter()
    compiled = triton.compile(src, target=job["target"], options=job["options"])
    seconds = time.perf_counter() - start
    launcher = False
    try:  # the launcher's C module is cached by Triton too; not every Triton builds it this way
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(compiled.src, compiled.metadata)
        launcher = True
    except Exception:
        pass
    return {"hash": compiled.hash, "seconds": seconds, "launcher": launcher}


def main() -> None:
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # prints from Triton go to stderr
    sys.stdout = sys.stderr
    with contextlib.suppress(AttributeError, OSError):
        os.nice(5)  # the process that waits for a kernel compiles the most urgent one itself
    import triton  # noqa: F401  (ready before the first job)

    with contextlib.suppress(Exception):  # also Triton's one-time key of its own installation
        from triton.runtime.cache import triton_key

        triton_key()

    jobs = sys.stdin.buffer
    while True:
        job = read_frame(jobs)
        if job is None:
            return
        try:
            answer = {"ok": True, **compile_job(job)}
        except BaseException as e:  # report, stay alive for the next job
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        write_frame(answers, answer)


if __name__ == "__main__":
    main()
