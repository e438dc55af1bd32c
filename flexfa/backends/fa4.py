"""The "fa4" backend: flexfa's generated mods inside FlashAttention-4's CuTe DSL kernels.

FA4's kernels are templates that take a score_mod, a mask_mod and a score_mod backward as CuTe DSL
functions; flexfa generates them from the IR (flexfa/codegen/cute), proves where the mask is FA4's
native causal or sliding window, and adds gradients of captured tensors, which FA4 alone does not
compute. Needs the optional extra: `pip install "flexfa[fa4]"` (flash-attn-4 and the CuTe DSL).

This module imports neither: `supports` reads package metadata only, and `run` imports them on the
first call. `backend="auto"` picks "fa4" where it measured faster than flexfa's Triton kernels
(Note [Which backend auto picks]); `backend="fa4"` asks for it anywhere it runs.

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
from flexfa.codegen.cute.plan import backward_head_dim
from flexfa.spec import AttentionSpec

# The versions this backend was written and tested against (the extra in pyproject.toml pins them).
TESTED_FA4 = "4.0.0b36"
_DTYPES = (torch.float16, torch.bfloat16)
# dtypes the generated hooks read captured tensors in (bool captures travel as uint8, int8, uint8
# and int16 ones as int32: Note [Captured tensors by address] in flexfa/codegen/cute/emit.py).
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


# Note [Which backend auto picks]
# On the H200 (docs/performance.md, B=2, H=16, N=8192, D=128), FA4's kernels with generated mods
# ran at 0.98-1.52x the best peer forward and 1.00-1.29x forward+backward, where flexfa's Triton
# kernels ran at 0.64-0.98x forward; the Triton decode kernels (split KV, GQA packed in the tile's
# rows) beat everything FA4 has on sm90 for short queries. So `auto` tries fa4 first, but only for
# calls like those measured, and otherwise moves on to triton without a warning:
#   - sm90: FA4's sm100 kernels are compiled here, never run (docs/cute.md);
#   - at least 128 queries (one FA4 tile of rows): shorter ones are the decode kernels' ground;
#   - no `kernel_options` (those are the Triton kernels' knobs), not deterministic (not measured);
#   - a backward, if any, at head dims FA4's backward is verified at (no padding: not measured);
#   - no float16/bfloat16 gradients of captured tensors: FA4 writes no float32 output, so its
#     delta = rowsum(dO * O) comes from the rounded output, and a gradient that sums many ds
#     (a learnable shift, a per-head bias) carries the rounding of every row's delta (the fuzzer
#     found such a gradient 2.7x over the three-way bound in float16). The Triton kernels keep a
#     float32 output for such calls (Note [Unrounded output for delta] in
#     flexfa/codegen/triton/backend.py);
#   - a packed call that runs on FA4's varlen kernels (Note [Packed calls on FA4's varlen path]
#     in flexfa/codegen/cute/backend.py: its inner mask is native in every sequence);
#   - a mask FA4 runs natively (causal, windows: Note [Native masks from the IR]), or one whose
#     BlockMask has few partial tiles and reaches FA4 as block-sparse lists: at most
#     `_AUTO_MAX_PARTIAL` of its non-empty tiles partial. `bench/auto_choice.py` (B*N = 16384,
#     H=16, D=128, bf16): prefix-LM 2048 (2% partial at N=8192) ran 1.36x / 1.45x faster on fa4
#     than on triton forward / forward+backward; document-causal masks (39-46% partial) gave
#     0.64-0.91x / 0.95-1.05x in one run and 0.39-1.16x / 1.03-1.27x in another (FA4's sm90
#     forward evaluates the mask_mod one element at a time on partial tiles), so calls with a
#     backward and such masks stay on triton. Calls without a backward take fa4 up to
#     `_AUTO_MAX_PARTIAL_FORWARD`: with FA4's forward launched directly (Note [Direct FA4
#     launches]) the same script gave document-causal forwards 1.17-1.21x triton's in two runs
#     (N = 2048 and 8192; forward+backward 0.81-1.02x);
#   - and whatever `supports` requires.
# `explain_backend` says for each backend whether it can run a call; `backend="fa4"` runs it
# wherever `supports` allows.
_AUTO_MIN_LEN_Q = 128
_AUTO_MAX_PARTIAL = 0.25
_AUTO_MAX_PARTIAL_FORWARD = 0.5


class Fa4Backend(Backend):
    name = "fa4"
    auto_device_types = frozenset({"cuda"})

    def auto_prefers(self, spec: AttentionSpec) -> bool:
        """Note [Which backend auto picks]."""
        if spec.device.type != "cuda" or spec.len_q < _AUTO_MIN_LEN_Q:
            return False
        if spec.kernel_options or spec.deterministic or spec.paged is not None:
            return False
        if torch.cuda.get_device_capability(spec.device)[0] != 9:
            return False
        answer = self._supports(spec)
        if not answer or answer.reason:  # notes: a padded backward, 16-bit captured gradients
            return False
        if spec.mask.is_trivially_true:
            return True
        from flexfa.codegen.cute import backend

        packed = backend.packed_lowering(spec)
        if packed is not None and packed.native:
            return True
        most = _AUTO_MAX_PARTIAL if spec.needs_grad else _AUTO_MAX_PARTIAL_FORWARD
        if spec.block_mask.partial_fraction <= most and backend.uses_block_sparse(spec):
            return True
        return backend.mask_lowering(spec.mask, spec.len_q, spec.len_kv).native

    def reads_packed_mods(self, spec: AttentionSpec) -> bool:
        """Not on FA4's varlen kernels, which take the offsets and the user's own mods (Note
        [Packed calls on FA4's varlen path])."""
        from flexfa.codegen.cute import backend

        lowering = backend.packed_lowering(spec)
        return not (lowering is not None and lowering.native)

    def supports(self, spec: AttentionSpec) -> Support:
        """Whether fa4 runs `spec`, with notes on how; for a packed call, which of the two paths
        it takes (Note [Packed calls on FA4's varlen path])."""
        answer = self._supports(spec)
        if not answer:
            return answer
        from flexfa.codegen.cute import backend

        if spec.packed is not None:
            path = backend.describe_packed(spec)
        else:  # Note [Document masks on FA4's varlen kernels] in flexfa/codegen/cute/plan.py
            documents = backend.document_lowering(spec)
            if documents is not None:
                path = documents[0].reason
            else:  # Note [Prefix masks as two native calls] in flexfa/codegen/cute/plan.py
                path = backend.describe_split(spec)
                if path is None:
                    return answer
        return Support.yes("; ".join(n for n in (path, answer.reason) if n))

    def _supports(self, spec: AttentionSpec) -> Support:
        """`supports` without the packed call's path; a note here says the call runs less well
        than usual (Note [Which backend auto picks])."""
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
        unlowered = _unlowered_op(spec)
        if unlowered is not None:
            return Support.no(unlowered)
        for traced in (spec.score_mod, spec.mask):
            if traced is None:
                continue
            for cap, t in zip(traced.captures, traced.tensors):
                if t.dtype not in _CAPTURE_DTYPES:
                    return Support.no(
                        f"{traced.kind} {traced.name!r} captures {cap.name!r} of dtype {t.dtype}, "
                        "which the generated FA4 hooks cannot read"
                    )
        if spec.deterministic and spec.score_grad_slots:
            return Support.no(
                "deterministic=True is not honoured for gradients of captured tensors on fa4 "
                "(float32 atomic adds in an unfixed order); use the triton backend"
            )
        notes = []
        padded = (
            backward_head_dim(spec.head_dim, spec.head_dim_v, major) if spec.needs_grad else None
        )
        if padded is not None:
            notes.append(
                f"the backward runs at head dim {padded} on zero-padded inputs, where FA4's sm90 "
                "backward is verified (Note [Padded backward])"
            )
        if spec.needs_grad and spec.score_grad_slots:
            notes.append(
                "captured-tensor gradients take the backward's delta from the rounded "
                f"{str(spec.dtype).removeprefix('torch.')} output (FA4 writes no float32 one): "
                "sums of many ds, like a learnable shift's, are less exact than on triton (Note "
                "[Which backend auto picks])"
            )
        return Support.yes("; ".join(notes))

    def run(self, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        from flexfa.codegen.cute import backend

        return backend.run(spec, q, k, v)

    def forward(self, spec, q, k, v):
        from flexfa.codegen.cute import backend

        # The torch.library ops pass the spec's own score_mod tensors and slots: no varlen path.
        call = backend.make_call(spec, varlen=False)
        out, lse = backend.forward(call, q, k, v, _score_tensors(spec))
        return out, lse, out, None  # the backward reads the output itself

    def backward(self, spec, q, k, v, saved, lse, dout, dlse, grad_slots):
        from flexfa.codegen.cute import backend

        call = backend.make_call(spec, varlen=False)
        dq, dk, dv, captured = backend.backward(
            call, q, k, v, saved, lse, dout, dlse, _score_tensors(spec)
        )
        return dq, dk, dv, {s: g for s, g in captured.items() if s in grad_slots}


def _unlowered_op(spec: AttentionSpec) -> str | None:
    """Why the generated hooks cannot be written for `spec`'s mods (an IR op without a CuTe DSL
    lowering: Note [Every op has a CuTe lowering] in flexfa/codegen/cute/emit.py), or None."""
    mods = [spec.score_mod, spec.mask]
    if spec.packed is not None:
        mods += [spec.packed.score_mod, spec.packed.mask]
    for traced in mods:
        if traced is None:
            continue
        backward = traced.kind == "score_mod" and spec.needs_grad
        ops = _unlowered_ops(traced, spec.score_grad_slots if backward else None)
        if ops:
            names = ", ".join(op.name for op in ops)
            return (
                f"{traced.kind} {traced.name!r} uses {names}, which the generated FA4 hooks "
                "cannot compute (no CuTe DSL lowering)"
            )
    return None


@functools.lru_cache(maxsize=256)
def _unlowered_ops_of(output, grad_slots: frozenset[int] | None) -> tuple:
    from flexfa.codegen.cute.emit import unlowered_ops

    roots = [output]
    if grad_slots is not None:
        from flexfa.ir.autodiff import score_mod_gradient

        roots += score_mod_gradient(output, grad_slots=grad_slots).roots()
    return tuple(unlowered_ops(roots))


def _unlowered_ops(traced, grad_slots: frozenset[int] | None) -> tuple:
    """The ops of `traced` (and of its backward, with `grad_slots`) that the CuTe emitter cannot
    lower, once per IR (IR nodes are interned: the output node is the IR's identity)."""
    return _unlowered_ops_of(traced.output, grad_slots)


def _score_tensors(spec: AttentionSpec) -> tuple[torch.Tensor, ...]:
    return spec.score_mod.tensors if spec.score_mod is not None else ()


register(Fa4Backend())
