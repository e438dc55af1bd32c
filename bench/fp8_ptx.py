"""What the decode kernel does per K/V element with an fp8 cache, read from its PTX (no GPU needed).

Compiles the decode kernel (flexfa/codegen/triton/decode.py) for sm_90 with Triton, for a bfloat16
and an fp8 K/V cache of the same shape (B=8, Hq=32, Hkv=8, D=128, Lq=1, Lkv=32768), and counts the
PTX conversion instructions, MMAs, asynchronous copies and shared-memory reads (what limits the
fp8 decode, Note [fp8 K/V in float16 dots]). The kernel is specialized on its arguments as a launch
is (Note [Offline compiles specialize as launches do]).

    python bench/fp8_ptx.py
    python bench/fp8_ptx.py --q-dtype float16 --kv-dtype float8_e5m2
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from flexfa.api import build_spec
from flexfa.codegen.triton import decode
from flexfa.codegen.triton.offline import compile_launch


def count(
    q_dtype: torch.dtype, kv_dtype: torch.dtype, lkv: int, v_keys_inner: bool = False
) -> dict:
    B, Hq, Hkv, D = 8, 32, 8, 128
    q = torch.empty(B, Hq, 1, D, dtype=q_dtype)
    k, v = (torch.empty(B, Hkv, lkv, D, dtype=kv_dtype) for _ in "kv")
    if v_keys_inner:  # V stored (B, Hkv, D, Lkv): keys are its contiguous dim
        v = torch.empty(B, Hkv, D, lkv, dtype=kv_dtype).transpose(-1, -2)
    spec = build_spec(q, k, v, None, None, enable_gqa=True)
    out, lse = torch.empty(B, Hq, 1, D, dtype=q_dtype), torch.empty(B, Hq, 1)
    launch = decode.launches(spec, q, k, v, out, lse, capability=(9, 0), force_compiled=True)[0]
    ptx = compile_launch(launch, 90).asm["ptx"]
    cvts = collections.Counter(re.findall(r"\bcvt\.[\w.]+", ptx))
    return dict(
        kv=str(kv_dtype).removeprefix("torch."),
        v_keys_inner=v_keys_inner,
        block_n=launch.constexprs["BLOCK_N"],
        f16_dot=launch.constexprs.get("F16_DOT"),
        conversions={c: n for c, n in cvts.items() if "s32" not in c and "s64" not in c},
        mma=len(re.findall(r"\bmma\.sync|\bwgmma\.mma_async", ptx)),
        # how K/V tiles move: asynchronous copies into shared memory, then reads from it
        cp_async=len(re.findall(r"\bcp\.async\.c[ag]\.", ptx)),
        shared_loads={
            op: n
            for op, n in collections.Counter(
                re.findall(r"\b(ld\.shared\.[\w.]+|ldmatrix[\w.]+)", ptx)
            ).items()
        },
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--q-dtype", default="bfloat16")
    ap.add_argument("--kv-dtype", default="float8_e4m3fn")
    ap.add_argument("--lkv", type=int, default=32768)
    ap.add_argument("--v-keys-inner", action="store_true", help="also V stored keys-contiguous")
    a = ap.parse_args()
    q_dtype = getattr(torch, a.q_dtype)
    for kv_dtype in (q_dtype, getattr(torch, a.kv_dtype)):
        print(count(q_dtype, kv_dtype, a.lkv))
        if a.v_keys_inner:
            print(count(q_dtype, kv_dtype, a.lkv, v_keys_inner=True))


if __name__ == "__main__":
    main()
