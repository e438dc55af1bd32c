"""The Triton backend on a real GPU at real sizes, against the float64 reference (three-way rule).

Skipped without CUDA. Run on a GPU machine with `pytest -q -m gpu tests/codegen/triton`.
"""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa import masks as fm
from flexfa import mods as fmods
from flexfa.reference import reference_attention
from tests.codegen.common import (
    GpuCase,
    alibi_causal,
    causal,
    check_against_reference,
    document_causal,
    empty_rows,
    no_mask,
    relative_bias,
    softcap_window,
)
from tests.e2e.layouts import LAYOUTS, relayout
from tests.e2e.layouts import cycled as layouts_cycled
from tests.tolerance import ThreeWay

pytestmark = pytest.mark.gpu


CASES = [
    GpuCase("causal", 2, 4, 4, 1024, 1024, 64, torch.bfloat16, causal),
    GpuCase("causal", 1, 2, 2, 1000, 1000, 128, torch.float16, causal),
    GpuCase("alibi_causal", 1, 8, 2, 2048, 1536, 128, torch.bfloat16, alibi_causal),
    GpuCase("softcap_window", 1, 4, 4, 4096, 4096, 80, torch.bfloat16, softcap_window),
    GpuCase("document_causal", 2, 4, 4, 2048, 2048, 64, torch.bfloat16, document_causal),
    GpuCase("relative_bias", 1, 4, 2, 1531, 1531, 128, torch.bfloat16, relative_bias),
    GpuCase("no_mask", 1, 2, 1, 777, 1999, 64, torch.float32, no_mask),
    GpuCase("empty_rows", 1, 2, 2, 1024, 1024, 64, torch.bfloat16, empty_rows),
    GpuCase("causal", 1, 1, 1, 16384, 16384, 64, torch.bfloat16, causal),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_matches_reference_on_gpu(case: GpuCase) -> None:
    dev = "cuda"
    torch.manual_seed(0)
    score_mod, mask_mod, params = case.build(case, dev)
    q, k, v = case.qkv(dev)
    gqa = case.gqa
    out, lse = flexfa.attention(
        q, k, v, score_mod, mask_mod, enable_gqa=gqa, return_lse=True, backend="triton"
    )
    check_against_reference(case, q, k, v, score_mod, mask_mod, params, out, lse)


def test_deterministic_captured_gradients_on_gpu() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    q, k, v = (torch.randn(2, 8, 2048, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
    table = torch.randn(8, 2 * 512 + 1, device=dev, requires_grad=True)
    do = torch.randn_like(q)

    def grads(deterministic: bool) -> torch.Tensor:
        out = flexfa.attention(
            q,
            k,
            v,
            fmods.relative_bias(table),
            fm.causal,
            backend="triton",
            deterministic=deterministic,
        )
        return torch.autograd.grad(out, table, do)[0]

    first, second, atomic = grads(True), grads(True), grads(False)
    assert torch.equal(first, second), "deterministic gradients differ between two runs"
    torch.testing.assert_close(first, atomic, rtol=1e-3, atol=1e-3)


def test_autotune_stores_and_reuses_results(tmp_path) -> None:
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(1, 4, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    with flexfa.config.override(cache_dir=str(tmp_path)):
        tuned = flexfa.attention(
            q, k, v, block_mask=fm.causal, backend="triton", kernel_options={"autotune": True}
        )
        tuned.sum().backward()
        assert (tmp_path / "triton" / "tuning.json").exists()
        entries = (tmp_path / "triton" / "tuning.json").read_text()
        assert '"fwd"' in entries and '"bwd"' in entries
        again = flexfa.attention(q, k, v, block_mask=fm.causal, backend="triton")
    default = flexfa.attention(q, k, v, block_mask=fm.causal, backend="triton")
    torch.testing.assert_close(tuned, default, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(again, default, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("i", range(len(LAYOUTS)), ids=list(LAYOUTS))
def test_upstream_gradient_and_capture_layouts_on_gpu(i: int) -> None:
    """dLSE, dO and a captured table in every layout (tests/e2e/layouts.py), bf16, against fp64."""
    dev = "cuda"
    torch.manual_seed(i)
    B, H, L, D = 2, 4, 1000, 64
    kinds = layouts_cycled(i)
    q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    leaf = (0.5 * torch.randn(H, 2 * L + 1, device=dev)).requires_grad_()
    dout = relayout(torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16), kinds["dout"])
    dlse = relayout(torch.randn(B, H, L, device=dev), kinds["dlse"])

    def run(attend, dtype):
        qq, kk, vv = (t.to(dtype).requires_grad_() for t in (q, k, v))
        table = relayout(leaf, kinds["q"])
        out, lse = attend(qq, kk, vv, fmods.relative_bias(table), fm.causal)
        inputs = (qq, kk, vv, leaf)
        grads = torch.autograd.grad((out, lse), inputs, (dout.to(out.dtype), dlse.to(lse.dtype)))
        return out, lse, grads

    def kernel(q, k, v, score_mod, mask_mod):
        return flexfa.attention(q, k, v, score_mod, mask_mod, return_lse=True, backend="triton")

    def reference(dtype):
        return lambda q, k, v, s, m: reference_attention(q, k, v, s, m, dtype=dtype)

    got = run(kernel, torch.bfloat16)
    eager = run(reference(torch.bfloat16), torch.bfloat16)
    ref = run(reference(torch.float64), torch.float64)
    check = ThreeWay(torch.bfloat16, context=f"layouts {kinds}")
    check("out", got[0], eager[0], ref[0])
    check("lse", got[1], eager[1].float(), ref[1], atol=1e-3)
    for name, a, e, r in zip(("dq", "dk", "dv", "dtable"), got[2], eager[2], ref[2]):
        check(name, a, e, r)
    check.assert_ok()


@pytest.mark.parametrize("table_dtype", ["float32", "bfloat16", "float16", "int32_index"])
@pytest.mark.parametrize("len_q", [1, 1000])
def test_per_pair_gathers_on_gpu(table_dtype: str, len_q: int) -> None:
    """Per-pair table reads through flexfa_gather's inline PTX (Note [Per-pair gathers] in
    flexfa/codegen/triton/emit.py), for each element type it reads, in the prefill kernels with
    their backward (float32 tables learnable) and in the decode kernels (one query)."""
    dev = "cuda"
    torch.manual_seed(0)
    B, Hq, Hkv, L, D = 2, 4, 2, 1000, 64
    q = torch.randn(B, Hq, len_q, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    buckets = torch.randint(0, 97, (len_q, L), device=dev, dtype=torch.int32)
    weights = torch.randn(97, device=dev)
    leaf = torch.randn(Hq, len_q + L, device=dev)
    if table_dtype == "float32":
        leaf.requires_grad_()
    dtype = torch.float32 if table_dtype == "int32_index" else getattr(torch, table_dtype)

    def mod(table):
        if table_dtype == "int32_index":
            return lambda s, b, h, qi, kv: s + weights[buckets[qi, kv]]
        return lambda s, b, h, qi, kv: s + table[h, qi - kv + L - 1]

    def mask(b, h, qi, kv):
        return qi + (L - len_q) >= kv

    def run(attend, dt):
        qq, kk, vv = (t.to(dt).requires_grad_() for t in (q, k, v))
        table = leaf.to(dtype) if dtype != torch.float32 else leaf
        out, lse = attend(qq, kk, vv, mod(table), mask)
        if not leaf.requires_grad or len_q == 1:
            return out, lse, ()
        return out, lse, torch.autograd.grad(out, (qq, kk, vv, leaf), torch.ones_like(out))

    def kernel(q, k, v, score_mod, mask_mod):
        return flexfa.attention(
            q, k, v, score_mod, mask_mod, enable_gqa=True, return_lse=True, backend="triton"
        )

    def reference(dt):
        return lambda q, k, v, s, m: reference_attention(q, k, v, s, m, enable_gqa=True, dtype=dt)

    got = run(kernel, torch.bfloat16)
    eager = run(reference(torch.bfloat16), torch.bfloat16)
    ref = run(reference(torch.float64), torch.float64)
    check = ThreeWay(torch.bfloat16, context=f"table {table_dtype}, len_q {len_q}")
    check("out", got[0], eager[0], ref[0])
    check("lse", got[1], eager[1].float(), ref[1], atol=1e-3)
    for name, a, e, r in zip(("dq", "dk", "dv", "dtable"), got[2], eager[2], ref[2]):
        check(name, a, e, r)
    check.assert_ok()


_COLD_PROCESS = r"""
import json, logging, sys
import torch
import flexfa
from flexfa import masks as fm
from flexfa.runtime import launch

records = []
handler = logging.Handler()
handler.emit = lambda r: records.append(r.getMessage())
logging.getLogger("flexfa").addHandler(handler)
logging.getLogger("flexfa").setLevel(logging.DEBUG)

def lists(bm):
    return [getattr(bm, n).index.cpu() for n in ("kv_partial", "kv_full", "q_partial", "q_full")]

def general(n):
    with flexfa.config.override(fused_block_mask="off"):
        return flexfa.create_block_mask(mask, None, None, n, n, device="cuda")

mask = fm.and_masks(fm.causal, fm.sliding_window(300))
first = flexfa.create_block_mask(mask, None, None, 1024, 1024, device="cuda")  # kernel noted
started = bool(launch._background)
second = flexfa.create_block_mask(mask, None, None, 1024, 1024, device="cuda")  # compile starts
for future in list(launch._background.values()):
    future.result()
records.append("-- third build --")
# Another length with the same tile counts and divisibility: the same compiled kernel.
third = flexfa.create_block_mask(mask, None, None, 1008, 1008, device="cuda")
same = [bool(torch.equal(a, b)) for a, b in zip(lists(first), lists(general(1024)))]
same += [bool(torch.equal(a, b)) for a, b in zip(lists(second), lists(general(1024)))]
same += [bool(torch.equal(a, b)) for a, b in zip(lists(third), lists(general(1008)))]
print(json.dumps(dict(same=same, started_at_first=started, log=records)))
"""


def test_cold_block_mask_kernel_compiles_in_the_background(tmp_path) -> None:
    """A fresh process's first block masks come from the general path: the first build only notes
    the cold kernel, the second starts its compile on the pool (Note [Background compiles from the
    second call]); the build after it finished uses the kernel. The lists are the same in every
    build."""
    import json
    import os
    import subprocess
    import sys

    env = dict(
        os.environ, FLEXFA_CACHE_DIR=str(tmp_path / "flexfa"), TRITON_CACHE_DIR=str(tmp_path / "t")
    )
    res = subprocess.run(
        [sys.executable, "-c", _COLD_PROCESS], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert all(got["same"]), got
    assert not got["started_at_first"], got
    log = "\n".join(got["log"])
    cold, warm = log.split("-- third build --")
    assert "its kernel is compiling" in cold, log
    assert "kernel compiled concurrently" in cold, log
    assert "block lists of" in warm and "general path" not in warm, log


_COLD_TRAINING_STEP = r"""
import dataclasses, json
import torch
import flexfa
from flexfa.runtime import workers
from flexfa.runtime import launch

q, k, v = (torch.randn(1, 4, 1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
slopes = torch.rand(4, device="cuda")
alibi = lambda s, b, h, i, j: s + slopes[h] * (j - i)
out = flexfa.attention(q, k, v, score_mod=alibi, block_mask=flexfa.masks.causal, backend="triton")
out.float().square().sum().backward()
launch.wait_for_background()
grads = [t.grad.float() for t in (q, k, v)]
with flexfa.config.override(concurrent_compile=False):
    for t in (q, k, v):
        t.grad = None
    again = flexfa.attention(q, k, v, score_mod=alibi, block_mask=flexfa.masks.causal,
                             backend="triton")
    again.float().square().sum().backward()
same = bool(torch.equal(out, again)) and all(
    torch.equal(g, t.grad.float()) for g, t in zip(grads, (q, k, v)))
print(json.dumps(dict(same=same, stats=dataclasses.asdict(workers.stats))))
"""


def test_compile_workers_compile_what_a_cold_step_loads(tmp_path) -> None:
    """A cold training step's background compiles go to worker processes, and the kernels the
    process then loads are the workers' (same Triton hash: nothing compiled twice; Note [Compile
    workers]); results are those of a second, warm step."""
    import json
    import os
    import subprocess
    import sys

    env = dict(
        os.environ, FLEXFA_CACHE_DIR=str(tmp_path / "flexfa"), TRITON_CACHE_DIR=str(tmp_path / "t")
    )
    env.pop("FLEXFA_COMPILE_WORKERS", None)
    res = subprocess.run(
        [sys.executable, "-c", _COLD_TRAINING_STEP],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["same"], got
    stats = got["stats"]
    # The backward's three kernels (and the block-mask kernel) went to workers and were reused.
    assert stats["jobs"] >= 3, stats
    assert stats["reused"] == stats["jobs"] and stats["mismatched"] == 0, stats
    assert stats["failed"] == 0, stats
