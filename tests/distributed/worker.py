"""What each spawned rank runs: every context-parallel check of one world size, in one process group.

Spawning a world costs seconds (each process imports torch and flexfa), so one spawn per world size
runs all the cases. A rank never raises in the middle: every rank goes through the same sequence of
collectives, records what disagreed, and the failures are raised at the end (mp.spawn reports them).
"""

from __future__ import annotations

import datetime
import logging
import os
import traceback

import torch
import torch.distributed as dist

import flexfa
from flexfa.distributed import (
    Document,
    context_parallel_attention,
    shard_sequence,
    unshard_sequence,
)

L = 24  # a multiple of 2 * W for W = 2, 3, 4
E = 16
RTOL, ATOL = 1e-4, 2e-5


def _inputs(seed: int, B: int, Hq: int, Hkv: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, E, generator=gen)
    k = torch.randn(B, Hkv, L, E, generator=gen)
    v = torch.randn(B, Hkv, L, E, generator=gen)
    dout = torch.randn(B, Hq, L, E, generator=gen)
    dlse = torch.randn(B, Hq, L, generator=gen)
    return q, k, v, dout, dlse


def _case_causal(seed):
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return dict(B=1, Hq=4, Hkv=2, score=None, mask=causal, captures=lambda: {})


def _case_document(seed):
    doc = torch.tensor([0] * 5 + [1] * 9 + [2] * 3 + [3] * 7)  # boundaries off the shards'

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    return dict(B=2, Hq=2, Hkv=2, score=None, mask=document_causal, captures=lambda: {})


def _case_window_alibi(seed):
    def make(slopes):
        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        return alibi

    def window(b, h, q_idx, kv_idx):  # strict: query 0 sees no key (an empty row)
        return (q_idx > kv_idx) & (q_idx - kv_idx <= 5)

    slopes = torch.rand(4, generator=torch.Generator().manual_seed(seed))
    return dict(B=1, Hq=4, Hkv=1, score=make, mask=window, captures=lambda: {"slopes": slopes})


def _case_bias(seed):
    def make(bias):
        def biased(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx, kv_idx]

        return biased

    bias = torch.randn(2, L, L, generator=torch.Generator().manual_seed(seed))
    return dict(B=1, Hq=2, Hkv=2, score=make, mask=None, captures=lambda: {"bias": bias})


CASES = {
    "causal": _case_causal,
    "document_causal": _case_document,
    "window_alibi": _case_window_alibi,
    "full_bias": _case_bias,
}


class _Failures:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.items: list[str] = []

    def close(self, what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        try:
            torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)
        except AssertionError as e:
            self.items.append(f"rank {self.rank}, {what}: {e}")

    def check(self, what: str, ok: bool, detail: str = "") -> None:
        if not ok:
            self.items.append(f"rank {self.rank}, {what}: {detail}")

    def run(self, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:
            self.items.append(f"rank {self.rank}, {what} raised:\n{traceback.format_exc()}")


def _one(fail: _Failures, name: str, balance, method: str, seed: int, group=None) -> None:
    case = CASES[name](seed)
    B, Hq, Hkv = case["B"], case["Hq"], case["Hkv"]
    q, k, v, dout, dlse = _inputs(seed, B, Hq, Hkv)
    caps = {n: t.clone().requires_grad_(True) for n, t in case["captures"]().items()}
    score = case["score"](*caps.values()) if case["score"] else None
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    kw = dict(enable_gqa=Hq != Hkv, backend="tiled")
    out_ref, lse_ref = flexfa.attention(qr, kr, vr, score, case["mask"], return_lse=True, **kw)
    grads_ref = torch.autograd.grad(
        (out_ref * dout).sum() + (torch.where(torch.isinf(lse_ref), 0, lse_ref) * dlse).sum(),
        (qr, kr, vr, *caps.values()),
    )

    caps_l = {n: t.detach().clone().requires_grad_(True) for n, t in caps.items()}
    score_l = case["score"](*caps_l.values()) if case["score"] else None
    ql, kl, vl = (
        t.detach().requires_grad_(True)
        for t in shard_sequence((q, k, v), group=group, balance=balance)
    )
    out, lse = context_parallel_attention(
        ql,
        kl,
        vl,
        score_l,
        case["mask"],
        group=group,
        balance=balance,
        method=method,
        return_lse=True,
        **kw,
    )
    dout_l = shard_sequence(dout, group=group, balance=balance)
    dlse_l = shard_sequence(dlse, group=group, balance=balance, dim=-1)
    loss = (out * dout_l).sum() + (torch.where(torch.isinf(lse), 0, lse) * dlse_l).sum()
    loss.backward()
    what = f"{name}, balance={balance}, method={method}, group={group_name(group)}"
    fail.close(f"{what}: out", unshard_sequence(out, group=group, balance=balance), out_ref)
    fail.close(f"{what}: lse", unshard_sequence(lse, group=group, balance=balance, dim=-1), lse_ref)
    for n, t in (("dq", ql), ("dk", kl), ("dv", vl)):
        full = unshard_sequence(t.grad, group=group, balance=balance)
        fail.close(f"{what}: {n}", full, grads_ref[("dq", "dk", "dv").index(n)])
    for (n, t), g_ref in zip(caps_l.items(), grads_ref[3:]):
        # Each rank holds the part from its own queries; the sum over the group is the gradient.
        g = t.grad.clone()
        dist.all_reduce(g, group=group.get_group() if hasattr(group, "get_group") else group)
        fail.close(f"{what}: d{n} (summed over ranks)", g, g_ref)
    fail.check(f"{what}: no NaN", not (out.isnan().any() or ql.grad.isnan().any()))


def group_name(group) -> str:
    return "default" if group is None else type(group).__name__


def _groups(fail: _Failures, world: int, seed: int) -> None:
    """A 1-D DeviceMesh, and at W = 4 two subgroups {0, 2} and {1, 3} (ranks in a group differ
    from global ranks, so the ring must address its neighbours by their global ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    _one(fail, "window_alibi", "head_tail", "ring", seed, group=mesh)
    if world == 4:
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        mine = groups[dist.get_rank() % 2]
        _one(fail, "full_bias", "head_tail", "ring", seed, group=mine)
        _one(fail, "causal", "none", "allgather", seed, group=mine)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _auto(fail: _Failures) -> None:
    logger = logging.getLogger("flexfa.distributed")
    records = _Records()
    logger.addHandler(records)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        _one(fail, "causal", "head_tail", "auto", 7)
    finally:
        logger.removeHandler(records)
        logger.setLevel(old)
    chosen = [m for m in records.messages if " uses ring" in m or " uses allgather" in m]
    fail.check("method='auto' logs its choice at DEBUG", bool(chosen), repr(records.messages))
    # Every rank must take the same method (a rank on the ring beside one gathering would hang).
    mine = torch.tensor([1 if chosen and " uses ring" in chosen[0] else 0])
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    fail.check(
        "method='auto' agrees across ranks", len(set(int(t) for t in every)) == 1, repr(every)
    )


def _errors(fail: _Failures, world: int) -> None:
    x = torch.zeros(1, 1, 2 * world * 3 + 1, E)
    for balance in ("none", "head_tail"):
        try:
            shard_sequence(x, balance=balance)
        except ValueError as e:
            msg = str(e)
            fail.check(
                f"uneven length, balance={balance}: names length and world size",
                str(x.shape[-2]) in msg and f"world size {world}" in msg,
                msg,
            )
        else:
            fail.check(f"uneven length, balance={balance}", False, "no error raised")
    q = torch.zeros(1, 1, 3, E)  # head_tail needs an even local length
    try:
        context_parallel_attention(q, q, q, balance="head_tail")
    except ValueError as e:
        fail.check(
            "context_parallel_attention, uneven head_tail",
            f"world size {world}" in str(e) and str(3 * world) in str(e),
            str(e),
        )
    else:
        fail.check("context_parallel_attention, uneven head_tail", False, "no error raised")


def run(rank: int, world: int, port: int, plan: list[tuple[str, object, str]], out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    fail = _Failures(rank)
    try:
        for i, (name, balance, method) in enumerate(plan):
            if name == "auto":
                fail.run("auto", _auto, fail)
            elif name == "groups":
                fail.run("groups", _groups, fail, world, i)
            elif name == "errors":
                fail.run("errors", _errors, fail, world)
            else:
                if balance == "document":
                    balance = Document([7, 4, 13])
                fail.run(f"{name}/{balance}/{method}", _one, fail, name, balance, method, i)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write("\n\n".join(fail.items))
        dist.destroy_process_group()
