"""The routing of FA4's compile caches (Note [FA4 kernels on disk]): only keys that hold a flexfa
hash reach the disk store; everything else stays in FA4's memory cache, as without flexfa."""

from __future__ import annotations

import sys
import types

import pytest

from flexfa.codegen.cute import jitcache
from flexfa.config import config
from flexfa.runtime.diskcache import CacheWarning


class Store(dict):
    """Stands in for FA4's JITCache / JITPersistentCache (a mapping)."""

    cache = "inner"


def test_flexfa_keys_go_to_disk_and_others_stay_in_memory():
    memory, disk = Store(), Store()
    routed = jitcache._Routed(memory, disk)
    ours = ("bf16", 128, "flexfa-0123-SCORE_MOD", False, 90)
    theirs = ("bf16", 128, "a1b2c3", False, 90)
    routed[ours] = "k1"
    routed[theirs] = "k2"
    assert memory == {ours: "k1", theirs: "k2"} and disk == {ours: "k1"}
    assert routed.cache == "inner"  # FA4's own attributes pass through

    memory.clear()  # a new process: only the disk store remains
    assert ours in routed and routed[ours] == "k1" and memory[ours] == "k1"
    assert theirs not in routed


def test_turned_off_it_neither_reads_nor_writes_the_disk():
    memory, disk = Store(), Store()
    routed = jitcache._Routed(memory, disk)
    key = ("flexfa-0123-MASK_MOD", 64)
    disk[key] = "old"
    with config.override(fa4_disk_cache=False):
        assert key not in routed
        routed[key] = "new"
    assert disk[key] == "old" and memory[key] == "new"


def test_tag_sets_the_hash_fa4_keys_by():
    def hook():
        pass

    jitcache.tag(hook, "ab" * 32, "SCORE_MOD")
    assert hook.__cute_hash__ == "flexfa-" + "ab" * 16 + "-SCORE_MOD"
    jitcache.tag(None, "ab" * 32, "MASK_MOD")  # an unused hook is skipped


def _fake_fa4(monkeypatch, fingerprint):
    """flash_attn.cute's cache_utils and interface as `install` uses them (nothing imported)."""
    utils = types.SimpleNamespace(
        CUTE_DSL_CACHE_ENABLED=False,
        _compute_source_fingerprint=fingerprint,
        JITPersistentCache=lambda path: Store(),
    )
    fwd, bwd = (
        types.SimpleNamespace(compile_cache=Store()),
        types.SimpleNamespace(compile_cache=Store()),
    )
    interface = types.SimpleNamespace(_flash_attn_fwd=fwd, _flash_attn_bwd=bwd)
    package = types.ModuleType("flash_attn.cute")
    package.cache_utils, package.interface = utils, interface
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", package)
    return fwd, bwd


def test_install_wraps_fa4s_caches_once(monkeypatch, tmp_path):
    fwd, bwd = _fake_fa4(monkeypatch, lambda: "ab" * 32)
    jitcache.reset()
    with config.override(cache_dir=str(tmp_path)):
        try:
            jitcache.install()
            jitcache.install()
            assert isinstance(fwd.compile_cache, jitcache._Routed)
            assert isinstance(bwd.compile_cache, jitcache._Routed)
            assert not isinstance(fwd.compile_cache.memory, jitcache._Routed)
        finally:
            jitcache._installed = False


def test_fa4_internals_that_changed_leave_the_caches_in_memory(monkeypatch, tmp_path):
    """An FA4 without the pieces `install` uses: a warning, and FA4's caches in memory."""

    def missing():
        raise AttributeError("module 'cache_utils' has no attribute '_compute_source_fingerprint'")

    fwd, _ = _fake_fa4(monkeypatch, missing)
    jitcache.reset()
    with config.override(cache_dir=str(tmp_path)):
        try:
            with pytest.warns(CacheWarning, match="FA4 kernels stay in memory"):
                jitcache.install()
            # Wrapped for recording only (Note [Direct FA4 launches]): nothing goes to disk.
            assert isinstance(fwd.compile_cache, jitcache._Routed)
            assert fwd.compile_cache.disk is None
            assert isinstance(fwd.compile_cache.memory, Store)
        finally:
            jitcache._installed = False
