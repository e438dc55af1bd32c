"""The Triton backend's tile plan for mods that read or scatter per (q, kv) pair (Note [Shared
memory of per-pair loads and scatters] in flexfa/codegen/triton/configs.py)."""

from __future__ import annotations

import torch

import flexfa
from flexfa.api import build_spec
from flexfa.codegen.triton.plan import resolve_configs

H100 = (9, 0)
N, D = 1024, 128


def _configs(score_mod, *, learnable: bool = False):
    q = torch.empty(1, 4, N, D, dtype=torch.bfloat16, requires_grad=learnable)
    spec = build_spec(q, q, q, score_mod, flexfa.masks.causal)
    return resolve_configs(spec, H100)


def test_plain_mods_keep_the_default_tiles():
    slopes = torch.rand(4)
    cfg = _configs(lambda s, b, h, q, kv: s + slopes[h] * (kv - q))
    assert (cfg.fwd.block_m, cfg.fwd.block_n, cfg.fwd.num_stages) == (128, 128, 2)
    assert cfg.bwd.num_stages == 3


def test_gathered_tables_narrow_the_forward_tile_only():
    # float32 and bfloat16 tables are read by flexfa_gather (no shared-memory staging): the
    # forward's KV tile narrows for registers, the pipelines keep their depth.
    for dtype in (torch.float32, torch.bfloat16):
        table = torch.zeros(4, 2 * N + 1, dtype=dtype)
        cfg = _configs(lambda s, b, h, q, kv, t=table: s + t[h, q - kv + N])
        assert (cfg.fwd.block_n, cfg.fwd.num_stages) == (64, 2), dtype
        assert cfg.bwd.num_stages == 3, dtype


def test_staged_tables_narrow_tiles_and_pipelines():
    # A bool table is read with tl.load, which Triton's pipeliner stages through shared memory.
    allowed = torch.ones(N, N, dtype=torch.bool)
    cfg = _configs(lambda s, b, h, q, kv: torch.where(allowed[q, kv], s, -float("inf")))
    assert (cfg.fwd.block_n, cfg.fwd.num_stages) == (64, 2)
    assert cfg.bwd.num_stages == 2


def test_per_pair_scatters_narrow_the_dq_tile():
    table = torch.zeros(4, 2 * N + 1, requires_grad=True)
    cfg = _configs(lambda s, b, h, q, kv: s + table[h, q - kv + N], learnable=True)
    assert cfg.bwd.block_m2 == 64
    assert cfg.bwd.num_stages == 3


def test_the_interpreter_keeps_its_small_tiles():
    table = torch.zeros(4, 2 * N + 1)
    q = torch.empty(1, 4, N, D, dtype=torch.bfloat16)
    spec = build_spec(q, q, q, lambda s, b, h, q_, kv: s + table[h, q_ - kv + N], None)
    cfg = resolve_configs(spec, None)
    assert (cfg.fwd.block_m, cfg.fwd.block_n) == (32, 32)


def test_per_pair_scatters_give_the_dq_kernel_four_warps():
    # At D=128 the backward runs 8 warps; the dQ kernel that scatters per pair runs 4, the dK/dV
    # kernel keeps 8.
    table = torch.zeros(4, 2 * N + 1, requires_grad=True)
    q = torch.empty(1, 4, N, 128, dtype=torch.bfloat16, requires_grad=True)
    spec = build_spec(q, q, q, lambda s, b, h, q_, kv: s + table[h, q_ - kv + N], None)
    cfg = resolve_configs(spec, H100).bwd
    assert (cfg.num_warps, cfg.dq_num_warps) == (8, 4)
    assert cfg.dq.num_warps == 4 and cfg.dq.block_m2 == cfg.block_m2
    frozen = resolve_configs(build_spec(q.detach(), q, q, None, None), H100).bwd
    assert frozen.dq_num_warps is None and frozen.dq is frozen


def test_gathered_tables_give_the_forward_eight_warps():
    table = torch.zeros(4, 2 * N + 1)
    q = torch.empty(1, 4, N, 64, dtype=torch.bfloat16)
    spec = build_spec(q, q, q, lambda s, b, h, q_, kv: s + table[h, q_ - kv + N], None)
    fwd = resolve_configs(spec, H100).fwd
    assert (fwd.block_n, fwd.num_warps) == (64, 8)
    assert resolve_configs(build_spec(q, q, q, None, None), H100).fwd.num_warps == 4


def test_blocked_sums_keep_the_backward_tiles():
    # Note [Scatter-add of captured gradients], BLOCKED: one atomic per block, no per-pair work,
    # so the dQ kernel keeps the frozen call's tile and warps.
    grid = torch.zeros(N // 64, N // 64, requires_grad=True)
    learnable = _configs(lambda s, b, h, q, kv: s + grid[q // 64, kv // 64], learnable=True)
    frozen = _configs(lambda s, b, h, q, kv: s + grid.detach()[q // 64, kv // 64])
    assert learnable.bwd == frozen.bwd
    assert (learnable.bwd.block_m2, learnable.bwd.dq_num_warps) == (128, None)
