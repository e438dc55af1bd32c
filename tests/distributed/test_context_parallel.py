"""Context parallelism on gloo: every method and balance against single-process flexfa.attention.

One spawned world per world size runs all its cases (tests/distributed/worker.py); the cases are
causal, document-causal (captured document ids), a strict sliding window with ALiBi (captured
slopes with gradients, an empty first row) and full attention with a captured bias (with
gradients); GQA in two of them; forward, LSE and every gradient.
"""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed import worker
from tests.tiers import sweep

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)

BALANCES = ("none", "head_tail")
METHODS = ("ring", "allgather")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plan(world: int) -> list[tuple[str, object, str]]:
    """All four cases in both balances and both methods at W = 2; at W = 3 and 4 each case in two
    of the four (balance, method) pairs, rotating so every pair is covered per world size."""
    combos = [(b, m) for b in BALANCES for m in METHODS]
    plan = []
    for n, name in enumerate(worker.CASES):
        if world == 2:
            plan += [(name, b, m) for b, m in combos]
        else:
            plan += [(name, *combos[(n + world) % 4]), (name, *combos[(n + world + 2) % 4])]
    plan.append(("document_causal", "document", "ring" if world != 3 else "allgather"))
    plan.append(("auto", None, "auto"))
    if world != 3:
        plan.append(("groups", None, ""))
    plan.append(("errors", None, ""))
    return plan


@pytest.mark.parametrize("world", sweep([2, 3, 4]))
def test_matches_single_process(world, tmp_path):
    mp.spawn(
        worker.run,
        args=(world, _free_port(), _plan(world), str(tmp_path)),
        nprocs=world,
        join=True,
    )
    failures = [(tmp_path / f"rank{r}.txt").read_text() for r in range(world)]
    failures = [f for f in failures if f]
    assert not failures, "\n\n".join(failures)


def test_plan_covers_every_pair():
    for world in (3, 4):
        pairs = {(b, m) for name, b, m in _plan(world) if name in worker.CASES and b in BALANCES}
        assert pairs == {(b, m) for b in BALANCES for m in METHODS}
