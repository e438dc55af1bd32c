"""Property tests: the tiled backend agrees with the reference on generated problems.

Shapes, dtypes, tilings, catalog mods and grammar-generated mods are drawn by hypothesis; every
case compares output, LSE, dq/dk/dv and captured-tensor gradients with the three-way rule.
"""

from __future__ import annotations

from hypothesis import given, note, settings
from hypothesis import strategies as st

from tests.e2e.harness import check_attention, maker
from tests.e2e.randmods import RandomMod, random_mask_mods, random_score_mods
from tests.e2e.strategies import BLOCK_SIZES, STEP_COLUMNS, examples, layouts, problems
from tests.mods import MASK_MODS, SCORE_MODS


@settings(max_examples=examples(120), deadline=None)
@given(
    problem=problems(),
    score=st.sampled_from([None, *SCORE_MODS]),
    mask=st.sampled_from([None, *MASK_MODS]),
    block_size=BLOCK_SIZES,
    step=STEP_COLUMNS,
    seed=st.integers(0, 2**16),
    lse_grad=st.booleans(),
    layout=layouts(),
)
def test_catalog_mods(problem, score, mask, block_size, step, seed, lse_grad, layout):
    note(f"{problem} score={score} mask={mask} block={block_size} step={step} layouts={layout}")
    check_attention(
        problem,
        score_mod=maker(score, problem.shape, seed),
        mask_mod=mask.build(problem.shape, seed=seed).fn if mask is not None else None,
        block_size=block_size,
        kernel_options={"step_columns": step},
        seed=seed,
        lse_grad=lse_grad,
        layouts=layout,
    )


@settings(max_examples=examples(150), deadline=None)
@given(
    problem=problems(),
    mod=random_score_mods(),
    mask=st.one_of(st.none(), random_mask_mods(), st.sampled_from(MASK_MODS)),
    block_size=BLOCK_SIZES,
    step=STEP_COLUMNS,
    seed=st.integers(0, 2**16),
    layout=layouts(),
)
def test_random_score_mods(problem, mod, mask, block_size, step, seed, layout):
    note(f"{problem} block={block_size} step={step} layouts={layout}\n{mod}\nmask: {mask}")
    mask_fn = None
    if isinstance(mask, RandomMod):
        mask_fn = mask.build(problem.shape).fn
    elif mask is not None:
        mask_fn = mask.build(problem.shape, seed=seed).fn
    check_attention(
        problem,
        score_mod=lambda dtype: mod.build(problem.shape, dtype),
        mask_mod=mask_fn,
        block_size=block_size,
        kernel_options={"step_columns": step},
        seed=seed,
        layouts=layout,
    )


@settings(max_examples=examples(100), deadline=None)
@given(
    problem=problems(),
    mask=random_mask_mods(),
    block_size=BLOCK_SIZES,
    step=STEP_COLUMNS,
    seed=st.integers(0, 2**16),
)
def test_random_mask_mods(problem, mask, block_size, step, seed):
    note(f"{problem} block={block_size} step={step}\n{mask}")
    check_attention(
        problem,
        mask_mod=mask.build(problem.shape).fn,
        block_size=block_size,
        kernel_options={"step_columns": step},
        seed=seed,
    )
