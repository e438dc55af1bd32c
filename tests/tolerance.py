"""The three-way error rule every backend test uses.

A kernel in a low-precision dtype cannot match a float64 reference exactly; what it must do is be no
worse than plain eager torch in the same dtype. So each comparison involves three results:

- `reference`: flexfa.reference in float64 (the truth),
- `eager`: the same reference computed in the kernel's dtype (what a user would get without flexfa),
- `kernel`: the backend under test,

and passes when  error(kernel) <= factor * error(eager) + atol * scale,  errors being the largest
absolute difference from the reference and `scale` the reference's largest finite magnitude (at
least 1): atol is about one rounding of a value of the result's own size, so a gradient summed over
hundreds of rows (|dV| ~ 30) is not held to the absolute precision of an O(1) output. Matching infinities count as equal (an empty row's LSE is -inf in
all three); a NaN, or an infinity where the reference is finite, is an infinite error. Failure
messages carry all the numbers.

    from tests.tolerance import ThreeWay

    check = ThreeWay(torch.bfloat16)
    check("out", out_kernel, out_eager, out_ref)
    check("dq", dq_kernel, dq_eager, dq_ref)
    check.assert_ok()          # one AssertionError listing every comparison that failed
"""

from __future__ import annotations

import dataclasses
import math

import torch

#: atol per kernel dtype: roughly one rounding of an O(1) value in that dtype (scaled by the
#: reference's magnitude where that is larger, see `magnitude`).
DEFAULT_ATOL: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
}


def default_atol(dtype: torch.dtype) -> float:
    """The atol of the three-way rule for a kernel computing in `dtype`."""
    return DEFAULT_ATOL[dtype]


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |actual - expected| (in float64); equal infinities agree, NaN is an infinite error."""
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.numel() == 0:
        return 0.0
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    diff = torch.where(a == e, 0.0, (a - e).abs())
    diff = torch.where(torch.isnan(a) | torch.isnan(e), math.inf, diff)
    return float(diff.max())


def magnitude(reference: torch.Tensor) -> float:
    """The largest finite |reference|, at least 1 (the scale the atol is multiplied by)."""
    r = reference.detach().to(torch.float64)
    r = r[torch.isfinite(r)]
    return max(1.0, float(r.abs().max())) if r.numel() else 1.0


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One three-way comparison and its numbers."""

    name: str
    kernel_error: float
    eager_error: float
    atol: float
    factor: float

    @property
    def bound(self) -> float:
        return self.factor * self.eager_error + self.atol

    @property
    def ok(self) -> bool:
        return self.kernel_error <= self.bound

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        return (
            f"{self.name}: kernel error {self.kernel_error:.3g} "
            f"{'<=' if self.ok else '>'} bound {self.bound:.3g} "
            f"(= {self.factor:g} x eager error {self.eager_error:.3g} + atol {self.atol:.3g}) "
            f"[{verdict}]"
        )


def compare(
    name: str,
    kernel: torch.Tensor,
    eager: torch.Tensor,
    reference: torch.Tensor,
    *,
    atol: float,
    factor: float = 2.0,
) -> Comparison:
    """The three-way comparison of one tensor (does not raise)."""
    return Comparison(
        name=name,
        kernel_error=max_error(kernel, reference),
        eager_error=max_error(eager, reference),
        atol=atol * magnitude(reference),
        factor=factor,
    )


def assert_three_way(
    name: str,
    kernel: torch.Tensor,
    eager: torch.Tensor,
    reference: torch.Tensor,
    *,
    atol: float,
    factor: float = 2.0,
    context: str = "",
) -> Comparison:
    """Raise AssertionError (with the numbers) unless kernel error <= factor * eager error + atol
    (atol scaled by the reference's magnitude, `magnitude`)."""
    result = compare(name, kernel, eager, reference, atol=atol, factor=factor)
    if not result.ok:
        raise AssertionError(f"{result}{' | ' + context if context else ''}")
    return result


class ThreeWay:
    """Collects comparisons for one case and reports every failure at once.

    Args:
        dtype: the kernel's dtype (selects the default atol).
        atol: overrides the default atol.
        factor: the multiple of the eager error the kernel may reach (2 by default).
        context: text appended to the failure message (shapes, mods, seeds).
    """

    def __init__(
        self,
        dtype: torch.dtype,
        *,
        atol: float | None = None,
        factor: float = 2.0,
        context: str = "",
    ) -> None:
        self.atol = default_atol(dtype) if atol is None else atol
        self.factor = factor
        self.context = context
        self.results: list[Comparison] = []

    def __call__(
        self,
        name: str,
        kernel: torch.Tensor,
        eager: torch.Tensor,
        reference: torch.Tensor,
        *,
        atol: float | None = None,
    ) -> Comparison:
        result = compare(
            name,
            kernel,
            eager,
            reference,
            atol=self.atol if atol is None else atol,
            factor=self.factor,
        )
        self.results.append(result)
        return result

    def assert_ok(self) -> None:
        failed = [r for r in self.results if not r.ok]
        if failed:
            lines = "\n  ".join(str(r) for r in self.results)
            raise AssertionError(
                f"{len(failed)} of {len(self.results)} comparisons failed the three-way rule:\n"
                f"  {lines}" + (f"\n  context: {self.context}" if self.context else "")
            )
