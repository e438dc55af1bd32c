"""What the tracer says when a mod cannot be traced: a TypeError (ModTraceError) that names the mod
and tells the user what to write instead."""

from __future__ import annotations

import math

import pytest
import torch

from flexfa.frontend import ModTraceError, trace_mask_mod, trace_score_mod

TABLE = torch.randn(3, 4)


def _score_error(fn) -> str:
    with pytest.raises(ModTraceError) as info:
        trace_score_mod(fn)
    return str(info.value)


def _mask_error(fn) -> str:
    with pytest.raises(ModTraceError) as info:
        trace_mask_mod(fn)
    return str(info.value)


def test_mod_trace_error_is_a_type_error():
    assert issubclass(ModTraceError, TypeError)


# -- Python control flow --------------------------------------------------------------------------


def branchy(score, b, h, q_idx, kv_idx):
    if q_idx > kv_idx:
        return score
    return score * 2


def uses_and(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx and h == 0


def uses_not(b, h, q_idx, kv_idx):
    return not q_idx > kv_idx


def uses_builtin_min(score, b, h, q_idx, kv_idx):
    return score + min(q_idx, kv_idx)


def chained_compare(b, h, q_idx, kv_idx):
    return 0 <= q_idx - kv_idx < 4


def ternary(score, b, h, q_idx, kv_idx):
    return score if h == 0 else -score


@pytest.mark.parametrize(
    "fn",
    [branchy, uses_and, uses_not, uses_builtin_min, chained_compare, ternary],
    ids=lambda f: f.__name__,
)
def test_control_flow_points_to_torch_where(fn):
    n_args = fn.__code__.co_argcount
    message = _score_error(fn) if n_args == 5 else _mask_error(fn)
    assert fn.__name__ in message
    assert "torch.where" in message and "Python bool" in message


# -- unsupported operations ------------------------------------------------------------------------


def lgamma_mod(score, b, h, q_idx, kv_idx):
    return torch.lgamma(score)


def softmax_mod(score, b, h, q_idx, kv_idx):
    return torch.nn.functional.glu(score)


def math_mod(score, b, h, q_idx, kv_idx):
    return math.tanh(score)


def method_mod(score, b, h, q_idx, kv_idx):
    return score.softmax(0)


def shift_mod(score, b, h, q_idx, kv_idx):
    return score + (q_idx @ kv_idx)


def test_unsupported_torch_function_is_named():
    message = _score_error(lgamma_mod)
    assert "'lgamma_mod'" in message and "torch.lgamma cannot be traced" in message
    assert "docs/semantics.md" in message
    assert "glu cannot be traced" in _score_error(softmax_mod)


def test_math_module_functions_point_to_torch():
    message = _score_error(math_mod)
    assert "math_mod" in message and "torch.tanh instead of math.tanh" in message


def test_unsupported_tensor_method_is_named():
    message = _score_error(method_mod)
    assert "method_mod" in message and ".softmax()" in message


def test_unsupported_python_operator_is_reported_with_the_mod():
    message = _score_error(shift_mod)
    assert "shift_mod" in message and "@" in message


def test_other_exceptions_inside_a_mod_name_the_mod():
    def broken(score, b, h, q_idx, kv_idx):
        raise RuntimeError("custom failure")

    message = _score_error(broken)
    assert "'broken'" in message and "RuntimeError" in message and "custom failure" in message


def test_scalar_conversions_are_refused():
    assert "int() of a traced value" in _score_error(lambda s, b, h, q, k: s + int(q))
    assert ".item()" in _score_error(lambda s, b, h, q, k: s + q.item())
    assert "no len()" in _score_error(lambda s, b, h, q, k: s + len(q))
    assert "cannot be iterated" in _score_error(lambda s, b, h, q, k: s + sum(q))
    assert "cannot be indexed" in _score_error(lambda s, b, h, q, k: s[0])


# -- types ----------------------------------------------------------------------------------------


def test_score_mod_returning_bool_suggests_a_mask_mod():
    message = _score_error(lambda s, b, h, q, k: q >= k)
    assert "returned a bool" in message and "mask_mod" in message and "block_mask=" in message


def test_mask_mod_returning_a_number():
    def distance(b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    message = _mask_error(distance)
    assert "'distance'" in message and "must return a bool" in message and "i32" in message
    assert "must return a bool" in _mask_error(lambda b, h, q, k: (q - k) * 0.5)


def test_mod_returning_none_or_a_tuple():
    assert "returned None" in _score_error(lambda s, b, h, q, k: None)
    assert "tuple" in _score_error(lambda s, b, h, q, k: (s, s))
    assert "str" in _mask_error(lambda b, h, q, k: "yes")


def test_bool_arithmetic_and_float_logic_are_type_errors():
    assert "bool" in _score_error(lambda s, b, h, q, k: s + -(q > k))
    assert "needs bool" in _score_error(lambda s, b, h, q, k: torch.where((s > 0) & s, s, 0.0))
    assert "bool condition" in _score_error(lambda s, b, h, q, k: torch.where(q, s, 0.0))


def test_integer_to_a_negative_power():
    message = _score_error(lambda s, b, h, q, k: s + (q + 1) ** -1)
    assert "negative power" in message and "2.0 ** -x" in message


def test_integer_constant_out_of_range():
    message = _score_error(lambda s, b, h, q, k: s + torch.full_like(q, 2**40))
    assert "does not fit in i32" in message


# -- arity -----------------------------------------------------------------------------------------


def test_score_mod_with_four_arguments():
    def four(score, b, h, q_idx):
        return score

    with pytest.raises(TypeError, match=r"score_mod 'four' must accept 5 positional arguments"):
        trace_score_mod(four)


def test_mask_mod_with_five_arguments():
    def five(score, b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    with pytest.raises(TypeError, match=r"mask_mod 'five' must accept 4 positional arguments"):
        trace_mask_mod(five)


def test_flexible_signatures_are_accepted():
    trace_score_mod(lambda *args: args[0])
    trace_mask_mod(lambda b, h, q, k, extra=1: q >= k)


def test_non_callable_mod():
    with pytest.raises(TypeError, match="must be a callable"):
        trace_score_mod(3.0)


# -- captured tensors ------------------------------------------------------------------------------


def test_float_index():
    message = _score_error(lambda s, b, h, q, k: s + TABLE[h, s])
    assert "index 1 into captured tensor 'TABLE' is a float" in message
    assert ".to(torch.int32)" in message


def test_unindexed_tensor():
    message = _score_error(lambda s, b, h, q, k: s + TABLE)
    assert "'TABLE' of shape (3, 4) was used without indexing" in message


def test_partially_indexed_tensor():
    # TABLE[h] is a vector of 4 (Note [Unrolled reductions]): returning it is the error
    message = _score_error(lambda s, b, h, q, k: s + TABLE[h])
    assert "a value of shape (4,) was used where a scalar is needed" in message
    assert ".sum(-1)" in message
    message = _score_error(lambda s, b, h, q, k: s + float(TABLE[h]))
    assert "'TABLE' has 2 dims but was used after indexing only 1" in message


def test_too_many_indices():
    message = _score_error(lambda s, b, h, q, k: s + TABLE[h, q, k])
    assert "too many indices for captured tensor 'TABLE'" in message


def test_constant_index_out_of_range():
    message = _score_error(lambda s, b, h, q, k: s + TABLE[h, 4])
    assert "index 4 is out of range for dim 1 of 'TABLE' (size 4)" in message


def test_slices_and_none_that_leave_a_vector_or_gather_are_refused():
    # Note [Shape operations on traced values]: slices, None and ... trace, but a mod returns
    # one value per pair, and a traced index after a slice would be a gather.
    assert "reduce it" in _score_error(lambda s, b, h, q, k: s + TABLE[h, 1:3])
    assert "reduce it" in _score_error(lambda s, b, h, q, k: s + TABLE[h, None])
    assert "put the traced indices first" in _score_error(lambda s, b, h, q, k: s + TABLE[:, h])
    assert "single ellipsis" in _score_error(lambda s, b, h, q, k: s + TABLE[h][..., ...])
    assert "too many indices" in _score_error(lambda s, b, h, q, k: s + TABLE[h][0, :])
    assert "leaves no elements" in _score_error(lambda s, b, h, q, k: s + TABLE[h, 2:2].sum())
    assert "cannot be indexed" in _score_error(lambda s, b, h, q, k: s[:])


def test_bad_views_are_refused():
    assert "invalid for a traced tensor of 4" in _score_error(
        lambda s, b, h, q, k: s + TABLE[h].view(3).sum()
    )
    assert "only one size may be -1" in _score_error(
        lambda s, b, h, q, k: s + TABLE[h].reshape(-1, -1).sum()
    )
    assert "use .to(dtype)" in _score_error(lambda s, b, h, q, k: s.view(torch.int32))


def test_python_containers_cannot_be_indexed_by_traced_values():
    slopes = [0.5, 0.25, 0.125]
    message = _score_error(lambda s, b, h, q, k: s + slopes[h])
    assert "put the data in a torch tensor" in message


def test_unsupported_capture_dtype():
    phases = torch.randn(3, dtype=torch.complex64)
    message = _score_error(lambda s, b, h, q, k: s + phases[h])
    assert "'phases' has dtype torch.complex64" in message


def test_unsupported_cast_target():
    message = _score_error(lambda s, b, h, q, k: s.to(torch.complex64))
    assert "complex64" in message
