"""flexfa's caches on disk: where they live, what is trusted, and how files are read and written.

Every cache flexfa keeps on disk goes through this module: the generated Triton attention modules
(`triton/`), the generated block-mask kernels (`blockmask/`), the tuning results
(`triton/tuning.json`), and any backend added later (a new backend adds its name to `BACKENDS`).

>>> from flexfa import diskcache
>>> loc = diskcache.location()        # doctest: +SKIP
>>> loc.path                          # doctest: +SKIP
PosixPath('/home/me/.cache/flexfa')

From the shell: `python -m flexfa cache info` and `python -m flexfa cache clear [--backend NAME]`.

# Note [Disk caches]
# The rules, the same for every cache:
#
# - Code is executed only when it is exactly what flexfa generates for the key. The caller passes
#   a `render` function; the cached file is read once (regular file, no symlink, its size first),
#   compared byte for byte with `render()`, and the rendered text (equal to the file when the
#   check passes) is what gets compiled and executed. Nothing re-reads the file between the check
#   and the execution: the module is compiled from memory with the file's path as its filename,
#   and the same text is registered in `linecache`, which is where `inspect` (and so Triton's
#   `@jit`, which reads a kernel's source when it is decorated, and its interpreter, which reads
#   it on the first call) gets the source. A file that differs (damaged by a crash or a full disk,
#   empty, truncated, or replaced by other code) is discarded with a warning naming it and why,
#   and the module is written again.
#
#   Why re-render rather than a digest of the file's content in its name: a digest catches
#   damage, but a file named by the digest of its own (foreign) content passes it; only
#   re-rendering ties the bytes to the key. Measured on the CPU (CPU time in a fresh process,
#   ALiBi + causal attention module of 25 kB): sha256 of the file 0.05 ms; re-rendering 0.6 ms
#   of emitting and 0.4 ms of template rendering, after 15-23 ms once per process to parse and
#   compile the Jinja templates. Compiling the module's Python (8 ms) is paid either way now
#   that no `__pycache__` bytecode is trusted. So the check costs about 17 ms on the first call
#   in a process and about 1 ms on each later new module, against a first call of 1.2-1.5 s on
#   a GPU with warm caches (docs/performance.md, `bench/cache_first_call.py`). The disk copy
#   then saves no rendering; it is kept because it is the file tracebacks, the exported source
#   and people point at, and the sign for a second process that its Triton binaries are in
#   Triton's cache.
#
# - The directory is private. flexfa creates it (and any missing parent) with mode 0700, and uses
#   it only if it is a directory owned by the current user that neither group nor others can
#   write. Otherwise it warns once and uses a private per-user directory under the system's
#   temporary directory (`<tmp>/flexfa-<uid>`, same checks), and if that fails as well keeps
#   modules in memory for the process. (Ownership and mode are not checked on Windows.)
#
# - Never fatal. Creating, reading, writing or removing a cache file can fail for any reason (a
#   regular file where a directory should be, no permission, a read-only mount, a full disk, a
#   write that stops half-way); each failure is one warning, and the module then runs from
#   memory under a `<flexfa-generated ...>` filename that only `linecache` knows. A tuning file
#   that is not a JSON object is ignored with a warning, removed, and written afresh by the next
#   tuning result.
#
# - Writes are atomic: a private temporary file in the same directory, then `os.replace`. Several
#   processes or threads writing the same key each write their own temporary file; the last
#   rename wins and every rename installs a complete file with the same bytes. A reader sees the
#   old file, the new one, or none, never a part.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib.util
import json
import linecache
import os
import shutil
import stat
import sys
import tempfile
import threading
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flexfa.config import config

BACKENDS: dict[str, str] = {
    "triton": "generated Triton attention modules and tuning results",
    "blockmask": "generated block-mask kernels (exact tier and fused block lists)",
    "cute": "generated CuTe DSL attention modules",
    "fa4": "FA4 kernels compiled with flexfa's generated CuTe mods (object files)",
}
"""The cache's subdirectories, one per backend, with what each holds."""

MODULE_FILE = "kernels.py"
KEY_FILE = "key.json"
_TMP_SUFFIX = ".tmp"


class CacheWarning(UserWarning):
    """A cache file or directory could not be used; flexfa went on without it."""


@dataclasses.dataclass(frozen=True)
class Location:
    """Where this process keeps its caches.

    `configured` is FLEXFA_CACHE_DIR (or the user's cache directory); `path` is the directory in
    use, which is `configured` unless `reason` says why not; None means memory only.
    """

    configured: Path
    path: Path | None
    reason: str | None = None


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A generated module and where its code came from: `disk` (a verified cached file),
    `written` (rendered now and written to `path`) or `memory` (rendered now, not on disk)."""

    module: types.ModuleType
    origin: str
    path: Path | None


_lock = threading.RLock()
_locations: dict[str, Location] = {}
_directories: dict[tuple[str, str], Path | None] = {}
_warned: set[tuple[str, ...]] = set()


def warn(message: str, *, once: tuple[str, ...] | None = None) -> None:
    """Emit a CacheWarning (only the first time for the same `once` key, when given)."""
    if once is not None:
        with _lock:
            if once in _warned:
                return
            _warned.add(once)
    warnings.warn(message, CacheWarning, stacklevel=3)


def _euid() -> int | None:
    return os.geteuid() if hasattr(os, "geteuid") else None


def _why(e: OSError) -> str:
    return e.strerror or str(e)


def _make_private_dirs(path: Path) -> None:
    """Create `path` and its missing parents, each with mode 0700."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=0o700)


def _problem(path: Path) -> str | None:
    """Create `path` if needed; None if it is a private directory of this user, else why not."""
    try:
        _make_private_dirs(path)
        st = os.stat(path)
    except OSError as e:
        return f"it cannot be created ({_why(e)})"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    euid = _euid()
    if euid is not None:
        if st.st_uid != euid:
            return f"it is owned by another user (uid {st.st_uid})"
        if st.st_mode & 0o022:
            mode = stat.S_IMODE(st.st_mode)
            return f"other users can write to it (mode {mode:o}; `chmod go-w` makes it usable)"
    if not os.access(path, os.W_OK | os.X_OK):
        return "it is not writable"
    return None


def fallback_dir() -> Path | None:
    """The private per-user directory used when the configured one cannot be (None if the
    system has no usable temporary directory)."""
    user = _euid()
    if user is None:
        user = os.environ.get("USERNAME") or "user"
    try:
        return Path(tempfile.gettempdir()) / f"flexfa-{user}"
    except OSError:  # no temporary directory can be written
        return None


def location() -> Location:
    """The cache directory this process uses (checked once per configured path, see
    Note [Disk caches])."""
    configured = config.cache_dir
    token = str(configured)
    loc = _locations.get(token)
    if loc is not None:
        return loc
    with _lock:
        loc = _locations.get(token)
        if loc is None:
            loc = _locations[token] = _resolve(configured)
    return loc


def _resolve(configured: Path) -> Location:
    reason = _problem(configured)
    if reason is None:
        return Location(configured, configured)
    fallback = fallback_dir()
    if fallback is None:
        second = "no usable temporary directory for a private one"
    elif fallback == configured:
        second = "it is also the private fallback"
    else:
        second = _problem(fallback)
        if second is not None:
            second = f"nor {fallback}: {second}"
    if second is None:
        warn(
            f"flexfa: not using the cache directory {configured}: {reason}; "
            f"using the private directory {fallback} instead",
            once=("dir", str(configured)),
        )
        return Location(configured, fallback, reason)
    warn(
        f"flexfa: not using the cache directory {configured}: {reason}; {second}; "
        "generated modules are kept in memory for this process",
        once=("dir", str(configured)),
    )
    return Location(configured, None, reason)


def directory(backend: str) -> Path | None:
    """The directory of one backend's cache (created private), or None for memory only."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown cache backend {backend!r}; expected one of {sorted(BACKENDS)}")
    root = location().path
    if root is None:
        return None
    key = (str(root), backend)
    if key in _directories:
        return _directories[key]
    with _lock:
        if key not in _directories:
            path = root / backend
            reason = _problem(path)
            if reason is not None:
                warn(
                    f"flexfa: not using the cache directory {path}: {reason}; "
                    f"{backend} modules are kept in memory for this process",
                    once=("dir", str(path)),
                )
                path = None
            _directories[key] = path
    return _directories[key]


def forget() -> None:
    """Forget the checked locations (the next use checks again). For tests and `clear`."""
    with _lock:
        _locations.clear()
        _directories.clear()
        _warned.clear()


# -- files ---------------------------------------------------------------------------------------


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically (a private temporary file, then a rename); raises
    OSError. A file where `path`'s directory should be (not a directory, not a link) is removed
    first."""
    parent = path.parent
    with contextlib.suppress(OSError):
        mode = os.lstat(parent).st_mode
        if not stat.S_ISDIR(mode) and not stat.S_ISLNK(mode):
            os.unlink(parent)
    _make_private_dirs(parent)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=_TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            _write_all(f, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_all(f, data: bytes) -> None:
    """The one place file contents are written (tests make it fail half-way)."""
    f.write(data)
    f.flush()


def read_exact(path: Path, size_hint: int | None = None) -> bytes | str | None:
    """The bytes of the regular file `path`; None if it does not exist; else why it cannot be
    used. With `size_hint`, a file of another size is reported without reading it."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    flags |= getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "it is a symbolic link"
        return f"it cannot be read ({_why(e)})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "it is not a regular file"
        if size_hint is not None and st.st_size != size_hint:
            if st.st_size == 0:
                return "it is empty"
            return f"it has {st.st_size} bytes where the generated module has {size_hint}"
        chunks, left = [], st.st_size
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError as e:
        return f"it cannot be read ({_why(e)})"
    finally:
        os.close(fd)


def _discard(path: Path) -> None:
    with contextlib.suppress(OSError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)


# -- generated modules ---------------------------------------------------------------------------


class _SourceLoader:
    """Gives `inspect` and `linecache` the module's source from memory, never from disk."""

    def __init__(self, source: str) -> None:
        self.source = source

    def get_source(self, name: str) -> str:
        return self.source

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:  # pragma: no cover - modules are executed by `run`
        raise ImportError("flexfa generated modules are executed by flexfa.runtime.diskcache")


def run_source(source: str, filename: str, name: str) -> types.ModuleType:
    """Compile and execute `source` as the module `name`, with `filename` in tracebacks; its
    source is served from memory (Note [Disk caches])."""
    loader = _SourceLoader(source)
    spec = importlib.util.spec_from_loader(name, loader, origin=filename)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = filename
    lines = source.splitlines(keepends=True)
    # mtime None: `linecache.checkcache` keeps the entry instead of re-reading the file.
    linecache.cache[filename] = (len(source), None, lines, filename)
    code = compile(source, filename, "exec", dont_inherit=True)
    sys.modules[name] = module  # Triton resolves helper functions through the module's globals
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def source_of(module: types.ModuleType) -> str:
    """The source a module from `load_generated` was executed from."""
    return module.__loader__.get_source(module.__name__)


def _verified(path: Path, expected: bytes) -> bool | str:
    """True if `path` holds exactly `expected`, False if there is no file, else why not."""
    got = read_exact(path, len(expected))
    if got is None:
        return False
    if isinstance(got, str):
        return got
    if got != expected:
        return "its content differs from the module flexfa generates for this key"
    return True


def load_generated(
    backend: str,
    entry: str,
    render: Callable[[], str],
    name: str,
    *,
    key: dict[str, Any] | None = None,
    file_name: str = MODULE_FILE,
) -> Loaded:
    """The module `render()` generates, cached as `<backend>/<entry>/<file_name>`.

    The cached file is used only if it is byte for byte what `render()` returns; anything else
    is discarded with a warning and written again. `key` (JSON data) is written next to it as
    `key.json` for people to read. Failures to read or write are warnings, never errors: the
    module then runs from memory. Threads and processes may load the same entry at once.

    >>> loaded = load_generated("triton", "demo", lambda: "X = 1\n", "demo")  # doctest: +SKIP
    >>> loaded.module.X, loaded.origin                                        # doctest: +SKIP
    (1, 'written')
    """
    source = render()
    data = source.encode()
    root = directory(backend)
    path = root / entry / file_name if root is not None else None
    origin = "memory"
    if path is not None:
        verdict = _verified(path, data)
        if verdict is True:
            origin = "disk"
        else:
            if verdict is not False:
                warn(
                    f"flexfa: discarded the cached module {path}: {verdict}; it was generated again"
                )
                _discard(path)
            if _try_write(path, data):
                origin = "written"
                if key is not None:
                    text = json.dumps(key, indent=1) + "\n"
                    _try_write(path.parent / KEY_FILE, text.encode())
    filename = str(path) if origin != "memory" else f"<flexfa-generated {backend}/{entry}>"
    return Loaded(run_source(source, filename, name), origin, path if origin != "memory" else None)


def _try_write(path: Path, data: bytes) -> bool:
    try:
        atomic_write(path, data)
    except OSError as e:
        warn(
            f"flexfa: cannot write the cache file {path} ({_why(e)}); "
            "keeping generated modules in memory where the disk cache fails",
            once=("write", str(path.parent.parent), str(e.errno)),
        )
        return False
    return True


# -- JSON data (tuning results) ------------------------------------------------------------------


def read_json(backend: str, name: str) -> dict[str, Any] | None:
    """The JSON object in `<backend>/<name>`, or None if there is none; a damaged file (not a
    JSON object) is removed with a warning and None returned."""
    root = directory(backend)
    if root is None:
        return None
    path = root / name
    got = read_exact(path)
    if got is None:
        return None
    reason = got if isinstance(got, str) else None
    if reason is None:
        try:
            value = json.loads(got)
        except ValueError as e:
            reason = f"it is not valid JSON ({e})"
        else:
            if isinstance(value, dict):
                return value
            reason = f"it holds a JSON {type(value).__name__}, not an object"
    warn(f"flexfa: ignored the damaged cache file {path}: {reason}; it will be written again")
    _discard(path)
    return None


def write_json(backend: str, name: str, value: dict[str, Any]) -> bool:
    """Write `value` to `<backend>/<name>` atomically; False (after a warning) if it failed."""
    root = directory(backend)
    if root is None:
        return False
    text = json.dumps(value, indent=1, sort_keys=True) + "\n"
    return _try_write(root / name, text.encode())


# -- info and clear ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    """What one backend's cache holds: module entries, all files, their total size."""

    backend: str
    path: Path | None
    entries: int
    files: int
    bytes: int
    data_files: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """Where the caches are (`location`) and what each backend's holds (`python -m flexfa cache
    info` prints it)."""

    location: Location
    backends: tuple[BackendInfo, ...]

    def as_dict(self) -> dict[str, Any]:
        loc = self.location
        return {
            "configured": str(loc.configured),
            "path": str(loc.path) if loc.path is not None else None,
            "reason": loc.reason,
            "backends": {
                b.backend: {
                    "path": str(b.path) if b.path is not None else None,
                    "entries": b.entries,
                    "files": b.files,
                    "bytes": b.bytes,
                    "data_files": list(b.data_files),
                }
                for b in self.backends
            },
        }


def _scan(backend: str, path: Path | None) -> BackendInfo:
    entries = files = size = 0
    data_files = []
    if path is not None and path.is_dir():
        for child in sorted(path.iterdir()):
            if child.is_symlink():
                continue
            if child.is_dir():
                if any(f.suffix == ".py" and f.is_file() for f in child.iterdir()):
                    entries += 1
                for f in child.rglob("*"):  # fa4/ nests its object files two levels down
                    if f.is_file() and not f.is_symlink():
                        files += 1
                        size += f.stat().st_size
                        entries += f.suffix == ".o"
            elif child.is_file():
                files += 1
                size += child.stat().st_size
                if not child.name.endswith(_TMP_SUFFIX):
                    data_files.append(child.name)
    return BackendInfo(backend, path, entries, files, size, tuple(data_files))


def info() -> CacheInfo:
    """Where the caches are and what they hold, per backend.

    >>> {b.backend: b.entries for b in info().backends}  # doctest: +SKIP
    {'blockmask': 2, 'cute': 0, 'triton': 12}
    """
    loc = location()
    backends = tuple(
        _scan(b, loc.path / b if loc.path is not None else None) for b in sorted(BACKENDS)
    )
    return CacheInfo(loc, backends)


def clear(backends: list[str] | None = None) -> list[Path]:
    """Remove the caches of `backends` (all by default) in the directory in use; returns the
    directories removed. Only flexfa's own subdirectories are touched.

    >>> clear(["blockmask"])  # doctest: +SKIP
    [PosixPath('/home/me/.cache/flexfa/blockmask')]
    """
    names = backends if backends else sorted(BACKENDS)
    for b in names:
        if b not in BACKENDS:
            raise ValueError(f"unknown cache backend {b!r}; expected one of {sorted(BACKENDS)}")
    root = location().path
    removed: list[Path] = []
    if root is None:
        return removed
    for b in names:
        path = root / b
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        removed.append(path)
    with _lock:
        _directories.clear()
    return removed
