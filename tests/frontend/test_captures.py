"""Captured tensors (slots, names, dtypes, indexing), the IR's type rules as the tracer applies
them, and what a TracedMod reports about itself."""

from __future__ import annotations

import torch

import flexfa
from flexfa.config import config
from flexfa.frontend import trace_mask_mod, trace_score_mod
from flexfa.ir import DType, Op
from tests.frontend.common import eager_values, scores, traced_values

TABLE = torch.randn(3, 4)  # a module-level tensor: captured through the mod's globals
ZEROS = torch.zeros(9)


def _loads(traced):
    return [n for n in traced.output.walk() if n.op is Op.LOAD]


def test_capture_names_come_from_the_code():
    slopes = torch.rand(3)

    def mod(score, b, h, q_idx, kv_idx, bias=ZEROS):
        return score * slopes[h] + TABLE[h, kv_idx % 4] + bias[q_idx]

    traced = trace_score_mod(mod)
    assert [c.name for c in traced.captures] == ["slopes", "TABLE", "bias"]
    assert [c.slot for c in traced.captures] == [0, 1, 2]
    assert traced.tensors[0] is slopes and traced.tensors[1] is TABLE and traced.tensors[2] is ZEROS
    assert [(c.dtype, c.ndim) for c in traced.captures] == [(DType.FLOAT32, 1)] * 1 + [
        (DType.FLOAT32, 2),
        (DType.FLOAT32, 1),
    ]
    assert "slopes[h]" in traced.format() and "captures slopes: f32[1d]" in traced.format()


def test_one_tensor_is_one_capture():
    ids = torch.arange(16) // 4
    traced = trace_mask_mod(flexfa.masks.and_masks(flexfa.masks.causal, flexfa.masks.document(ids)))
    assert len(traced.captures) == 1 and traced.tensors[0] is ids


def test_capture_names_are_unique_identifiers():
    def make(x):
        def part(score, b, h, q_idx, kv_idx):
            return x[h]

        return part

    first, second = make(torch.rand(2)), make(torch.rand(2))

    def both(score, b, h, q_idx, kv_idx):
        return first(score, b, h, q_idx, kv_idx) + second(score, b, h, q_idx, kv_idx) + score

    names = [c.name for c in trace_score_mod(both).captures]
    assert len(set(names)) == 2 and all(n.isidentifier() for n in names)

    score = torch.rand(2)  # a capture named like a mod parameter gets a distinct identifier

    def shadow(s, b, h, q_idx, kv_idx):
        return s + score[h]

    assert trace_score_mod(shadow).captures[0].name == "score_"


def test_zero_dim_capture_is_a_load_without_indices():
    temp = torch.tensor(1.5, requires_grad=True)
    traced = trace_score_mod(lambda s, b, h, q, k: s / temp)
    (load,) = _loads(traced)
    assert load.srcs[1:] == () and traced.captures[0].ndim == 0
    assert traced.grad_slots() == frozenset({0})


def test_chained_indexing_is_the_same_load():
    table = torch.randn(3, 5)
    chained = trace_score_mod(lambda s, b, h, q, k: s + table[h][(q - k) % 5])
    direct = trace_score_mod(lambda s, b, h, q, k: s + table[h, (q - k) % 5])
    assert chained.output is direct.output  # interned: the very same IR


def test_negative_constant_index_counts_from_the_end():
    table = torch.randn(3, 4)
    neg = trace_score_mod(lambda s, b, h, q, k: s + table[h, -1])
    pos = trace_score_mod(lambda s, b, h, q, k: s + table[h, 3])
    assert neg.output is pos.output


def test_zero_dim_int_tensor_as_index():
    table = torch.randn(3, 4)
    which = torch.tensor(2)
    traced = trace_score_mod(lambda s, b, h, q, k: s + table[h, which])
    assert len(traced.captures) == 2
    s = scores()
    torch.testing.assert_close(traced_values(traced, s), s + table[:, 2].view(1, 3, 1, 1))


def test_index_expressions_from_the_issue():
    bias = torch.randn(3, 1025)
    doc_id = torch.randint(0, 3, (2, 7))
    table = torch.randn(3, 8)

    def mod(score, b, h, q_idx, kv_idx):
        bucket = torch.clamp(q_idx - kv_idx, 0, 7)
        keep = doc_id[b, q_idx] == doc_id[b, torch.clamp(kv_idx, max=6)]
        return torch.where(keep, score + bias[h, q_idx - kv_idx + 512], table[h, bucket])

    traced = trace_score_mod(mod)
    assert {c.name for c in traced.captures} == {"bias", "doc_id", "table"}
    s = scores()
    torch.testing.assert_close(traced_values(traced, s), eager_values(mod, s).float())


def test_narrow_integer_and_bool_captures_load_as_int32_and_bool():
    codes = torch.tensor([-3, 1, 2, 7], dtype=torch.int8)
    keep = torch.tensor([True, False, True])
    traced = trace_score_mod(lambda s, b, h, q, k: torch.where(keep[h], s + codes[k % 4], s))
    dtypes = {c.name: c.dtype for c in traced.captures}
    assert dtypes == {"codes": DType.INT32, "keep": DType.BOOL}


def test_half_precision_loads_compute_in_float32():
    """Note [IR arithmetic types]: f16/bf16 loads are widened before any arithmetic."""
    half = torch.randn(3, dtype=torch.float16)
    traced = trace_score_mod(lambda s, b, h, q, k: half[h] * half[h] + s)
    arithmetic = [n for n in traced.output.walk() if n.op in (Op.MUL, Op.ADD)]
    assert arithmetic and all(n.dtype is DType.FLOAT32 for n in arithmetic)
    (load,) = _loads(traced)
    assert load.dtype is DType.FLOAT16


def test_float64_capture_promotes_then_the_output_is_float32():
    wide = torch.randn(3, dtype=torch.float64)
    traced = trace_score_mod(lambda s, b, h, q, k: s + wide[h])
    assert traced.output.op is Op.CAST and traced.output.dtype is DType.FLOAT32
    assert traced.output.srcs[0].op is Op.ADD and traced.output.srcs[0].dtype is DType.FLOAT64


def test_index_arithmetic_with_python_floats_is_float32():
    traced = trace_score_mod(lambda s, b, h, q, k: s * 0 + (q - k) * 0.5)
    assert traced.output.dtype is DType.FLOAT32
    assert any(n.op is Op.MUL and n.dtype is DType.FLOAT32 for n in traced.output.walk())
    ints = trace_score_mod(lambda s, b, h, q, k: (q - k) * 2 + h)
    assert ints.output.op is Op.CAST and ints.output.srcs[0].dtype is DType.INT32


def test_traced_mod_properties():
    identity = trace_score_mod(lambda s, b, h, q, k: s * 1.0 + 0)
    assert identity.is_identity
    assert trace_mask_mod(flexfa.noop_mask).is_trivially_true
    assert trace_mask_mod(flexfa.masks.causal).variables == {"q_idx", "kv_idx"}
    head = trace_mask_mod(lambda b, h, q, k: (h == 0) | (q >= k))
    assert head.variables == {"h", "q_idx", "kv_idx"}
    assert head.params == ("b", "h", "q_idx", "kv_idx")


def test_key_ignores_tensor_values_but_not_their_types():
    def make(t):
        return lambda s, b, h, q, k: s + t[h]

    a, b = (trace_score_mod(make(torch.randn(4))) for _ in range(2))
    assert a.key == b.key  # new values, same kernels
    c = trace_score_mod(make(torch.randn(4, dtype=torch.float64)))
    assert c.key != a.key
    rebound = a.with_tensors((torch.ones(4),))
    assert rebound.output is a.output and torch.equal(rebound.tensors[0], torch.ones(4))


def test_grad_slots_are_float_tensors_requiring_grad():
    learn = torch.randn(3, requires_grad=True)
    frozen = torch.randn(3)
    ids = torch.arange(3)
    traced = trace_score_mod(lambda s, b, h, q, k: s + learn[h] + frozen[h] + ids[h])
    slot = {c.name: c.slot for c in traced.captures}
    assert traced.grad_slots() == frozenset({slot["learn"]})
    grad = traced.gradient(traced.grad_slots())
    assert [g.slot for g in grad.loads] == [slot["learn"]]


def test_ir_is_verified_under_pytest():
    assert config.verify_ir
    with config.override(verify_ir=False):
        assert not config.verify_ir


def test_dump_ir_writes_the_graph_and_its_gradient(tmp_path):
    table = torch.randn(2, 3, requires_grad=True)

    def dumped_mod(score, b, h, q_idx, kv_idx):
        return score * table[h, q_idx % 3]

    with config.override(dump_ir=tmp_path):
        trace_score_mod(dumped_mod)
    (path,) = tmp_path.glob("score_mod_dumped_mod_*.ir")
    text = path.read_text()
    assert "table[h" in text and "gradient" in text and "d_score" in text


def test_lambda_and_partial_names():
    import functools

    assert trace_mask_mod(lambda b, h, q, k: q >= k).name == "mask_mod"

    def windowed(b, h, q_idx, kv_idx, w):
        return q_idx - kv_idx < w

    assert trace_mask_mod(functools.partial(windowed, w=3)).name == "windowed"


def test_key_tells_apart_captures_whose_uses_simplified_away() -> None:
    # `x != x` of an integer simplifies to False, leaving `q_idx <= 9` with a capture it no
    # longer reads; generated functions still take that capture as parameters, so the key (which
    # names generated modules) must differ from the plain mask's.
    docs = torch.zeros(3, 10, dtype=torch.int32)
    with_capture = flexfa.trace_mask_mod(
        lambda b, h, q, kv: ((q <= 9) & ((docs[b, q] + 1) != (docs[b, q] + 1))) | (q <= 9)
    )
    plain = flexfa.trace_mask_mod(lambda b, h, q, kv: q <= 9)
    assert with_capture.output is plain.output
    assert len(with_capture.captures) == 1 and not plain.captures
    assert with_capture.key != plain.key
