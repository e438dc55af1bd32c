"""flexfa's disk caches (flexfa/runtime/diskcache.py, Note [Disk caches]): damaged or foreign cache files
are never executed and are healed, unusable or untrusted directories are never fatal, tuning
results survive damage, concurrent writers leave one complete file, and `python -m flexfa cache`.

The tests run as root in CI, where file modes do not stop writes: an unwritable location is made
with a path below a regular file, with a directory of the kernel's virtual file systems where not
even root can create files (skipped where there is none), and by making the write itself fail
(read-only file system, disk full half-way) through `diskcache._write_all`.
"""

from __future__ import annotations

import errno
import io
import json
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import warnings
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

import flexfa
from flexfa import masks as fm
from flexfa.blockmask.block_mask import BlockSize
from flexfa.blockmask.grid import TileGrid, TileList
from flexfa.reference import reference_attention
from flexfa.runtime import diskcache
from tests.tolerance import assert_three_way

pytest.importorskip("triton")
from flexfa.blockmask import exact
from flexfa.codegen.triton import configs as cfgs
from flexfa.codegen.triton import module as tmodule
from flexfa.codegen.triton import plan
from flexfa.codegen.triton.blockmask import exact_triton, fused
from flexfa.codegen.triton.params import BwdConfig, FwdConfig

ROOT = Path(__file__).resolve().parents[1]
_CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the kernels run through Triton's interpreter here"
)


def _forget_memory() -> None:
    """What a new process would not have: loaded modules, plans, tuning results, checked dirs."""
    tmodule.clear_memory_cache()
    plan.plans.clear()
    exact_triton._modules.clear()
    fused.clear_memory_cache()
    cfgs._tuned_files.clear()
    diskcache.forget()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache directory, and a private temporary directory for the fallback."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    root = tmp_path / "cache"
    with flexfa.config.override(cache_dir=str(root)):
        _forget_memory()
        yield root
    _forget_memory()


def _cache_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, diskcache.CacheWarning)]


# -- the three generated-module caches -----------------------------------------------------------


def _attention() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=g) for _ in range(3))
    score_mod, mask_mod = flexfa.mods.softcap(20.0), fm.causal
    out = flexfa.attention(q, k, v, score_mod=score_mod, block_mask=mask_mod, backend="triton")
    ref, _ = reference_attention(q, k, v, score_mod, mask_mod)
    eager, _ = reference_attention(q, k, v, score_mod, mask_mod, dtype=torch.float32)
    assert_three_way("out", out, eager, ref, atol=1e-5)


def _exact() -> None:
    doc = torch.tensor([0] * 9 + [1] * 20 + [2] * 11, dtype=torch.int32)
    traced = flexfa.trace_mask_mod(fm.and_masks(fm.causal, fm.document(doc)))
    grid = TileGrid(1, 1, 40, 40, BlockSize.of(16), _CPU)
    tiles = TileList.where(torch.ones(grid.shape, dtype=torch.bool))
    got = exact_triton.classify_tiles(traced, grid, tiles)
    assert torch.equal(got, exact.classify_tiles(traced, grid, tiles))


def _fused() -> None:
    traced = flexfa.trace_mask_mod(fm.sliding_window(20))
    grid = TileGrid(1, 1, 64, 48, BlockSize.of(16), _CPU)
    got = fused.build(traced, grid)
    assert got is not None
    with flexfa.config.override(fused_block_mask="off"):
        want = flexfa.create_block_mask(fm.sliding_window(20), 1, 1, 64, 48, BLOCK_SIZE=16)
    for name in ("kv_partial", "kv_full", "q_partial", "q_full"):
        g, w = getattr(got, name), getattr(want, name)
        assert torch.equal(g.count, w.count), name
        listed = torch.arange(g.index.shape[-1]) < g.count[..., None]
        assert torch.equal(g.index[listed], w.index[listed]), name


def _load_attention() -> None:
    score = flexfa.trace_score_mod(flexfa.mods.softcap(20.0))
    tmodule.load_module(score, flexfa.trace_mask_mod(fm.causal), frozenset())


def _load_exact() -> None:
    doc = torch.tensor([0] * 9 + [1] * 20 + [2] * 11, dtype=torch.int32)
    exact_triton.load_kernel(flexfa.trace_mask_mod(fm.and_masks(fm.causal, fm.document(doc))))


# Each cache: a call that uses its module and checks the result, a cheaper one that only loads
# the module (None: the call is the only way), and where its module file lives.
KINDS = {
    "attention": (_attention, _load_attention, "triton/*/kernels.py"),
    "exact": (_exact, _load_exact, "blockmask/[!l]*/kernels.py"),
    "fused": (_fused, _fused, "blockmask/lists_*/kernels.py"),
}


def _module_file(root: Path, kind: str) -> Path:
    files = list(root.glob(KINDS[kind][2]))
    assert len(files) == 1, files
    return files[0]


def _damage(path: Path, how: str, marker: Path) -> str:
    """Damage the cached module at `path`; returns the reason the warning must give."""
    original = path.read_bytes()
    foreign = f"open({str(marker)!r}, 'w').write('foreign code ran')\n".encode()
    if how == "garbage":
        path.write_bytes(b"def (\x00\xff not python")
        return "bytes where the generated module has"
    if how == "empty":
        path.write_bytes(b"")
        return "it is empty"
    if how == "truncated":
        path.write_bytes(original[: len(original) // 2])
        return "bytes where the generated module has"
    if how == "foreign":  # working kernels plus code of someone else's
        path.write_bytes(original + foreign)
        return "bytes where the generated module has"
    if how == "foreign_same_size":  # only the content comparison can tell
        padding = len(original) - len(foreign) - 2
        path.write_bytes(foreign + b"#" + b"x" * padding + b"\n")
        assert path.stat().st_size == len(original)
        return "its content differs"
    if how == "symlink":  # even to the right bytes: a link in the cache is not flexfa's
        target = path.parent.parent / "elsewhere.py"
        target.write_bytes(original)
        path.unlink()
        path.symlink_to(target)
        return "symbolic link"
    if how == "directory":
        path.unlink()
        path.mkdir()
        return "not a regular file"
    if how == "entry_is_a_file":  # the module's directory replaced by a file
        for f in path.parent.iterdir():
            f.unlink()
        path.parent.rmdir()
        path.parent.write_bytes(original)
        return "Not a directory"
    raise AssertionError(how)


DAMAGE = (
    "garbage",
    "empty",
    "truncated",
    "foreign",
    "foreign_same_size",
    "symlink",
    "directory",
    "entry_is_a_file",
)
CASES = [("attention", how) for how in DAMAGE] + [
    (kind, how) for kind in ("exact", "fused") for how in ("truncated", "foreign_same_size")
]


@pytest.mark.parametrize(("kind", "how"), CASES)
def test_damaged_or_foreign_module_is_discarded_and_regenerated(cache, tmp_path, kind, how):
    run, load, _ = KINDS[kind]
    load()
    path = _module_file(cache, kind)
    good = path.read_bytes()
    marker = tmp_path / "marker"
    reason = _damage(path, how, marker)
    _forget_memory()  # a new process
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run()
    assert not marker.exists(), "flexfa executed a cache file it did not write"
    messages = _cache_warnings(record)
    assert len(messages) == 1, messages
    assert str(path) in messages[0] and reason in messages[0], messages[0]
    assert not path.is_symlink() and path.read_bytes() == good  # healed
    _forget_memory()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        load()  # the healed file is used without a word
    assert _cache_warnings(record) == []
    assert not marker.exists()


def test_what_runs_is_what_was_checked(cache, tmp_path, monkeypatch):
    """A file replaced between the check and the execution is not what runs: the checked bytes
    are executed, and Triton reads the kernels' source from them, not from the disk."""
    _load_attention()
    path = _module_file(cache, "attention")
    good = path.read_text()
    marker = tmp_path / "marker"
    real = diskcache._verified

    def check_then_swap(p, expected):
        verdict = real(p, expected)
        p.write_text(f"open({str(marker)!r}, 'w').write('swapped')\n" + good)
        return verdict

    monkeypatch.setattr(diskcache, "_verified", check_then_swap)
    _forget_memory()
    _attention()
    assert not marker.exists()
    module = next(m for m in tmodule._modules.values())
    import inspect

    assert inspect.getsource(module.flexfa_fwd.fn) in good
    assert "swapped" not in inspect.getsource(module)


def test_triton_jit_reads_the_source_of_a_module_kept_in_memory(monkeypatch):
    """Without a file, `@triton.jit` (compiled, as on a GPU) still gets the kernel's source."""
    import triton

    source = textwrap.dedent(
        """\
        import triton
        import triton.language as tl


        @triton.jit
        def fill(x, N: tl.constexpr):
            tl.store(x + tl.arange(0, N), 1.0)
        """
    )
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    module = diskcache.run_source(source, "<flexfa-generated test/fill>", "flexfa_test_fill")
    try:
        assert isinstance(module.fill, triton.runtime.jit.JITFunction)
        assert module.fill.src.startswith("def fill(x, N: tl.constexpr):")
        assert module.fill.starting_line_number == 5  # its decorator line
    finally:
        sys.modules.pop("flexfa_test_fill", None)


# -- unusable and untrusted locations ------------------------------------------------------------


def _fallback(tmp_path) -> Path:
    return tmp_path / "tmp" / f"flexfa-{os.geteuid()}"


@pytest.mark.parametrize("where", ["regular_file", "below_a_regular_file"])
def test_unusable_path_falls_back_to_a_private_directory(cache, tmp_path, where):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file")
    target = blocker if where == "regular_file" else blocker / "cache"
    with (
        flexfa.config.override(cache_dir=str(target)),
        warnings.catch_warnings(record=True) as record,
    ):
        warnings.simplefilter("always")
        _attention()
        _load_exact()
    messages = _cache_warnings(record)
    assert len(messages) == 1, messages
    assert str(target) in messages[0] and str(_fallback(tmp_path)) in messages[0]
    assert blocker.read_text() == "a file"
    assert _module_file(_fallback(tmp_path), "attention").is_file()
    assert stat.S_IMODE(_fallback(tmp_path).stat().st_mode) == 0o700


def test_nothing_usable_keeps_modules_in_memory(cache, tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file")
    monkeypatch.setattr(tempfile, "tempdir", str(blocker))  # the fallback is blocked too
    with (
        flexfa.config.override(cache_dir=str(blocker / "cache")),
        warnings.catch_warnings(record=True) as record,
    ):
        warnings.simplefilter("always")
        _attention()
        _load_exact()
        exported = flexfa.export.export_module(flexfa.mods.softcap(20.0), fm.causal)
    messages = _cache_warnings(record)
    assert len(messages) == 1 and "kept in memory" in messages[0], messages
    assert exported.path is None and "def score_mod_softcap" in exported.source


def _unwritable_system_dir() -> Path | None:
    """A directory of this user's where even root cannot create a file (sysfs, procfs)."""
    for candidate in ("/sys", "/proc/self"):
        path = Path(candidate).resolve()
        try:
            st = path.stat()
        except OSError:
            continue
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            continue
        try:
            (path / "flexfa-probe").mkdir()
        except OSError:
            return path
        (path / "flexfa-probe").rmdir()
    return None


def test_a_directory_nobody_can_write_is_not_fatal(cache):
    """A real one: a trusted directory where creating anything fails, even for root."""
    path = _unwritable_system_dir()
    if path is None:
        pytest.skip("no directory here refuses writes to this user")
    with (
        flexfa.config.override(cache_dir=str(path)),
        warnings.catch_warnings(record=True) as record,
    ):
        warnings.simplefilter("always")
        _load_attention()
    assert len(_cache_warnings(record)) >= 1
    assert all(str(path) in m for m in _cache_warnings(record))


@pytest.mark.parametrize("error", [errno.EROFS, errno.ENOSPC])
def test_failing_writes_are_not_fatal_and_leave_no_partial_file(cache, monkeypatch, error):
    """A read-only file system refuses the write; a full disk stops it half-way."""

    def fail(f, data):
        if error == errno.ENOSPC:
            f.write(data[: len(data) // 2])
            f.flush()
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(diskcache, "_write_all", fail)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _attention()
        _load_exact()
    messages = _cache_warnings(record)
    # One warning per backend directory whose writes fail.
    assert len(messages) == 2, messages
    assert all(os.strerror(error) in m for m in messages)
    leftovers = [p for p in cache.rglob("*") if p.is_file()]
    assert leftovers == [], leftovers
    monkeypatch.undo()
    _forget_memory()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _load_attention()  # writes work again: the cache fills
    assert _cache_warnings(record) == []
    assert _module_file(cache, "attention").is_file()


@pytest.mark.parametrize("how", ["group_writable", "world_writable", "other_owner"])
def test_untrusted_directory_is_not_used(cache, tmp_path, monkeypatch, how):
    shared = tmp_path / "shared"
    shared.mkdir()
    if how == "group_writable":
        shared.chmod(0o770)
    elif how == "world_writable":
        shared.chmod(0o777)
    elif os.geteuid() == 0:
        os.chown(shared, 65534, 65534)
    else:  # pragma: no cover - CI runs as root
        monkeypatch.setattr(diskcache, "_euid", lambda: os.geteuid() + 1)
    with (
        flexfa.config.override(cache_dir=str(shared)),
        warnings.catch_warnings(record=True) as record,
    ):
        warnings.simplefilter("always")
        _attention()
        _load_attention()
    messages = _cache_warnings(record)
    assert len(messages) == 1, messages
    assert str(shared) in messages[0]
    assert ("owned by another user" if how == "other_owner" else "can write") in messages[0]
    assert list(shared.iterdir()) == []
    if how != "other_owner":
        assert _module_file(_fallback(tmp_path), "attention").is_file()


def test_a_fallback_directory_someone_else_made_is_not_used(cache, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    planted = _fallback(tmp_path)
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)  # made by someone else, for everyone
    with (
        flexfa.config.override(cache_dir=str(shared)),
        warnings.catch_warnings(record=True) as record,
    ):
        warnings.simplefilter("always")
        _load_attention()
    messages = _cache_warnings(record)
    assert len(messages) == 1 and "kept in memory" in messages[0], messages
    assert list(planted.iterdir()) == [] and list(shared.iterdir()) == []


def test_created_directories_and_files_are_private(cache):
    nested = cache / "a" / "b"
    with flexfa.config.override(cache_dir=str(nested)):
        _load_attention()
        for d in (cache, cache / "a", nested, nested / "triton"):
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        assert stat.S_IMODE(_module_file(nested, "attention").stat().st_mode) == 0o600


# -- tuning results ------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]", b"\xff\xfe"])
def test_damaged_tuning_file_is_ignored_and_rewritten(cache, content):
    path = cache / "triton" / cfgs.TUNING_FILE
    path.parent.mkdir(parents=True, mode=0o700)
    path.write_bytes(content)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert cfgs.load_tuned("some key") is None
    messages = _cache_warnings(record)
    assert len(messages) == 1 and str(path) in messages[0], messages
    tuned = cfgs.KernelConfigs(FwdConfig(64, 32, 4, 2), BwdConfig(32, 32, 32, 32, 4, 1))
    cfgs.store_tuned("some key", tuned)
    assert json.loads(path.read_text())["some key"]["fwd"]["block_m"] == 64
    _forget_memory()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert cfgs.load_tuned("some key") == tuned
    assert _cache_warnings(record) == []


def test_invalid_tuning_entry_is_ignored_with_a_warning(cache):
    path = cache / "triton" / cfgs.TUNING_FILE
    path.parent.mkdir(parents=True, mode=0o700)
    good = {"fwd": {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}}
    good["bwd"] = {"block_m1": 32, "block_n1": 32, "block_m2": 32, "block_n2": 32}
    bad = {"fwd": {"block_m": 3}, "bwd": {}}
    path.write_text(json.dumps({"good": good, "bad": bad}))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert cfgs.load_tuned("bad") is None
        assert cfgs.load_tuned("good").fwd == FwdConfig(64, 32, 4, 2)
    messages = _cache_warnings(record)
    assert len(messages) == 1 and "'bad'" not in messages[0] and "bad" in messages[0]


# -- concurrency ---------------------------------------------------------------------------------


_CHILD = textwrap.dedent(
    """
    import json, os, sys, time, warnings, torch, flexfa
    from flexfa.codegen.triton import module
    ready, go = sys.argv[1], sys.argv[2]
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.005)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=g) for _ in range(3))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = flexfa.attention(q, k, v, score_mod=flexfa.mods.softcap(7.0),
                               block_mask=flexfa.masks.causal, backend="triton")
    cache_warnings = [str(w.message) for w in record
                      if issubclass(w.category, flexfa.runtime.diskcache.CacheWarning)]
    print(json.dumps({"out": out.flatten().tolist(), "warnings": cache_warnings}))
    """
)


def test_four_processes_compile_the_same_new_module_at_once(cache, tmp_path):
    env = dict(os.environ, FLEXFA_CACHE_DIR=str(cache), TRITON_INTERPRET="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    go = tmp_path / "go"
    procs, ready = [], []
    for i in range(4):
        ready.append(tmp_path / f"ready{i}")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(ready[-1]), str(go)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        for r in ready:  # all four have imported everything: start them together
            while not r.exists():
                assert all(p.poll() is None for p in procs), "a child died while starting"
                threading.Event().wait(0.01)
        go.touch()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=g) for _ in range(3))
    ref, _ = reference_attention(q, k, v, flexfa.mods.softcap(7.0), fm.causal)
    eager, _ = reference_attention(
        q, k, v, flexfa.mods.softcap(7.0), fm.causal, dtype=torch.float32
    )
    for r in results:
        assert r["warnings"] == []
        out = torch.tensor(r["out"]).view(ref.shape)
        assert_three_way("out", out, eager, ref, atol=1e-5)
    files = sorted(p.relative_to(cache) for p in cache.rglob("*") if p.is_file())
    assert sorted(f.name for f in files) == ["kernels.py", "key.json"], files  # no temporaries
    score = flexfa.trace_score_mod(flexfa.mods.softcap(7.0))
    mask = flexfa.trace_mask_mod(fm.causal)
    source = next(f for f in files if f.name == "kernels.py")
    assert (cache / source).read_text() == tmodule.render(score, mask, frozenset())


def test_threads_writing_one_entry_all_get_the_module(cache):
    source = "VALUE = 42\n" + "# padding\n" * 2000
    results, errors = [], []
    start = threading.Barrier(8)

    def load(i):
        try:
            start.wait()
            loaded = diskcache.load_generated("blockmask", "threads", lambda: source, f"m{i}")
            results.append(loaded.module.VALUE)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and results == [42] * 8
    files = [p.name for p in (cache / "blockmask" / "threads").iterdir()]
    assert files == ["kernels.py"]
    assert (cache / "blockmask" / "threads" / "kernels.py").read_text() == source


# -- python -m flexfa cache ----------------------------------------------------------------------


def _cli(*args: str) -> str:
    from flexfa.__main__ import main

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["cache", *args]) == 0
    return buf.getvalue()


def test_cache_info_and_clear(cache):
    _load_attention()
    _load_exact()
    cfgs.store_tuned("k", cfgs.KernelConfigs(FwdConfig(), BwdConfig()))
    info = json.loads(_cli("info", "--json"))
    assert info["path"] == str(cache) and info["reason"] is None
    assert info["backends"]["triton"]["entries"] == 1
    assert info["backends"]["triton"]["data_files"] == ["tuning.json"]
    assert info["backends"]["blockmask"]["entries"] == 1
    assert info["backends"]["cute"]["entries"] == 0
    size = sum(p.stat().st_size for p in (cache / "triton").rglob("*") if p.is_file())
    assert info["backends"]["triton"]["bytes"] == size
    text = _cli("info")
    assert str(cache) in text and "triton" in text and "blockmask" in text
    out = _cli("clear", "--backend", "blockmask")
    assert str(cache / "blockmask") in out
    assert not (cache / "blockmask").exists() and (cache / "triton").is_dir()
    _cli("clear")
    assert not (cache / "triton").exists()
    info = json.loads(_cli("info", "--json"))
    assert all(b["files"] == 0 for b in info["backends"].values())
    _forget_memory()
    _load_attention()  # a cleared cache fills again
    assert _module_file(cache, "attention").is_file()


def test_cache_clear_rejects_unknown_backends(cache):
    from flexfa.__main__ import main

    with pytest.raises(SystemExit):
        main(["cache", "clear", "--backend", "everything"])
