"""The routing of FA4's compile caches (Note [FA4 kernels on disk]): only keys that hold a flexfa
hash reach the disk store; everything else stays in FA4's memory cache, as without flexfa."""

from __future__ import annotations

from flexfa.codegen.cute import jitcache
from flexfa.config import config


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
