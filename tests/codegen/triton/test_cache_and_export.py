"""Compile cache keys, the on-disk module cache across processes, source export and the CLI,
golden snapshots of generated code, and compiling for sm_90 without a GPU."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import flexfa
from flexfa.codegen.triton import module as tmodule
from flexfa.codegen.triton.params import BwdConfig, FwdConfig, KernelKey, ModuleKey
from flexfa.frontend import trace_mask_mod, trace_score_mod
from tests.codegen import common

GOLDEN = Path(__file__).parent / "golden"
ROOT = Path(__file__).resolve().parents[3]


def _module_key(**changes) -> ModuleKey:
    base = ModuleKey(
        score_mod="score_mod:alibi:abc",
        mask_mod="mask_mod:causal:def",
        grad_slots=(0,),
        templates="t",
        flexfa_version="1",
        triton_version="3",
        torch_version="2",
    )
    return dataclasses.replace(base, **changes)


def test_every_module_key_field_changes_the_digest():
    base = _module_key()
    variants = {
        "score_mod": "score_mod:alibi:xyz",
        "mask_mod": None,
        "grad_slots": (),
        "templates": "u",
        "flexfa_version": "2",
        "triton_version": "3.6.0",
        "torch_version": "2.11",
    }
    assert set(variants) == {f.name for f in dataclasses.fields(ModuleKey)}
    for field, value in variants.items():
        assert _module_key(**{field: value}).digest != base.digest, field


def test_every_kernel_key_field_changes_the_digest():
    base = KernelKey(_module_key(), "fwd", "bfloat16", 128, 128, FwdConfig(), (("EVEN_M", True),))
    variants = {
        "module": _module_key(torch_version="9"),
        "kernel": "bwd_dq",
        "dtype": "float16",
        "head_dim": 64,
        "head_dim_v": 64,
        "config": FwdConfig(block_m=64),
        "constexprs": (("EVEN_M", False),),
    }
    assert set(variants) == {f.name for f in dataclasses.fields(KernelKey)}
    for field, value in variants.items():
        assert dataclasses.replace(base, **{field: value}).digest != base.digest, field
    assert dataclasses.replace(base, config=BwdConfig()).digest != base.digest


def test_ir_decides_the_key_not_source_text():
    def soft_a(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    def soft_b(score, b, h, q_idx, kv_idx):
        capped = torch.tanh(score / 30.0)  # same computation, written differently
        return capped * 30.0

    a = tmodule.module_key(trace_score_mod(soft_a), None, frozenset())
    b = tmodule.module_key(trace_score_mod(soft_a), None, frozenset())
    assert a == b
    # A closed-over float is a lifted scalar, a kernel argument: another cap is the same key.
    c = tmodule.module_key(trace_score_mod(flexfa.mods.softcap(20.0)), None, frozenset())
    d = tmodule.module_key(trace_score_mod(flexfa.mods.softcap(30.0)), None, frozenset())
    assert c == d
    # The mod's name appears in the generated source, so it is part of the key.
    e = tmodule.module_key(trace_score_mod(soft_b), None, frozenset())
    assert e.score_mod.split(":")[1] == "soft_b" and e != a


def test_memory_then_disk_then_render(cache_dir):
    score = trace_score_mod(flexfa.mods.softcap(30.0))
    mask = trace_mask_mod(flexfa.masks.causal)
    before = dataclasses.replace(tmodule.stats)
    key, _ = tmodule.load_module(score, mask, frozenset())
    tmodule.load_module(score, mask, frozenset())
    assert tmodule.stats.renders == before.renders + 1
    assert tmodule.stats.memory_hits == before.memory_hits + 1
    tmodule.clear_memory_cache()
    tmodule.load_module(score, mask, frozenset())
    assert tmodule.stats.disk_hits == before.disk_hits + 1
    files = sorted(p.name for p in tmodule.module_dir(key).iterdir())
    assert files == ["kernels.py", "key.json"]
    assert (
        json.loads((tmodule.module_dir(key) / "key.json").read_text())["score_mod"] == key.score_mod
    )


_CHILD = textwrap.dedent(
    """
    import json, torch, flexfa
    from flexfa.codegen.triton import module
    q = torch.randn(1, 2, 32, 16, generator=torch.Generator().manual_seed(0))
    out = flexfa.attention(q, q, q, score_mod=flexfa.mods.alibi, block_mask=flexfa.masks.causal,
                           backend="triton")
    print(json.dumps({"writes": module.stats.writes, "disk_hits": module.stats.disk_hits,
                      "sum": float(out.sum())}))
    """
)


def test_a_second_process_reuses_the_generated_module(tmp_path):
    env = dict(os.environ, FLEXFA_CACHE_DIR=str(tmp_path / "cache"), TRITON_INTERPRET="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    runs = []
    for _ in range(2):
        res = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300
        )
        assert res.returncode == 0, res.stderr[-2000:]
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    assert runs[0]["writes"] == 1 and runs[0]["disk_hits"] == 0
    assert runs[1]["writes"] == 0 and runs[1]["disk_hits"] == 1
    assert runs[0]["sum"] == runs[1]["sum"]


def test_export_source_names_the_users_functions():
    table = torch.randn(4, 65, requires_grad=True)

    def my_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(q_idx - kv_idx, -32, 32) + 32]

    src = flexfa.export_source(my_bias, flexfa.masks.sliding_window(128))
    assert "def score_mod_my_bias(" in src
    assert "def score_mod_my_bias_bwd(" in src
    assert "def mask_mod_sliding_window(" in src
    assert "table_grad_ptr" in src  # the learnable table gets a gradient scatter
    assert "tl.atomic_add" in src
    assert src.startswith("# Generated by flexfa")
    no_grad = flexfa.export_source(my_bias, flexfa.masks.sliding_window(128), grad_captures=False)
    assert "table_grad_ptr" not in no_grad
    with pytest.raises(ValueError, match="num_heads"):
        flexfa.export_source(flexfa.mods.alibi)


def test_cli_export_writes_the_module(tmp_path):
    from flexfa.__main__ import main

    mods = tmp_path / "my_mods.py"
    mods.write_text(
        "import torch\n"
        "def shifted(score, b, h, q_idx, kv_idx):\n"
        "    return score - 0.01 * torch.abs(q_idx - kv_idx)\n"
    )
    out = tmp_path / "out"
    assert (
        main(["export", f"{mods}:shifted", "--mask", "sliding_window(64)", "--out", str(out)]) == 0
    )
    text = (out / "kernels.py").read_text()
    assert "def score_mod_shifted(" in text and "def mask_mod_sliding_window(" in text
    assert json.loads((out / "key.json").read_text())["mask_mod"].startswith(
        "mask_mod:sliding_window:"
    )
    assert (
        main(
            [
                "export",
                "alibi",
                "--mask",
                "causal",
                "--num-heads",
                "8",
                "--out",
                str(tmp_path / "o2"),
            ]
        )
        == 0
    )
    assert "def score_mod_alibi(" in (tmp_path / "o2" / "kernels.py").read_text()


def _golden_cases():
    return common.golden_cases(sliding_window=flexfa.masks.sliding_window(256))


@pytest.mark.parametrize("name", sorted(_golden_cases()))
def test_golden_generated_source(name):
    """The generated module, byte for byte. After an intended change, regenerate with
    FLEXFA_UPDATE_GOLDEN=1 pytest tests/codegen/triton -k golden, and review the diff."""
    score_mod, mask_mod = _golden_cases()[name]
    src = flexfa.export_source(score_mod, mask_mod)
    common.check_golden(src, GOLDEN / f"{name}.py.txt", name, "see the module docstring")


_COMPILE_CHILD = textwrap.dedent(
    """
    import json, torch, flexfa
    from flexfa.export import compile_call
    table = torch.zeros(4, 65, requires_grad=True)
    q = torch.empty(1, 4, 256, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(1, 2, 256, 64, dtype=torch.bfloat16, requires_grad=True)
    kernels = compile_call(
        q, k, k, flexfa.mods.relative_bias(table), flexfa.masks.causal, enable_gqa=True, arch=90
    )
    print(json.dumps({
        name: {"shared": k.metadata.shared,
               "sm90": ".target sm_90" in k.asm["ptx"],
               "wgmma": "wgmma" in k.asm["ptx"]}
        for name, k in kernels.items()
    }))
    """
)


def test_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    # In its own process: Triton's interpreter, which other tests run, patches triton.language
    # in place, and a real compile cannot share a process with it.
    env = dict(os.environ, FLEXFA_CACHE_DIR=str(tmp_path / "cache"), TRITON_INTERPRET="0")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(
        [sys.executable, "-c", _COMPILE_CHILD], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    kernels = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(kernels) == {"fwd", "bwd_preprocess", "bwd_dkdv", "bwd_dq"}
    for name, info in kernels.items():
        assert info["sm90"], name
        assert info["shared"] <= 227 * 1024, f"{name} needs {info['shared']} B of shared memory"
    # The attention matmuls run on the tensor cores (wgmma on sm_90).
    assert kernels["fwd"]["wgmma"] and kernels["bwd_dq"]["wgmma"]


_GATHER_CHILD = textwrap.dedent(
    """
    import json, torch, flexfa
    from flexfa.export import compile_call

    N = 256
    rel = torch.zeros(4, 2 * N + 1, requires_grad=True)      # float32, learnable
    rel16 = torch.zeros(4, 2 * N + 1, dtype=torch.bfloat16)   # bfloat16, frozen
    buckets = torch.zeros(N, N, dtype=torch.int32)            # an int32 index table
    weights = torch.zeros(64)
    allowed = torch.ones(N, N, dtype=torch.bool)              # bool: read with tl.load
    cases = {
        "float32": lambda s, b, h, q, kv: s + rel[h, q - kv + N],
        "bfloat16": lambda s, b, h, q, kv: s + rel16[h, q - kv + N],
        "int64_offsets": lambda s, b, h, q, kv: s + rel16[h, (q - kv + N).to(torch.int64)],
        "int32_index": lambda s, b, h, q, kv: s + weights[buckets[q, kv] % 64],
        "bool": lambda s, b, h, q, kv: torch.where(allowed[q, kv], s, -float("inf")),
    }
    out = {}
    for name, mod in cases.items():
        q = torch.empty(1, 4, N, 64, dtype=torch.bfloat16, requires_grad=True)
        kernels = compile_call(q, q, q, mod, flexfa.masks.causal, arch=90)
        out[name] = {
            k: {"shared": c.metadata.shared, "nc": c.asm["ptx"].count("ld.global.nc")}
            for k, c in kernels.items()
        }
    print(json.dumps(out))
    """
)


def test_per_pair_gathers_compile_to_plain_loads(tmp_path):
    """Per-pair loads of 16- and 32-bit tables are read with ld.global.nc in every attention kernel
    (Note [Per-pair gathers] in flexfa/codegen/triton/emit.py); bool tables keep tl.load. All fit
    in shared memory. The GPU suite runs the same kernels against the reference."""
    from tests.child import run_json

    found = run_json(_GATHER_CHILD, tmp_path)
    for case, kernels in found.items():
        for name, info in kernels.items():
            assert info["shared"] <= 227 * 1024, (
                f"{case} {name}: {info['shared']} B of shared memory"
            )
            if name == "bwd_preprocess":
                continue
            if case == "bool":
                assert info["nc"] == 0, f"{case} {name} reads a bool table with inline PTX: {info}"
            else:
                assert info["nc"] > 0, f"{case} {name} gathers through tl.load: {info}"
    # Two per-pair gathers (the index table, then the weights it indexes) read twice as much.
    assert found["int32_index"]["fwd"]["nc"] == 2 * found["float32"]["fwd"]["nc"]
