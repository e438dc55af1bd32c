"""Mods for the compile-only tests (loaded by `python -m flexfa export FILE.py:NAME`)."""

import torch

import flexfa

_table = torch.zeros(4, 65, requires_grad=True)
_ids = torch.repeat_interleave(torch.arange(8), 128)

learned_bias = flexfa.mods.relative_bias(_table, 32)
document = flexfa.masks.document(_ids)
