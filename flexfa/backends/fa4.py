"""The "fa4" backend: flexfa's generated mods inside FlashAttention-4's CuTe DSL kernels.

FA4's kernels are templates that take a score_mod, a mask_mod and a score_mod backward as CuTe DSL
functions; flexfa generates them from the IR (flexfa/codegen/cute), proves where the mask is FA4's
native causal or sliding window, and adds gradients of captured tensors, which FA4 alone does not
compute. Needs the optional extra: `pip install "flexfa[fa4]"` (flash-attn-4 and the CuTe DSL).

This module imports neither: `supports` reads package metadata only, and `run` imports them on the
first call. `backend="auto"` does not pick "fa4" yet; ask for it with `backend="fa4"`.

>>> import torch, flexfa
>>> q = k = v = torch.randn(1, 1, 16, 16)
>>> "fa4: no" in flexfa.explain_backend(q, k, v)
True
"""

from __future__ import annotations

import functools
from importlib import metadata

import torch

from flexfa.backends.base import Backend, Support, register
from flexfa.spec import AttentionSpec

# The versions this backend was written and tested against (the extra in pyproject.toml pins them).
TESTED_FA4 = "4.0.0b36"
_DTYPES = (torch.float16, torch.bfloat16)
# dtypes FA4 accepts as aux tensors (bool captures travel as uint8).
_CAPTURE_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


@functools.lru_cache(maxsize=1)
def missing_package() -> str | None:
    """Why FA4 cannot run here, or None (from package metadata: nothing is imported)."""
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl"):
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            return f"{dist} is not installed (pip install 'flexfa[fa4]')"
    return None


def head_dims_supported(head_dim: int, head_dim_v: int, arch_major: int) -> str | None:
    """FA4's head-dim rule for the arch (its `_validate_head_dims`), or None when supported."""
    if head_dim % 8 or head_dim_v % 8:
        return f"FA4 needs head dims divisible by 8, got {head_dim} and {head_dim_v}"
    if arch_major == 9:
        if not (8 <= head_dim <= 256 and 8 <= head_dim_v <= 256):
            return f"FA4 on sm90 takes head dims 8..256, got {head_dim} and {head_dim_v}"
        return None
    standard = head_dim <= 128 and head_dim_v <= 128
    if standard or (head_dim, head_dim_v) in ((192, 128), (256, 256)):
        return None
    return (
        f"FA4 on sm100 takes head dims up to 128, (192, 128) or (256, 256); "
        f"got ({head_dim}, {head_dim_v})"
    )


# Head dims at which flexfa's GPU tests verified FA4's sm90 backward, with and without a
# score_mod (Note [Backward with a score_mod] in flexfa/codegen/cute/backend.py).
SM90_BACKWARD_HEAD_DIMS = (64, 96, 128, 192, 256)


def backward_head_dim(head_dim: int, head_dim_v: int, arch_major: int | None) -> int | None:
    """The head dim FA4's backward runs this call at, zero-padded (Note [Padded backward] in
    flexfa/codegen/cute/backend.py), or None where it runs at the call's own head dims. sm90 only:
    FA4's authors test its Blackwell backward, which no flexfa machine can run.

    >>> backward_head_dim(80, 80, 9), backward_head_dim(128, 64, 9), backward_head_dim(64, 64, 9)
    (96, 128, None)
    """
    if arch_major != 9:
        return None
    if head_dim == head_dim_v and head_dim in SM90_BACKWARD_HEAD_DIMS:
        return None
    return min(d for d in SM90_BACKWARD_HEAD_DIMS if d >= max(head_dim, head_dim_v))


class Fa4Backend(Backend):
    name = "fa4"
    # Not considered by "auto": it is chosen explicitly until measured plans rank it.
    auto_device_types = frozenset()

    def supports(self, spec: AttentionSpec) -> Support:
        if spec.kv_fp8:
            return Support.no(
                f"FA4's kernels read K/V in q's dtype; float8 K/V (k {spec.k_dtype}, v "
                f"{spec.v_dtype}) would need an upcast copy (the triton backend reads them as fp8)"
            )
        missing = missing_package()
        if missing is not None:
            return Support.no(missing)
        if spec.device.type != "cuda":
            return Support.no(f"FA4 runs on CUDA GPUs only, not {spec.device.type}")
        major, minor = torch.cuda.get_device_capability(spec.device)
        if major not in (9, 10, 11):
            return Support.no(
                f"flexfa runs FA4 on sm90 (Hopper) and sm100/sm110 (Blackwell), not sm{major}{minor}"
            )
        if spec.max_scores:
            return Support.no(
                "FA4's kernels return no max_scores (return_aux=AuxRequest(max_scores=True))"
            )
        if spec.kv_broadcast:
            return Support.no("K/V batch broadcast (k and v of batch 1) is not passed to FA4 yet")
        if spec.dtype not in _DTYPES:
            return Support.no(f"FA4 takes float16 or bfloat16 inputs, got {spec.dtype}")
        bad_dims = head_dims_supported(spec.head_dim, spec.head_dim_v, major)
        if bad_dims is not None:
            return Support.no(bad_dims)
        unknown = sorted(set(spec.kernel_options) - {"block_sparse"})
        if unknown:
            return Support.no(
                f"the fa4 backend takes kernel_options 'block_sparse' only, got {unknown}"
            )
        if spec.kernel_options.get("block_sparse"):
            from flexfa.codegen.cute.sparse import why_not_sparse

            not_sparse = why_not_sparse(spec.block_mask, spec.head_dim, spec.head_dim_v, major)
            if not_sparse is not None:
                return Support.no(not_sparse)
        for traced in (spec.score_mod, spec.mask):
            if traced is None:
                continue
            for cap, t in zip(traced.captures, traced.tensors):
                if t.dtype not in _CAPTURE_DTYPES:
                    return Support.no(
                        f"{traced.kind} {traced.name!r} captures {cap.name!r} of dtype {t.dtype}, "
                        "which FA4's aux tensors cannot carry"
                    )
        if spec.deterministic and spec.score_grad_slots:
            return Support.no(
                "deterministic=True is not honoured for gradients of captured tensors on fa4 "
                "(float32 atomic adds in an unfixed order); use the triton backend"
            )
        padded = (
            backward_head_dim(spec.head_dim, spec.head_dim_v, major) if spec.needs_grad else None
        )
        if padded is not None:
            return Support.yes(
                f"the backward runs at head dim {padded} on zero-padded inputs, where FA4's sm90 "
                "backward is verified (Note [Padded backward])"
            )
        return Support.yes()

    def run(self, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        from flexfa.codegen.cute import backend

        return backend.run(spec, q, k, v)


register(Fa4Backend())
