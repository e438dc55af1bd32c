"""Launcher plans are built once per configuration and reused (flexfa/codegen/triton/plan.py)."""

from __future__ import annotations

import torch

import flexfa
from flexfa.api import build_spec
from flexfa.codegen.triton.backend import Launcher


def _spec(**kwargs):
    q = torch.empty(1, 2, 256, 64, dtype=torch.float16)
    return build_spec(q, q, q, flexfa.mods.softcap(30.0), flexfa.masks.causal, **kwargs)


def test_the_same_configuration_reuses_its_plan():
    a = Launcher(_spec(), capability=(9, 0))
    b = Launcher(_spec(), capability=(9, 0))
    assert a.plan is b.plan


def test_options_head_dims_and_architecture_get_their_own_plans():
    base = Launcher(_spec(), capability=(9, 0))
    pinned = Launcher(_spec(kernel_options={"block_m": 64}), capability=(9, 0))
    assert pinned.plan is not base.plan
    assert pinned.configs.fwd.block_m == 64
    assert Launcher(_spec(), capability=(8, 0)).plan is not base.plan
    q = torch.empty(1, 2, 256, 128, dtype=torch.float16)
    wider = Launcher(
        build_spec(q, q, q, flexfa.mods.softcap(30.0), flexfa.masks.causal), capability=(9, 0)
    )
    assert wider.plan is not base.plan and wider.head_dim_pad == 128


def test_unhashable_options_still_work_without_caching():
    spec = _spec(kernel_options={"block_m": 64, "autotune": False})
    a, b = Launcher(spec, capability=(9, 0)), Launcher(spec, capability=(9, 0))
    assert a.plan is b.plan  # hashable: cached
    from flexfa.codegen.triton.plan import plan_key

    unhashable = _spec(kernel_options={"block_m": 64, "extra": []})
    assert plan_key(unhashable, None, (9, 0), False) is None
