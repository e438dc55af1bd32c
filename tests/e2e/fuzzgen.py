"""Programs for the differential fuzzer: random score_mods and mask_mods over the whole operation
table of docs/semantics.md, with the problem they run on, written as Python source.

This extends the grammar of tests/e2e/randmods.py (whose strategies it draws sub-expressions
from) with what that grammar leaves out:

- captured tensors of every loadable dtype (below), float ones learnable;
- integer index arithmetic with negative operands of `//` and `%` (dividend and divisor, traced
  divisors too), int64 arithmetic (loads, and constants beyond int32 added to `.long()` values:
  eager torch, hence the reference, wraps `int32 + 3000000000` in int32 where flexfa computes in
  int64, docs/semantics.md), bool <-> int conversions; int8, uint8
  and int16 loads are followed by `.int()`, which is what flexfa loads them as (eager torch would
  compute in the narrow type, and index with a uint8 as with a bool mask);
- bool logic through every spelling (`& | ^ ~`, `torch.logical_*`);
- constants and expressions the simplifier folds (`torch.zeros_like(score)`, `x - x`, `x * 0`,
  `torch.where(q_idx != q_idx, ...)`, `(kv_idx == kv_idx) & c`), down to whole mods that fold to a
  constant, and `-inf` scores (rows that a score_mod masks completely).

As in randmods, every score_mod is finite with finite derivatives at every pair, except for `-inf`
chosen by an integer condition, and float values are never compared: a rounding difference
between float32 and float64 moves a result by a rounding error, never by a jump.

Captured tensors (H = query heads), values fixed by the program's seed:

    tab  float32 (H, 5) learnable    temp float32 () learnable    ids  int32 (7,) in [-3, 3]
    keep bool (6,)                   h16  float16 (H,) learnable   bf   bfloat16 (7,) learnable
    w64  float64 (5,) learnable      i8   int8 (5,)                u8   uint8 (5,)
    i16  int16 (2, 3)                i64  int64 (4,), beyond int32 grid bool (3, 4)

A `Program` prints as a Python snippet that rebuilds and checks it, which is how a failure is
reported (tests/e2e/test_fuzz.py, bench/fuzz_gpu.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from hypothesis import strategies as st

from tests.e2e import randmods
from tests.e2e.harness import Problem, check_attention
from tests.mods import BuiltMod


@dataclasses.dataclass(frozen=True)
class CaptureSpec:
    """A captured tensor the grammar may read: `make(generator, heads)` draws its values."""

    name: str
    dtype: torch.dtype
    make: Callable[[torch.Generator, int], torch.Tensor]
    learnable: bool = False
    #: Float captures follow the run's parameter dtype (float32, float64 in the truth).
    follows_param_dtype: bool = False


def _randint(low: int, high: int, *size: int, dtype: torch.dtype):
    return lambda g, heads: torch.randint(low, high, size, generator=g).to(dtype)


CAPTURES = (
    CaptureSpec(
        "tab", torch.float32, lambda g, H: torch.randn(H, 5, generator=g) * 0.5, True, True
    ),
    CaptureSpec("temp", torch.float32, lambda g, H: torch.rand((), generator=g) + 0.5, True, True),
    CaptureSpec("ids", torch.int32, _randint(-3, 4, 7, dtype=torch.int32)),
    CaptureSpec("keep", torch.bool, _randint(0, 2, 6, dtype=torch.bool)),
    CaptureSpec("h16", torch.float16, lambda g, H: torch.randn(H, generator=g), True),
    CaptureSpec("bf", torch.bfloat16, lambda g, H: torch.randn(7, generator=g), True),
    CaptureSpec("w64", torch.float64, lambda g, H: torch.randn(5, generator=g), True),
    CaptureSpec("i8", torch.int8, _randint(-128, 128, 5, dtype=torch.int8)),
    CaptureSpec("u8", torch.uint8, _randint(0, 256, 5, dtype=torch.uint8)),
    CaptureSpec("i16", torch.int16, _randint(-300, 301, 2, 3, dtype=torch.int16)),
    CaptureSpec(
        "i64",
        torch.int64,
        lambda g, H: torch.randint(-(2**40), 2**40, (4,), generator=g, dtype=torch.int64),
    ),
    CaptureSpec("grid", torch.bool, _randint(0, 2, 3, 4, dtype=torch.bool)),
)


# --- integers --------------------------------------------------------------------------------


@st.composite
def int_expr(draw, depth: int = 2) -> str:
    """An integer expression of the pair (int32, int64 where an int64 value takes part)."""
    if depth <= 0:
        return draw(randmods.int_expr(0))
    form = draw(st.integers(0, 14))
    a = draw(int_expr(depth - 1))
    if form <= 2:  # randmods' integer grammar (+ - * // % abs min max clamp where ids[...])
        return draw(randmods.int_expr(depth))
    if form == 3:  # negative dividends and divisors, traced divisors never zero
        b = draw(int_expr(depth - 1))
        op = draw(st.sampled_from(["//", "%"]))
        sign = draw(st.sampled_from(["", "-"]))
        return f"(({a} - {draw(st.integers(0, 20))}) {op} {sign}(torch.abs({b}) + 1))"
    if form == 4:
        name, size = draw(st.sampled_from([("i8", 5), ("u8", 5)]))
        return f"{name}[({a}) % {size}].int()"
    if form == 5:
        return f"i16[({a}) % 2, ({draw(int_expr(depth - 1))}) % 3].int()"
    if form == 6:  # int64: a load, or a constant beyond int32, reduced back to a small range
        big = draw(
            st.sampled_from(
                ["i64[({a}) % 4]", "(({a}).long() + 3000000000)", "(({a}).long() * 5000000000)"]
            )
        )
        return f"({big.format(a=a)} % {draw(st.sampled_from([7, -9, 11]))})"
    if form == 7:  # bool -> int
        conv = draw(st.sampled_from(["({c}).int()", "({c}).long()", "(({c}).int() + ({d}).int())"]))
        return conv.format(c=draw(bool_expr(depth - 1)), d=draw(bool_expr(depth - 1)))
    if form == 8:  # folds to a constant
        k = draw(st.integers(-5, 5))
        return draw(st.sampled_from([f"({a} - {a} + {k})", f"({a} * 0 + {k})"]))
    if form == 9:  # folds to `a`
        return draw(
            st.sampled_from([f"({a} + 0)", f"({a} * 1)", f"torch.where({a} != {a}, 7, {a})"])
        )
    if form == 10:
        return f"({a} ^ {draw(int_expr(depth - 1))})"
    if form == 11:
        return f"torch.div({a}, {draw(st.sampled_from([-3, 2, 4]))}, rounding_mode='floor')"
    if form == 12:
        return f"torch.remainder({a}, {draw(st.sampled_from([-4, 3, 6]))})"
    if form == 13:
        return f"(-{a} // {draw(st.sampled_from([-2, 3]))})"
    return a


# --- bools -----------------------------------------------------------------------------------


@st.composite
def bool_expr(draw, depth: int = 2) -> str:
    """A bool expression of the pair: comparisons of integers, logic in every spelling, captured
    bools and integers, and conditions that fold to True or False."""
    if depth <= 0:
        return draw(randmods.bool_expr(0))
    form = draw(st.integers(0, 12))
    if form <= 2:
        return draw(randmods.bool_expr(depth))
    a = draw(bool_expr(depth - 1))
    if form == 3:
        return f"grid[({draw(int_expr(depth - 1))}) % 3, ({draw(int_expr(depth - 1))}) % 4]"
    if form == 4:
        op = draw(st.sampled_from(["^", "&", "|"]))
        return f"({a} {op} {draw(bool_expr(depth - 1))})"
    if form == 5:
        fn = draw(st.sampled_from(["logical_and", "logical_or", "logical_xor"]))
        return f"torch.{fn}({a}, {draw(bool_expr(depth - 1))})"
    if form == 6:
        return f"torch.logical_not({a})"
    if form == 7:
        i = draw(int_expr(depth - 1))
        return draw(
            st.sampled_from(
                [f"(u8[({i}) % 5].int() > 100)", f"(i64[({i}) % 4] > 0)", f"i8[({i}) % 5].bool()"]
            )
        )
    if form == 8:  # folds to True / False
        i = draw(int_expr(depth - 1))
        return draw(
            st.sampled_from(
                [f"({i} == {i})", f"({i} != {i})", f"(({i} == {i}) & {a})", f"(({i} != {i}) | {a})"]
            )
        )
    if form == 9:
        return f"({draw(int_expr(depth - 1))} >= {draw(int_expr(depth - 1))})"
    if form == 10:
        return f"(({draw(int_expr(depth - 1))}) % {draw(st.sampled_from([-3, 2]))} == 0)"
    if form == 11:
        return f"({a}).bool()"
    return a


# --- floats ----------------------------------------------------------------------------------


@st.composite
def float_leaf(draw) -> str:
    form = draw(st.integers(0, 9))
    if form <= 3:
        return draw(randmods.float_leaf())
    i = draw(int_expr(1))
    if form == 4:
        return "h16[h]"
    if form == 5:
        return f"bf[({i}) % 7]"
    if form == 6:
        return f"w64[({i}) % 5]"
    if form == 7:
        return f"(i8[({i}) % 5].int() * 0.01)"
    if form == 8:
        return draw(float_const())
    return f"torch.tanh(({i}).float() * 0.3)"


@st.composite
def float_const(draw) -> str:
    """A float constant, written as torch does and as the simplifier folds."""
    c = draw(st.sampled_from([0.0, 0.5, 2.0, -1.5]))
    return draw(
        st.sampled_from(
            [
                f"torch.full_like(score, {c})",
                "torch.zeros_like(score)",
                f"(torch.ones_like(score) * {c})",
                f"score.new_full((), {c})",
                f"torch.sigmoid(torch.full_like(score, {c}))",
                "(score * 0.0)",
                f"torch.tanh(torch.zeros_like(score) + {c})",
                f"torch.exp(score.new_zeros(()) * {c})",
            ]
        )
    )


@st.composite
def float_expr(draw, depth: int = 3) -> str:
    """A float expression, finite and continuous in its float inputs (as randmods.float_expr)."""
    if depth <= 0 or draw(st.integers(0, 4)) == 0:
        return draw(float_leaf())
    form = draw(st.integers(0, 5))
    a = draw(float_expr(depth - 1))
    if form == 0:
        c = draw(st.sampled_from([0.5, 1.5, 2.0, -1.5]))
        return draw(st.sampled_from(randmods._UNARY)).format(a=a, c=c)
    if form == 1:
        return draw(st.sampled_from(randmods._BINARY)).format(a=a, b=draw(float_expr(depth - 1)))
    if form == 2:
        return f"torch.where({draw(bool_expr(1))}, {a}, {draw(float_expr(depth - 1))})"
    if form == 3:  # folds: to a, to 0, or a constant branch
        return draw(
            st.sampled_from(
                [
                    f"({a} * 1.0 + 0.0)",
                    f"({a} * 0.0)",
                    f"torch.where({draw(bool_expr(1))}, {a}, 0.25)",
                    f"torch.minimum({a}, torch.full_like(score, 1.0))",
                    f"torch.clamp({a}, min=-1.0)",
                ]
            )
        )
    if form == 4:  # captured floats of other dtypes and integer data
        return f"({a} * {draw(float_leaf())})"
    return draw(randmods.float_expr(depth - 1))


@st.composite
def score_mod_sources(draw) -> str:
    """The source of `def score_mod(score, b, h, q_idx, kv_idx)`."""
    form = draw(st.integers(0, 9))
    if form <= 4:
        body = draw(float_expr())
    elif form <= 6:
        body = f"score + {draw(float_expr())}"
    elif form == 7:  # a constant score_mod, spelled as torch allows
        body = draw(float_const())
    elif form == 8:  # -inf where an integer condition says so (rows may end up fully masked)
        body = f'torch.where({draw(bool_expr())}, {draw(float_expr(2))}, float("-inf"))'
    else:  # only the indices
        body = f"({draw(int_expr())}).float() * {draw(st.sampled_from([0.1, -0.25]))}"
    return f"def score_mod(score, b, h, q_idx, kv_idx):\n    return {body}\n"


@st.composite
def mask_mod_sources(draw) -> str:
    """The source of `def mask_mod(b, h, q_idx, kv_idx)`."""
    return f"def mask_mod(b, h, q_idx, kv_idx):\n    return {draw(bool_expr(3))}\n"


# --- programs --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Program:
    """One fuzz case: a problem, an optional score_mod and mask_mod (sources), capture seed, scale
    and (for explicit BlockMasks) a tile size."""

    problem: Problem
    score_mod: str | None = None
    mask_mod: str | None = None
    seed: int = 0
    scale: float | None = None
    block_size: int | tuple[int, int] | None = None

    def _namespace(
        self, param_dtype: torch.dtype | None, device: torch.device | str = "cpu"
    ) -> tuple[dict, tuple[torch.Tensor, ...]]:
        """The captured tensors (float ones in float64 for the truth, `param_dtype=None`), and the
        learnable ones that the score_mod reads, in CAPTURES order."""
        g = torch.Generator().manual_seed(self.seed)
        names: dict[str, object] = {"torch": torch}
        params = []
        for spec in CAPTURES:
            t = spec.make(g, self.problem.heads_q).to(spec.dtype)
            if param_dtype is None and t.is_floating_point():
                t = t.to(torch.float64)
            elif spec.follows_param_dtype:
                t = t.to(param_dtype)
            t = t.to(device)
            if spec.learnable and self.score_mod and _reads(self.score_mod, spec.name):
                t.requires_grad_(True)
                params.append(t)
            names[spec.name] = t
        return names, tuple(params)

    def _compile(self, source: str, namespace: dict, name: str):
        exec(compile(source, f"<fuzz {name}>", "exec"), namespace)
        return namespace[name]

    def build_score_mod(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> BuiltMod:
        """The score_mod with fresh captures: float ones in `dtype` (float64: the truth's)."""
        assert self.score_mod is not None
        names, params = self._namespace(None if dtype == torch.float64 else dtype, device)
        return BuiltMod(self._compile(self.score_mod, names, "score_mod"), params)

    def build_mask_mod(self, device: torch.device | str = "cpu"):
        if self.mask_mod is None:
            return None
        names, _ = self._namespace(torch.float32, device)
        return self._compile(self.mask_mod, names, "mask_mod")

    def check(
        self,
        backend: str = "tiled",
        kernel_options: dict | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """Output, LSE and every gradient against the float64 reference (tests/tolerance.py)."""

        def score_mod(dtype: torch.dtype) -> BuiltMod:
            return self.build_score_mod(dtype, device)

        check_attention(
            self.problem,
            score_mod=score_mod if self.score_mod is not None else None,
            mask_mod=self.build_mask_mod(device),
            block_size=self.block_size,
            kernel_options=kernel_options,
            backend=backend,
            scale=self.scale,
            seed=self.seed,
            context=f"fuzz program on {backend}",
            device=device,
        )

    def source(
        self,
        backend: str = "tiled",
        kernel_options: dict | None = None,
        device: str = "cpu",
    ) -> str:
        """A Python snippet that rebuilds this program and runs the failing check."""
        p = self.problem
        problem = ", ".join(
            f"{f.name}={getattr(p, f.name)!r}" for f in dataclasses.fields(p) if f.name != "dtype"
        )

        def block(text: str | None) -> str:
            return "None" if text is None else '"""\n' + text + '"""'

        return (
            "import torch\n"
            "from tests.e2e.fuzzgen import Program\n"
            "from tests.e2e.harness import Problem\n\n"
            "program = Program(\n"
            f"    problem=Problem({problem}, dtype={p.dtype}),\n"
            f"    score_mod={block(self.score_mod)},\n"
            f"    mask_mod={block(self.mask_mod)},\n"
            f"    seed={self.seed},\n"
            f"    scale={self.scale!r},\n"
            f"    block_size={self.block_size!r},\n"
            ")\n"
            f"program.check({backend!r}, kernel_options={kernel_options!r}, device={device!r})\n"
        )

    def __str__(self) -> str:
        return self.source()

    def to_json(self) -> dict:
        """A JSON-ready dict (`Program.from_json` reads it back)."""
        out = dataclasses.asdict(self)
        out["problem"]["dtype"] = str(self.problem.dtype).removeprefix("torch.")
        return out

    @staticmethod
    def from_json(data: dict) -> Program:
        problem = dict(data["problem"], dtype=getattr(torch, data["problem"]["dtype"]))
        block = data["block_size"]
        return Program(
            **dict(
                data,
                problem=Problem(**problem),
                block_size=tuple(block) if isinstance(block, list) else block,
            )
        )


def _reads(source: str, name: str) -> bool:
    return f"{name}[" in source or (name == "temp" and "temp" in source)


@st.composite
def programs(
    draw,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16),
    max_len: int = 40,
    head_dims: tuple[int, ...] = (8, 16),
    head_dims_v: tuple[int, ...] = (8, 12, 16),
    block_sizes=None,
) -> Program:
    """A random program: odd and length-1 sequences, Lq != Lkv, GQA groups of 1 to 3, E != Ev."""
    heads_kv = draw(st.integers(1, 2))
    problem = Problem(
        batch=draw(st.integers(1, 2)),
        heads_q=heads_kv * draw(st.sampled_from([1, 2, 3])),
        heads_kv=heads_kv,
        len_q=draw(st.integers(1, max_len)),
        len_kv=draw(st.integers(1, max_len)),
        head_dim=draw(st.sampled_from(head_dims)),
        head_dim_v=draw(st.sampled_from(head_dims_v)),
        dtype=draw(st.sampled_from(dtypes)),
    )
    if block_sizes is None:
        block_sizes = st.sampled_from([None, 4, (8, 4), (16, 16)])
    kind = draw(st.sampled_from(["score", "mask", "both", "both"]))
    score = draw(score_mod_sources()) if kind != "mask" else None
    mask = draw(mask_mod_sources()) if kind != "score" else None
    scale = draw(st.sampled_from([None, None, 0.3, 1.0 / math.sqrt(3.0)]))
    return Program(
        problem=problem,
        score_mod=score,
        mask_mod=mask,
        seed=draw(st.integers(0, 2**16)),
        scale=scale,
        block_size=draw(block_sizes),
    )


def draw_programs(n: int, seed: int, strategy=None) -> list[Program]:
    """`n` programs drawn by hypothesis from `strategy` (default `programs()`), the same for the
    same seed, duplicates dropped: for drivers that run programs outside a hypothesis test."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seed_

    drawn: dict[str, Program] = {}

    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @seed_(seed)
    @given(strategy if strategy is not None else programs())
    def collect(program: Program) -> None:
        drawn.setdefault(program.source(), program)

    collect()
    return list(drawn.values())


def interpreter_programs():
    """Programs small enough for Triton's interpreter (no bfloat16 there, BlockMask tiles that
    16-wide Triton tiles divide)."""
    return programs(
        dtypes=(torch.float32, torch.float16),
        max_len=20,
        head_dims=(16,),
        head_dims_v=(16, 24),
        block_sizes=st.sampled_from([None, 16, (16, 32)]),
    )


def gpu_programs():
    """Programs at GPU sizes: lengths up to 300 (several tiles, ragged), head dims up to 80."""
    return programs(
        max_len=300,
        head_dims=(16, 64),
        head_dims_v=(16, 64, 80),
        block_sizes=st.sampled_from([None, 128, (128, 64)]),
    )


def fa4_programs():
    """Programs for the "fa4" backend (FA4's kernels): float16/bfloat16, head dims 64, 80 and
    128, equal or not (the last two run the padded backward, Note [Padded backward]), lengths up
    to 300, BlockMasks at FA4's tile size and others (the backend passes those as a mask_mod
    alone)."""
    return programs(
        dtypes=(torch.float16, torch.bfloat16),
        max_len=300,
        head_dims=(64, 80, 128),
        head_dims_v=(64, 80, 128),
        block_sizes=st.sampled_from([None, 128, (128, 128), (128, 64)]),
    )
