"""A shared catalog of score_mods and mask_mods, for every test directory.

Each entry is a `ModEntry`: a name, its kind, whether it captures tensors that need grad
(`learnable`), and a `build(shape, ...)` that returns a `BuiltMod`: the plain Python function and
the captured tensors whose gradients a test should check. Entries are factories because captured
tensors are sized by the call (document ids by the sequence lengths, bias tables by the number of
heads).

Every mod here is ordinary torch code: called eagerly on one pair at a time (flexfa.reference does
that with vmap, Note [Mods are applied per pair]) it computes what flexfa computes from its trace.
The mods are finite with finite derivatives at every pair, masked or not, so that comparisons in
low precision measure rounding only.

    import pytest
    from tests.mods import SCORE_MODS, Shape

    @pytest.mark.parametrize("entry", SCORE_MODS, ids=str)
    def test_something(entry):
        built = entry.build(Shape(batch=2, heads=4, len_q=33, len_kv=47))
        out = flexfa.attention(q, k, v, score_mod=built.fn)
        out.sum().backward()            # built.params now hold gradients
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Literal

import torch

import flexfa
from flexfa import masks as fm
from flexfa import mods as fmods

Kind = Literal["score_mod", "mask_mod"]


@dataclasses.dataclass(frozen=True)
class Shape:
    """The sizes a mod is built for: `heads` counts query heads."""

    batch: int
    heads: int
    len_q: int
    len_kv: int
    device: str = "cpu"


@dataclasses.dataclass(frozen=True)
class BuiltMod:
    """A mod ready to call: `fn`, and `params`, the captured leaf tensors that require grad."""

    fn: Callable[..., object]
    params: tuple[torch.Tensor, ...] = ()


@dataclasses.dataclass(frozen=True)
class ModEntry:
    """One catalog entry. `build(shape, dtype=..., seed=..., requires_grad=...)` makes the mod.

    Float tensors a mod captures are drawn in float32 from a generator seeded with `seed`, then
    converted to `dtype`, so builds in different dtypes hold the same values where representable.
    """

    name: str
    kind: Kind
    learnable: bool
    make: Callable[[_Ctx], BuiltMod]
    doc: str = ""

    def build(
        self,
        shape: Shape,
        *,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        requires_grad: bool = True,
    ) -> BuiltMod:
        return self.make(_Ctx(shape, dtype, seed, requires_grad))

    def __str__(self) -> str:
        return self.name


class _Ctx:
    """What a catalog factory needs: the shape and a seeded source of captured tensors."""

    def __init__(self, shape: Shape, dtype: torch.dtype, seed: int, requires_grad: bool) -> None:
        self.shape = shape
        self.dtype = dtype
        self.requires_grad = requires_grad
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *size: int, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
        t = torch.randn(size, generator=self.gen) * scale + offset
        return t.to(device=self.shape.device, dtype=self.dtype)

    def learnable(self, *size: int, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
        return self.randn(*size, scale=scale, offset=offset).requires_grad_(self.requires_grad)

    def randint(self, low: int, high: int, *size: int, dtype=torch.int32) -> torch.Tensor:
        t = torch.randint(low, high, size, generator=self.gen)
        return t.to(device=self.shape.device, dtype=dtype)

    def doc_ids(self, length: int, *rows: int) -> torch.Tensor:
        """Non-decreasing document ids (packed sequences), documents of 1 to 9 tokens."""
        n = max(rows) if rows else 1
        out = []
        for _ in range(n):
            sizes = torch.randint(1, 10, (length,), generator=self.gen)
            out.append(torch.repeat_interleave(torch.arange(length), sizes)[:length])
        ids = torch.stack(out) if rows else out[0]
        return ids.to(device=self.shape.device, dtype=torch.int32)


SCORE_MODS: list[ModEntry] = []
MASK_MODS: list[ModEntry] = []


def _entry(kind: Kind, name: str, *, learnable: bool = False):
    def register(make: Callable[[_Ctx], BuiltMod]) -> Callable[[_Ctx], BuiltMod]:
        entry = ModEntry(name, kind, learnable, make, (make.__doc__ or "").strip())
        (SCORE_MODS if kind == "score_mod" else MASK_MODS).append(entry)
        return make

    return register


def _score(name: str, *, learnable: bool = False):
    return _entry("score_mod", name, learnable=learnable)


def _mask(name: str):
    return _entry("mask_mod", name)


# ------------------------------------------------------------------------------------------------
# score_mods
# ------------------------------------------------------------------------------------------------


@_score("identity")
def _identity(c: _Ctx) -> BuiltMod:
    """The score unchanged."""
    return BuiltMod(fmods.identity)


@_score("alibi")
def _alibi(c: _Ctx) -> BuiltMod:
    """flexfa.mods.alibi bound to the number of heads (slopes computed from h, no capture)."""
    return BuiltMod(fmods.alibi.bind(c.shape.heads))


@_score("alibi_slope_table")
def _alibi_table(c: _Ctx) -> BuiltMod:
    """ALiBi with a captured per-head slope table (not learnable)."""
    slopes = torch.exp2(-8.0 * torch.arange(1, c.shape.heads + 1) / c.shape.heads).to(c.dtype)

    def alibi_slope_table(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return BuiltMod(alibi_slope_table)


@_score("softcap")
def _softcap(c: _Ctx) -> BuiltMod:
    """flexfa.mods.softcap with a cap small enough to matter: 1.5 * tanh(score / 1.5)."""
    return BuiltMod(fmods.softcap(1.5))


@_score("relative_bias_per_head", learnable=True)
def _rel_bias_heads(c: _Ctx) -> BuiltMod:
    """flexfa.mods.relative_bias with a learnable (H, 17) table."""
    table = c.learnable(c.shape.heads, 17, scale=0.5)
    return BuiltMod(fmods.relative_bias(table), (table,))


@_score("relative_bias_shared", learnable=True)
def _rel_bias_shared(c: _Ctx) -> BuiltMod:
    """flexfa.mods.relative_bias with one learnable table for all heads, max_distance 4."""
    table = c.learnable(9, scale=0.5)
    return BuiltMod(fmods.relative_bias(table, 4), (table,))


@_score("temperature", learnable=True)
def _temperature(c: _Ctx) -> BuiltMod:
    """A learnable 0-dim temperature: score / temp."""
    temp = c.learnable(scale=0.1, offset=1.3)

    def temperature(score, b, h, q_idx, kv_idx):
        return score / temp

    return BuiltMod(temperature, (temp,))


@_score("head_gate", learnable=True)
def _head_gate(c: _Ctx) -> BuiltMod:
    """A learnable per-head gate on the score: score * 2 sigmoid(gate[h])."""
    gate = c.learnable(c.shape.heads)

    def head_gate(score, b, h, q_idx, kv_idx):
        return score * (2 * torch.sigmoid(gate[h]))

    return BuiltMod(head_gate, (gate,))


@_score("t5_buckets", learnable=True)
def _t5(c: _Ctx) -> BuiltMod:
    """T5-style bidirectional log buckets into a learnable (H, 16) table (int math, log, floor)."""
    table = c.learnable(c.shape.heads, 16, scale=0.5)
    exact, num_buckets, max_distance = 4, 8, 64

    def t5_buckets(score, b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        side = (d < 0).to(torch.int32) * num_buckets
        n = torch.abs(d)
        scaled = torch.log(n.to(torch.float32) / exact + 1e-3) / math.log(max_distance / exact)
        large = exact + (scaled * (num_buckets - exact)).to(torch.int32)
        large = torch.clamp(large, max=num_buckets - 1)
        bucket = side + torch.where(n < exact, n, large)
        return score + table[h, bucket]

    return BuiltMod(t5_buckets, (table,))


@_score("position_bias_product", learnable=True)
def _pos_product(c: _Ctx) -> BuiltMod:
    """Two learnable per-position tables multiplied: the derivative of one load reads the other."""
    q_bias = c.learnable(c.shape.len_q, scale=0.5)
    kv_bias = c.learnable(c.shape.len_kv, scale=0.5)

    def position_bias_product(score, b, h, q_idx, kv_idx):
        return score + q_bias[q_idx] * kv_bias[kv_idx]

    return BuiltMod(position_bias_product, (q_bias, kv_bias))


@_score("same_table_twice", learnable=True)
def _same_table_twice(c: _Ctx) -> BuiltMod:
    """Two loads from one learnable table at different indices (two scatter-adds into one grad)."""
    table = c.learnable(c.shape.heads, 4, scale=0.5)

    def same_table_twice(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx % 4] - 0.5 * table[h, kv_idx % 4]

    return BuiltMod(same_table_twice, (table,))


@_score("batch_head_bias", learnable=True)
def _batch_head_bias(c: _Ctx) -> BuiltMod:
    """A learnable bias per (batch, head), indexed with chained indexing bias[b][h]."""
    bias = c.learnable(c.shape.batch, c.shape.heads)

    def batch_head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[b][h]

    return BuiltMod(batch_head_bias, (bias,))


@_score("logit_scale", learnable=True)
def _logit_scale(c: _Ctx) -> BuiltMod:
    """score * exp(logit_scale[h]) with a learnable table, plus a constant-index load [h, -1]."""
    scale = c.learnable(c.shape.heads, 3, scale=0.3)

    def logit_scale(score, b, h, q_idx, kv_idx):
        return score * torch.exp(scale[h, 0]) + scale[h, -1]

    return BuiltMod(logit_scale, (scale,))


@_score("document_bias")
def _document_bias(c: _Ctx) -> BuiltMod:
    """Reads int document ids: +0.5 within a document, -0.5 across."""
    q_doc = c.doc_ids(c.shape.len_q)
    kv_doc = c.doc_ids(c.shape.len_kv)

    def document_bias(score, b, h, q_idx, kv_idx):
        return score + torch.where(q_doc[q_idx] == kv_doc[kv_idx], 0.5, -0.5)

    return BuiltMod(document_bias)


@_score("floordiv_mod_negative")
def _floordiv_mod(c: _Ctx) -> BuiltMod:
    """// and % with negative dividends and divisors (floor semantics, as in Python and torch)."""

    def floordiv_mod_negative(score, b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        return (
            score
            + 0.1 * (d // 3)
            + 0.05 * (d % 5)
            - 0.07 * (d // -4)
            + 0.03 * (d % -3)
            + 0.02 * ((kv_idx - 2 * q_idx) // 7 % 4)
        )

    return BuiltMod(floordiv_mod_negative)


@_score("where_clamp_min_max")
def _where_clamp(c: _Ctx) -> BuiltMod:
    """torch.where on index parity choosing between clamp and a minimum/maximum expression."""

    def where_clamp_min_max(score, b, h, q_idx, kv_idx):
        even = (q_idx + kv_idx) % 2 == 0
        clamped = torch.clamp(score, -1.0, 1.5)
        bent = torch.maximum(score, 0.25 * score - 0.5)
        near = torch.minimum(score, (q_idx - kv_idx) * 0.125)
        return torch.where(even, clamped, bent) + 0.5 * near

    return BuiltMod(where_clamp_min_max)


@_score("casts")
def _casts(c: _Ctx) -> BuiltMod:
    """.to(dtype), .float(), .double(), truncating float->int casts and an fp16 captured table."""
    half_table = (torch.arange(c.shape.heads, dtype=torch.float32) * 0.25 - 0.5).to(torch.float16)

    def casts(score, b, h, q_idx, kv_idx):
        wide = score.double() + (q_idx % 7).to(torch.float64) * 0.01
        trunc = ((q_idx - kv_idx) * 0.25).to(torch.int32).float() * 0.1
        return wide.to(torch.float32) + trunc + half_table[h].float() - (kv_idx % 3).float() * 0.02

    return BuiltMod(casts)


@_score("math_zoo")
def _math_zoo(c: _Ctx) -> BuiltMod:
    """Every float unary function: sin cos sigmoid sqrt exp2 log log2 rsqrt exp tanh abs."""

    def math_zoo(score, b, h, q_idx, kv_idx):
        return (
            score
            + 0.1 * torch.sin(kv_idx * 0.3)
            + 0.1 * torch.cos(q_idx * 0.2)
            + 0.5 * torch.sigmoid(score)
            - 0.05 * torch.sqrt(torch.abs(q_idx - kv_idx) + 1.0)
            + 0.1 * torch.exp2(-torch.abs(score))
            + 0.1 * torch.log(1 + score * score)
            + 0.1 * torch.log2(kv_idx + 1.0)
            + 0.2 * torch.rsqrt(q_idx + 1.0)
            + 0.05 * torch.exp(torch.tanh(score))
        )

    return BuiltMod(math_zoo)


@_score("sign_floor_ceil")
def _sign_floor_ceil(c: _Ctx) -> BuiltMod:
    """Piecewise-constant functions of the indices (zero derivatives)."""

    def sign_floor_ceil(score, b, h, q_idx, kv_idx):
        return (
            score
            + 0.3 * torch.sign(q_idx - kv_idx)
            + 0.1 * torch.floor((q_idx - kv_idx) / 3)
            - 0.1 * torch.ceil(kv_idx / 4)
        )

    return BuiltMod(sign_floor_ceil)


@_score("powers")
def _powers(c: _Ctx) -> BuiltMod:
    """** with float, integer and tensor exponents, and a Python number raised to a traced one."""

    def powers(score, b, h, q_idx, kv_idx):
        return (
            score
            + 0.01 * (torch.abs(q_idx - kv_idx) + 1.0) ** 1.5
            - 0.1 * score**2
            + 0.02 * score**3
            + 0.3 * 2.0 ** (-(h % 3))
        )

    return BuiltMod(powers)


@_score("causal_by_score")
def _causal_by_score(c: _Ctx) -> BuiltMod:
    """Masking through the score: -inf where kv_idx > q_idx (rows keep at least key 0)."""

    def causal_by_score(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, score, float("-inf"))

    return BuiltMod(causal_by_score)


@_score("tensor_methods")
def _methods(c: _Ctx) -> BuiltMod:
    """The method spellings: score.tanh(), x.float().sin(), score.clamp(min=...), x.mul(...)."""

    def tensor_methods(score, b, h, q_idx, kv_idx):
        return (
            score.tanh() * 2
            + q_idx.float().sin() * 0.1
            + score.clamp(min=-1.0) * 0.1
            + kv_idx.to(torch.float32).mul(0.01)
        )

    return BuiltMod(tensor_methods)


@_score("bool_and_int8_captures")
def _bool_int8(c: _Ctx) -> BuiltMod:
    """A captured bool tensor in a torch.where and an int8 table in arithmetic."""
    keep = c.randint(0, 2, c.shape.len_kv, dtype=torch.bool)
    codes = c.randint(-3, 4, 5, dtype=torch.int8)

    def bool_and_int8_captures(score, b, h, q_idx, kv_idx):
        return score + torch.where(keep[kv_idx], 0.0, -2.0) + 0.1 * codes[kv_idx % 5]

    return BuiltMod(bool_and_int8_captures)


# ------------------------------------------------------------------------------------------------
# mask_mods
# ------------------------------------------------------------------------------------------------


@_mask("noop")
def _noop(c: _Ctx) -> BuiltMod:
    """Every pair attends."""
    return BuiltMod(flexfa.noop_mask)


@_mask("causal")
def _causal(c: _Ctx) -> BuiltMod:
    """Top-left aligned causal mask."""
    return BuiltMod(fm.causal)


@_mask("sliding_window")
def _sliding(c: _Ctx) -> BuiltMod:
    """Causal sliding window of 5 keys."""
    return BuiltMod(fm.sliding_window(5))


@_mask("sliding_window_bidirectional")
def _sliding_bi(c: _Ctx) -> BuiltMod:
    """|q_idx - kv_idx| < 4."""
    return BuiltMod(fm.sliding_window(4, causal=False))


@_mask("prefix_lm")
def _prefix_lm(c: _Ctx) -> BuiltMod:
    """Bidirectional over the first 7 keys, causal after."""
    return BuiltMod(fm.prefix_lm(7))


@_mask("chunked")
def _chunked(c: _Ctx) -> BuiltMod:
    """Block-diagonal chunks of 6."""
    return BuiltMod(fm.chunked(6))


@_mask("dilated_sliding_window")
def _dilated(c: _Ctx) -> BuiltMod:
    """Within 9 on either side, every third key."""
    return BuiltMod(fm.dilated_sliding_window(9, 3))


@_mask("document")
def _document(c: _Ctx) -> BuiltMod:
    """flexfa.masks.document with separate query and key document ids."""
    return BuiltMod(fm.document(c.doc_ids(c.shape.len_q), c.doc_ids(c.shape.len_kv)))


@_mask("document_per_batch")
def _document_batched(c: _Ctx) -> BuiltMod:
    """Document ids per batch element, (B, L): the mask reads b."""
    B = c.shape.batch
    return BuiltMod(fm.document(c.doc_ids(c.shape.len_q, B), c.doc_ids(c.shape.len_kv, B)))


@_mask("causal_document")
def _causal_document(c: _Ctx) -> BuiltMod:
    """and_masks(causal, document)."""
    ids = c.doc_ids(max(c.shape.len_q, c.shape.len_kv))
    return BuiltMod(fm.and_masks(fm.causal, fm.document(ids)))


@_mask("prefix_or_window")
def _prefix_or_window(c: _Ctx) -> BuiltMod:
    """or_masks(prefix_lm(4), sliding_window(3))."""
    return BuiltMod(fm.or_masks(fm.prefix_lm(4), fm.sliding_window(3)))


@_mask("strictly_causal")
def _strict(c: _Ctx) -> BuiltMod:
    """kv_idx < q_idx: query 0 attends to nothing (an empty row)."""

    def strictly_causal(b, h, q_idx, kv_idx):
        return kv_idx < q_idx

    return BuiltMod(strictly_causal)


@_mask("head_dependent")
def _head_dependent(c: _Ctx) -> BuiltMod:
    """Even heads see everything, odd heads are causal."""

    def head_dependent(b, h, q_idx, kv_idx):
        return (h % 2 == 0) | (q_idx >= kv_idx)

    return BuiltMod(head_dependent)


@_mask("key_padding")
def _key_padding(c: _Ctx) -> BuiltMod:
    """Per-batch valid key lengths (a length of 0 empties every row of that batch element)."""
    lengths = c.randint(0, c.shape.len_kv + 1, c.shape.batch)

    def key_padding(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    return BuiltMod(key_padding)


@_mask("modular_negative")
def _modular(c: _Ctx) -> BuiltMod:
    """% and // on negative differences inside comparisons."""

    def modular_negative(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx) % 4 == 0) | ((kv_idx - q_idx) // 3 == -1)

    return BuiltMod(modular_negative)


@_mask("every_third_row_empty")
def _third_rows(c: _Ctx) -> BuiltMod:
    """Rows with q_idx % 3 == 1 attend to nothing; the others see keys up to q_idx + 2."""

    def every_third_row_empty(b, h, q_idx, kv_idx):
        return (q_idx % 3 != 1) & (kv_idx <= q_idx + 2)

    return BuiltMod(every_third_row_empty)


@_mask("bool_table")
def _bool_table(c: _Ctx) -> BuiltMod:
    """A captured random bool pattern, keep[q_idx % 5, kv_idx % 7]."""
    keep = c.randint(0, 2, 5, 7, dtype=torch.bool)

    def bool_table(b, h, q_idx, kv_idx):
        return keep[q_idx % 5, kv_idx % 7]

    return BuiltMod(bool_table)


@_mask("inverted")
def _inverted(c: _Ctx) -> BuiltMod:
    """Causal written with ~: ~(kv_idx > q_idx)."""

    def inverted(b, h, q_idx, kv_idx):
        return ~(kv_idx > q_idx)

    return BuiltMod(inverted)


@_mask("empty")
def _empty(c: _Ctx) -> BuiltMod:
    """No pair attends at all."""

    def empty(b, h, q_idx, kv_idx):
        return q_idx < 0

    return BuiltMod(empty)


SCORE_MODS_BY_NAME = {e.name: e for e in SCORE_MODS}
MASK_MODS_BY_NAME = {e.name: e for e in MASK_MODS}
LEARNABLE_SCORE_MODS = [e for e in SCORE_MODS if e.learnable]
ALL_MODS = [*SCORE_MODS, *MASK_MODS]


def score_mod(name: str) -> ModEntry:
    """The score_mod entry called `name`."""
    return SCORE_MODS_BY_NAME[name]


def mask_mod(name: str) -> ModEntry:
    """The mask_mod entry called `name`."""
    return MASK_MODS_BY_NAME[name]
