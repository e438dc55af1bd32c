"""Compile-only: FA4's forward and backward kernels with flexfa's generated hooks, for sm_90a and
sm_100a, on a machine without a GPU (`python -m flexfa export ... --backend fa4`). The PTX must
hold the arch's tensor-core instructions: wgmma on Hopper, tcgen05.mma on Blackwell.

Each compile runs in a fresh process: the CuTe DSL fixes its arch once per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexfa.backends.fa4 import missing_package

ROOT = Path(__file__).resolve().parents[3]
MMA = {"sm_90a": "wgmma.mma_async", "sm_100a": "tcgen05.mma"}
SASS_MMA = {"sm_90a": "HGMMA", "sm_100a": "UTCHMMA"}  # the same instructions in SASS

pytestmark = pytest.mark.skipif(missing_package() is not None, reason=str(missing_package()))


def run_child(tmp_path: Path, cmd: list[str]) -> subprocess.CompletedProcess:
    """Run a compile in its own process, with its own cache and Triton's real compiler."""
    env = dict(os.environ, FLEXFA_CACHE_DIR=str(tmp_path / "cache"), TRITON_INTERPRET="0")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    return res


def export(tmp_path: Path, arch: str, mod: str, mask: str, extra: tuple[str, ...] = ()) -> dict:
    out = tmp_path / arch
    cmd = [sys.executable, "-m", "flexfa", "export", mod, "--mask", mask, "--backend", "fa4"]
    cmd += ["--arch", arch, "--out", str(out), "--num-heads", "4", *extra]
    run_child(tmp_path, cmd)
    report = json.loads((out / f"compile_{arch}.json").read_text())
    ptx = {name: (out / f"ptx_{arch}" / name).read_text() for name in report["ptx"]}
    return {"report": report, "ptx": ptx, "mods": (out / "mods.py").read_text()}


def kernel(ptx: dict[str, str], which: str) -> str:
    (text,) = [t for name, t in ptx.items() if which in name]
    return text


# CI compiles for sm_100a (nothing here can run it); sm_90a is compiled and run on the GPU tests.
@pytest.mark.parametrize("arch", [pytest.param("sm_90a", marks=pytest.mark.slow), "sm_100a"])
def test_alibi_causal_compiles_forward_and_backward(tmp_path, arch):
    got = export(tmp_path, arch, "alibi", "causal")
    assert got["report"]["lowering"].startswith("causal: proven")
    fwd, bwd = kernel(got["ptx"], "flash_fwd"), kernel(got["ptx"], "flash_bwd_sm")
    for text in (fwd, bwd):
        assert f".target {arch}" in text
        assert MMA[arch] in text
    assert "def score_mod_alibi(" in got["mods"] and "def score_mod_bwd_alibi(" in got["mods"]
    # SASS beside the PTX (cuobjdump from Triton's package), for the forward and the backward.
    from flexfa.codegen.cute.offline import _cuobjdump

    if _cuobjdump() is not None:
        sass = {n: (tmp_path / arch / f"ptx_{arch}" / n).read_text() for n in got["report"]["sass"]}
        assert SASS_MMA[arch] in kernel(sass, "flash_fwd")
        assert SASS_MMA[arch] in kernel(sass, "flash_bwd_sm")


MODS = ROOT / "tests" / "codegen" / "cute" / "compile_mods.py"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_captured_gradients_and_a_document_mask_compile(tmp_path, arch):
    got = export(tmp_path, arch, f"{MODS}:learned_bias", f"{MODS}:document")
    assert got["report"]["lowering"].startswith("mask_mod")
    bwd = kernel(got["ptx"], "flash_bwd_sm")
    assert MMA[arch] in bwd
    # The captured tensor's gradient: float32 atomic adds from the generated score_mod_bwd.
    assert "atom.global.add.f32" in bwd or "red.global.add.f32" in bwd


_SPARSE_CHILD = """
import json, sys, torch, flexfa
from flexfa.codegen.cute import offline
ids = torch.repeat_interleave(torch.arange(8), 128)
mask = flexfa.and_masks(flexfa.masks.causal, flexfa.masks.document(ids))
report = offline.compile_call(
    None, mask, arch=sys.argv[2], out_dir=sys.argv[1], block_sparse=True, head_dim=64
)
print(json.dumps({"lowering": report.lowering, "ptx": [str(p) for p in report.ptx]}))
"""


# sm_100a: the lists coarsened to 256-row q blocks (Note [Coarsening a BlockMask]), compiled only.
# FA4's compiles take a minute each on 2 busy cores: the default tier keeps the ALiBi one above.
@pytest.mark.parametrize(
    "arch",
    [
        pytest.param("sm_90a", marks=pytest.mark.slow),
        pytest.param("sm_100a", marks=pytest.mark.exhaustive),
    ],
)
def test_block_sparse_lists_compile(tmp_path, arch):
    res = run_child(tmp_path, [sys.executable, "-c", _SPARSE_CHILD, str(tmp_path / "out"), arch])
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert "forward block-sparse" in got["lowering"] and "backward block-sparse" in got["lowering"]
    kernel = "flash_bwd_sm90" if arch == "sm_90a" else "flash_bwd_sm100"
    bwd = [p for p in got["ptx"] if kernel in p]
    assert bwd and MMA[arch] in Path(bwd[0]).read_text()


_SPLIT_CHILD = """
import json, sys, flexfa
from flexfa.codegen.cute import offline
report = offline.compile_call(flexfa.mods.softcap(20.0), flexfa.masks.prefix_lm(300),
                              arch=sys.argv[2], out_dir=sys.argv[1], head_dim=64)
print(json.dumps({"lowering": report.lowering, "ptx": [str(p) for p in report.ptx]}))
"""


# Note [Prefix masks as two native calls]: both parts run FA4's window kernel, compiled once per
# pass, without a mask_mod or block lists.
@pytest.mark.parametrize(
    "arch",
    [
        pytest.param("sm_90a", marks=pytest.mark.slow),
        pytest.param("sm_100a", marks=pytest.mark.exhaustive),
    ],
)
def test_prefix_masks_split_by_rows_compile(tmp_path, arch):
    res = run_child(tmp_path, [sys.executable, "-c", _SPLIT_CHILD, str(tmp_path / "out"), arch])
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["lowering"].startswith("rows: proven"), got["lowering"]
    assert "block-sparse" not in got["lowering"]
    texts = {Path(p).name: Path(p).read_text() for p in got["ptx"]}
    for which in ("flash_fwd", "flash_bwd_sm"):
        assert MMA[arch] in kernel(texts, which)


_SCALARS_CHILD = """
import json, struct, sys, torch, flexfa
from flexfa.codegen.cute import offline

def make(c):
    def shifted(score, b, h, q_idx, kv_idx):
        return score + c * (kv_idx - q_idx)
    return shifted

first = offline.compile_call(make(0.123), flexfa.masks.causal, arch=sys.argv[2],
                             out_dir=sys.argv[1], head_dim=64)
from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
counts = [len(_flash_attn_fwd.compile_cache.cache), len(_flash_attn_bwd.compile_cache.cache)]
second = offline.compile_call(make(0.456), flexfa.masks.causal, arch=sys.argv[2],
                              out_dir=sys.argv[1], head_dim=64)
counts += [len(_flash_attn_fwd.compile_cache.cache), len(_flash_attn_bwd.compile_cache.cache)]
literal = "0f" + struct.pack(">f", 0.123).hex().upper()
ptx = "".join(p.read_text() for p in first.ptx)
print(json.dumps({"counts": counts, "seconds": [first.seconds, second.seconds],
                  "literal_in_ptx": literal in ptx, "ptx_files": len(first.ptx)}))
"""


@pytest.mark.slow
def test_mods_differing_in_a_float_share_one_compile(tmp_path):
    """Note [Constants in generated CuTe source]: a lifted float is FA4's run-time aux_scalars,
    so a second score_mod that differs only in that float compiles nothing, and the value is not a
    constant of the PTX."""
    res = run_child(
        tmp_path, [sys.executable, "-c", _SCALARS_CHILD, str(tmp_path / "out"), "sm_100a"]
    )
    got = json.loads(res.stdout.strip().splitlines()[-1])
    fwd_1, bwd_1, fwd_2, bwd_2 = got["counts"]
    assert (fwd_1, bwd_1) == (fwd_2, bwd_2) and fwd_1 >= 1 and bwd_1 >= 1, got
    assert got["ptx_files"] >= 2 and not got["literal_in_ptx"], got
    assert got["seconds"][1]["forward"] < 0.5 and got["seconds"][1]["backward"] < 0.5, got


_DISK_CHILD = """
import json, sys, flexfa
from flexfa.mods import alibi
from flexfa.codegen.cute import offline

report = offline.compile_call(alibi, flexfa.masks.causal, arch="sm_90a", out_dir=sys.argv[1],
                              head_dim=64, disk_cache=True, backward=False)
print(json.dumps({"seconds": report.seconds, "ptx": len(report.ptx)}))
"""


@pytest.mark.slow
def test_compiled_kernels_are_kept_on_disk_for_later_processes(tmp_path):
    """Note [FA4 kernels on disk]: a second process loads the forward FA4 compiled with flexfa's
    generated mods from flexfa's cache directory instead of compiling it again."""
    cache = tmp_path / "cache"
    env = dict(os.environ, FLEXFA_CACHE_DIR=str(cache), TRITON_INTERPRET="0")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", None)
    runs = []
    for i in range(2):
        cmd = [sys.executable, "-c", _DISK_CHILD, str(tmp_path / f"out{i}")]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stderr[-4000:]
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    objects = list((cache / "fa4").rglob("*.o"))
    assert len(objects) == 1 and objects[0].parent.name == "fwd", objects
    first, second = (r["seconds"]["forward"] for r in runs)
    assert runs[0]["ptx"] >= 1 and runs[1]["ptx"] == 0, runs  # the second compiled nothing
    assert second < first / 2, runs


_VARLEN_CHILD = """
import json, sys, torch, flexfa
from flexfa.codegen.cute import offline
slopes = torch.rand(4, requires_grad=True)

def learned_alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)

report = offline.compile_call(learned_alibi, flexfa.masks.causal, arch=sys.argv[2],
                              out_dir=sys.argv[1], head_dim=64, seqlens=(300, 0, 1, 700))
print(json.dumps({"lowering": report.lowering, "ptx": [str(p) for p in report.ptx]}))
"""


@pytest.mark.slow
def test_varlen_kernels_compile_with_a_generated_score_mod(tmp_path):
    """Note [Packed calls on FA4's varlen path]: FA4's varlen forward and backward (cu_seqlens)
    with the user's own score_mod, its captured tensor's gradient and FA4's causal mask, for
    sm_90a: Hopper tensor cores in both, float32 atomic adds for the gradient."""
    res = run_child(
        tmp_path, [sys.executable, "-c", _VARLEN_CHILD, str(tmp_path / "out"), "sm_90a"]
    )
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["lowering"].startswith("causal: proven in every sequence"), got["lowering"]
    assert "FA4's varlen kernels, 4 sequences" in got["lowering"]
    texts = {Path(p).name: Path(p).read_text() for p in got["ptx"]}
    fwd, bwd = kernel(texts, "flash_fwd_sm90"), kernel(texts, "flash_bwd_sm90")
    for text in (fwd, bwd):
        assert ".target sm_90a" in text and MMA["sm_90a"] in text
    assert "atom.global.add.f32" in bwd or "red.global.add.f32" in bwd


_GRAD_CHILD = """
import json, re, sys, torch, flexfa
from flexfa.codegen.cute import offline
slopes = torch.rand(4, requires_grad=True)
table = torch.zeros(4, 257, requires_grad=True)

def learned_alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)

mod = {"slopes": learned_alibi, "table": flexfa.mods.relative_bias(table, 128)}[sys.argv[3]]
report = offline.compile_call(mod, flexfa.masks.causal, arch=sys.argv[2], out_dir=sys.argv[1],
                              head_dim=128)
(bwd,) = [p.read_text() for p in report.ptx if "flash_bwd_sm" in p.name]
print(json.dumps({k: len(re.findall(p, bwd)) for k, p in (
    ("atom", r"(?:atom|red)[.a-z:0-9]*add[.]f32"), ("bfly", r"shfl[.]sync[.]bfly"),
    ("ballot", r"vote[.]sync[.]ballot"), ("all", r"vote[.]sync[.]all"),
    ("redux", r"redux[.]sync[.]min"))}))
"""


@pytest.mark.slow
def test_captured_gradients_are_aggregated_per_warp(tmp_path):
    """Note [Captured gradients in the FA4 backward], in FA4's sm90 backward: a per-head slope's
    gradient goes out once per hook call and warp (five butterfly shuffles before each atomic, no
    votes); a clamped distance's through the run-time warp test (a ballot, a min over the lanes,
    then either one atomic after five shuffles or one per lane)."""
    got = {}
    for name in ("slopes", "table"):  # a process each: the CuTe DSL fixes its dump dir once
        cmd = [sys.executable, "-c", _GRAD_CHILD, str(tmp_path / name), "sm_90a", name]
        got[name] = json.loads(run_child(tmp_path, cmd).stdout.strip().splitlines()[-1])
    slopes, table = got["slopes"], got["table"]
    assert slopes["atom"] > 0 and slopes["bfly"] == 5 * slopes["atom"], got
    assert slopes["ballot"] == slopes["all"] == slopes["redux"] == 0, got
    # Each warp step: one ballot, one min, one vote; two atomic sites (the warp's, a lane's).
    steps = table["redux"]
    assert steps > 0 and table["ballot"] == steps and table["bfly"] == 5 * steps, got
    assert table["atom"] == 2 * steps and table["all"] > steps, got
    # A hook call sums its elements where they share an offset: a step per call, then one per
    # element, so more than one step per static atomic site of the slope's.
    assert steps > slopes["atom"], got
