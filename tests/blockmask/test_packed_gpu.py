"""The packed block-list kernel on a GPU (Note [Packed block masks in one kernel]): compiled by
Triton for the device, at real sizes, with the positions it writes for a packed call (Note
[Positions written with the block lists]). The same lists as the torch builder, the same
positions as the torch operations, and a packed call through the Triton kernels against each
sequence computed alone by the float64 reference (three-way rule, tests/tolerance.py)."""

from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa import masks as fm
from flexfa.blockmask import packed
from flexfa.runtime.launch import wait_for_background
from flexfa.varlen import packed_mods, packing
from tests.sequences import offsets, per_sequence_reference
from tests.tolerance import ThreeWay

pytestmark = pytest.mark.gpu

_LISTS = ("kv_partial", "kv_full", "q_partial", "q_full")
_CASES = {
    "mixed": ([512, 8192, 1024, 3000, 6000, 700, 4096, 2600], None),
    "empty and length 1": ([0, 1, 300, 0, 129, 1, 4000], None),
    "other keys": ([100, 0, 900, 7, 2048], [333, 12, 0, 1000, 1500]),
}


def _torch_positions(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.repeat_interleave(cu[1:] - cu[:-1], output_size=total)
    return seq, torch.arange(total, device=cu.device, dtype=torch.int32) - cu[seq]


@pytest.mark.parametrize("case", sorted(_CASES))
@pytest.mark.parametrize(
    "inner", [None, fm.causal, fm.sliding_window(300)], ids=["none", "causal", "window"]
)
def test_kernel_lists_and_positions_on_the_gpu(case, inner) -> None:
    lens_q, lens_kv = _CASES[case]
    lens_kv = lens_kv or lens_q
    tq, tk = sum(lens_q), sum(lens_kv)
    cu_q = offsets(lens_q, "cuda")
    cu_kv = cu_q if lens_kv == lens_q else offsets(lens_kv, "cuda")
    for _attempt in range(3):  # a cold kernel compiles in the background meanwhile
        before = packed.built["kernel"]
        pack = packing(cu_q.clone(), cu_kv.clone(), tq, tk, cu_q.device, defer=True)
        _, mask = packed_mods(None, inner, pack, 4)
        got = flexfa.create_block_mask(mask, 1, None, tq, tk, device="cuda")
        pack.fill()
        if packed.built["kernel"] > before:
            break
        wait_for_background()
    assert packed.built["kernel"] > before, "the kernel never ran"
    for cu, seq, pos, total in (
        (pack.cu_q, pack.seq_q, pack.pos_q, tq),
        (pack.cu_kv, pack.seq_kv, pack.pos_kv, tk),
    ):
        want_seq, want_pos = _torch_positions(cu, total)
        assert torch.equal(seq, want_seq) and torch.equal(pos, want_pos)
    with flexfa.config.override(fused_block_mask="off"):
        want = flexfa.create_block_mask(mask, 1, None, tq, tk, device="cuda")
    for name in _LISTS:
        g, w = getattr(got, name), getattr(want, name)
        assert torch.equal(g.count, w.count), name
        listed = torch.arange(g.index.shape[-1], device="cuda") < g.count[..., None]
        assert torch.equal(g.index[listed], w.index[listed]), name


def test_packed_call_on_the_triton_kernels() -> None:
    """A packed call whose BlockMask kernel writes the positions its mods read."""
    lens_q, lens_kv = [100, 0, 257, 1, 64], [90, 5, 300, 0, 64]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, sum(lens_q), 64, generator=g).to(torch.bfloat16).double()
    k = torch.randn(1, 2, sum(lens_kv), 64, generator=g).to(torch.bfloat16).double()
    v = torch.randn(1, 2, sum(lens_kv), 64, generator=g).to(torch.bfloat16).double()
    cu_q, cu_kv = offsets(lens_q, "cuda"), offsets(lens_kv, "cuda")

    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 40

    for _ in range(3):  # the same batch again, new offsets tensors, once the kernels compiled
        before = packed.built["kernel"]
        out = flexfa.attention(
            *(t.to("cuda", torch.bfloat16) for t in (q, k, v)), flexfa.mods.alibi, window,
            enable_gqa=True, cu_seqlens_q=cu_q.clone(), cu_seqlens_kv=cu_kv.clone(),
            backend="triton",
        )  # fmt: skip
        if packed.built["kernel"] > before:
            break
        wait_for_background()
    assert packed.built["kernel"] > before, "the packed kernel never built the BlockMask"
    args = (q, k, v, flexfa.mods.alibi, window, lens_q, lens_kv)
    ref, eager = (
        per_sequence_reference(*args)[0],
        per_sequence_reference(*args, dtype=torch.bfloat16)[0],
    )
    check = ThreeWay(torch.bfloat16, context=f"lens_q={lens_q} lens_kv={lens_kv}")
    check("out", out.double().cpu(), eager, ref)
    check.assert_ok()


def test_offsets_on_the_host_cost_no_synchronization() -> None:
    """Offsets given on the CPU for a call on the GPU (Note [Offsets on the host]): a new batch's
    packing, mods and BlockMask run without one synchronization, and the call gives the bits
    that offsets on the GPU give."""
    lens = [512, 8192, 1024, 3000, 0, 1, 700]
    total = sum(lens)
    host = offsets(lens)
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(1, 4, total, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(3)
    )
    for _ in range(3):  # compiles the kernels (in the background) first
        pack = packing(host.clone(), host.clone(), total, total, q.device, defer=True)
        _, mask = packed_mods(None, fm.causal, pack, 4)
        flexfa.create_block_mask(mask, 1, None, total, total, device="cuda")
        pack.fill()
        wait_for_background()
    torch.cuda.synchronize()
    before = packed.built["kernel"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        fresh = host.clone()
        pack = packing(fresh, fresh, total, total, q.device, defer=True)
        _, mask = packed_mods(None, fm.causal, pack, 4)
        flexfa.create_block_mask(mask, 1, None, total, total, device="cuda")
        pack.fill()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert packed.built["kernel"] == before + 1
    assert pack.cu_q.is_cuda and torch.equal(pack.cu_q.cpu(), host)
    want_seq, want_pos = _torch_positions(pack.cu_q, total)
    assert torch.equal(pack.seq_q, want_seq) and torch.equal(pack.pos_q, want_pos)
    call = dict(block_mask=fm.causal, backend="triton")
    on_host = flexfa.attention(q, k, v, cu_seqlens_q=host, cu_seqlens_kv=host.clone(), **call)
    on_gpu = flexfa.attention(q, k, v, cu_seqlens_q=host.cuda(), cu_seqlens_kv=host.cuda(), **call)
    assert torch.equal(on_host, on_gpu)
