"""The front door: validate -> trace -> block mask -> pick backend -> run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from flexfa import backends, torch_options
from flexfa.blockmask.bind import resolve_block_mask
from flexfa.blockmask.block_mask import BlockMask
from flexfa.compiled import compiled_attention
from flexfa.frontend.bound import trace_call_score_mod as _trace_score_mod
from flexfa.frontend.trace import TracedMod, trace_mask_mod
from flexfa.paged import ensure_checked, validate_paged
from flexfa.spec import AttentionSpec, resolve_scale, spec_from_shape, validate_qkv
from flexfa.varlen import PackedSequences, deferred_block_mask, packed_mods, packing

try:  # torch's own types where the installed torch has them, so results compare equal
    from torch.nn.attention.flex_attention import AuxOutput, AuxRequest
except ImportError:  # pragma: no cover - older torch

    class AuxRequest(NamedTuple):  # type: ignore[no-redef]
        """Which auxiliary outputs `flexfa.attention(..., return_aux=...)` returns."""

        lse: bool = False
        max_scores: bool = False

    class AuxOutput(NamedTuple):  # type: ignore[no-redef]
        """Auxiliary outputs of `flexfa.attention`; None where not requested."""

        lse: torch.Tensor | None = None
        max_scores: torch.Tensor | None = None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Callable[..., Any] | None = None,
    block_mask: BlockMask | Callable[..., Any] | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: Mapping[str, Any] | None = None,
    *,
    return_aux: Any = None,
    backend: str = "auto",
    deterministic: bool = False,
    page_table: torch.Tensor | None = None,
    kv_lens: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, Any]:
    """Attention with a programmable score and mask, differentiable, on CPU or GPU.

    The positional arguments and keywords up to `return_aux` are torch FlexAttention's
    (`torch.nn.attention.flex_attention.flex_attention`), in its order.

    Args:
        q: (B, Hq, Lq, E) queries; k: (B, Hkv, Lkv, E) keys; v: (B, Hkv, Lkv, Ev) values; one
            dtype among float16, bfloat16, float32 (and float64 on the tiled backend); k and v
            may instead be float8_e4m3fn or float8_e5m2 (an fp8 KV cache, read as fp8 and
            upcast in the kernel; no backward, as in torch: Note [fp8 K/V] in flexfa/spec.py).
            k and v may have batch size 1, shared by every query batch element (never expanded).
        score_mod: `score_mod(score, b, h, q_idx, kv_idx) -> score`, applied to the scaled score
            (e.g. `flexfa.mods.alibi`). It may read captured tensors; those that require grad get
            gradients.
        block_mask: a `flexfa.BlockMask`, a torch FlexAttention `BlockMask` (converted once and
            cached), or a `mask_mod(b, h, q_idx, kv_idx) -> bool` (e.g. `flexfa.masks.causal`),
            whose BlockMask is built for these shapes and cached.
        scale: multiplies q @ k^T before score_mod; default 1/sqrt(E).
        enable_gqa: allow Hq to be a multiple of Hkv (query head h reads KV head h // (Hq // Hkv)).
        return_lse: also return the log-sum-exp (natural log, float32, (B, Hq, Lq)).
        return_aux: as in torch's flex_attention, an `AuxRequest(lse=..., max_scores=...)`: return
            `(out, AuxOutput(lse, max_scores))`, where max_scores is the row maximum of the
            modified scores (natural log scale, float32, (B, Hq, Lq), -inf for empty rows, not
            differentiable) and a field not asked for is None. Not together with return_lse.
        backend: "auto", "triton" or "tiled". "auto" picks the fastest that supports the call and
            warns once when it has to fall back on a GPU.
        kernel_options: backend options, e.g. {"block_m": 64} for triton; torch FlexAttention's
            keys are read too (flexfa/torch_options.py).
        deterministic: bitwise-repeatable gradients for captured tensors (slower on GPU).
        page_table, kv_lens: read K and V from a paged cache: `k`, `v` are then page pools
            (num_pages, Hkv, page_size, E|Ev), `page_table` (B, max_pages) int32 maps logical page
            j of sequence b to a pool page and `kv_lens` (B,) int32 gives each sequence's length.
            Mods see logical positions; inference only (see flexfa/paged.py, `PagedKVCache`).
        cu_seqlens_q, cu_seqlens_kv: a packed batch: q (1, Hq, total_q, E), k/v (1, Hkv, total_kv,
            E|Ev) hold B sequences at these (B + 1,) int32 offsets; mods see `b` = sequence index
            and positions within each sequence; `block_mask` must then be a mask_mod or None
            (flexfa/varlen.py). On q's device, or on the CPU: offsets on the CPU spare a call on
            a GPU its one synchronization (their copy to the host for validation).

    A query row with no allowed key gets output 0, LSE -inf and zero gradients.

    >>> import torch, flexfa
    >>> from flexfa.mods import alibi
    >>> from flexfa.masks import sliding_window
    >>> q, k, v = (torch.randn(1, 4, 300, 64) for _ in range(3))
    >>> out = flexfa.attention(q, k, v, score_mod=alibi, block_mask=sliding_window(128))
    >>> out.shape
    torch.Size([1, 4, 300, 64])
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    # Note [Triton's start-up]; not while torch.compile traces the call: Dynamo would have to trace
    # the compile pool (a graph break, an error under fullgraph=True). `is_compiling()` comes first
    # so that Dynamo never reads `_triton_level`: a guard on it would recompile the graph once an
    # eager call outside it raised the level. Only calls that will run Triton's kernels start it:
    # here those that ask for them, below those that `auto` sends there.
    if (
        not torch.compiler.is_compiling()
        and _triton_level < 2
        and backend == "triton"
        and _on_cuda(q)
    ):
        _start_triton(q, k, v)
    packed = None
    if cu_seqlens_q is not None or cu_seqlens_kv is not None:
        score_mod, block_mask, packed = _packed(
            q, k, score_mod, block_mask, cu_seqlens_q, cu_seqlens_kv
        )
    kernel_options = torch_options.translate(kernel_options)
    want_max = False
    if return_aux is not None:
        want_max = _check_aux(return_aux, return_lse)
    if torch.compiler.is_compiling():  # Note [flexfa under torch.compile]
        if page_table is not None or kv_lens is not None:
            raise ValueError(
                "paged KV caches (page_table, kv_lens) are not supported inside torch.compile yet: "
                "call flexfa.attention for decoding outside the compiled region"
            )
        out, lse, max_scores = compiled_attention(
            q,
            k,
            v,
            score_mod,
            block_mask,
            scale=scale,
            enable_gqa=enable_gqa,
            backend=backend,
            kernel_options=kernel_options,
            deterministic=deterministic,
            max_scores=want_max,
        )
        if return_aux is not None:
            return out, _aux_output(return_aux, lse, max_scores)
        return (out, lse) if return_lse else out
    key = None
    if packed is None and _memo_eligible(q, k, v, block_mask, page_table, kv_lens):
        traced = _trace_score_mod(score_mod, q.shape[1], q.device)
        key = _memo_key(q, k, v, traced, block_mask, scale, enable_gqa, kernel_options,
                        deterministic, backend, want_max, page_table, kv_lens)  # fmt: skip
    found = _memo.get(key) if key is not None else None
    if found is not None:
        spec, impl = found[0], found[1]
        if spec.paged is not None:  # the same tables, whose values may have changed in place
            ensure_checked(spec.paged)
    else:
        spec = build_spec(
            q,
            k,
            v,
            score_mod,
            block_mask,
            scale=scale,
            enable_gqa=enable_gqa,
            kernel_options=kernel_options,
            deterministic=deterministic,
            page_table=page_table,
            kv_lens=kv_lens,
            packed=packed,
            traced_score_mod=traced if key is not None else _UNTRACED,
        )
        if want_max:
            spec = dataclasses.replace(spec, max_scores=True)
        impl = backends.select(backend, spec)
        if key is not None:
            if len(_memo) >= _MEMO_SIZE:
                _memo.pop(next(iter(_memo)))
            _memo[key] = (spec, impl, traced, block_mask)  # the objects whose ids are in the key
    if packed is not None and impl.reads_packed_mods(spec):
        spec.block_mask.materialize()  # Note [Block masks built on first read]
    if _triton_level < 2 and impl.name == "triton" and _on_cuda(q):
        _start_triton(q, k, v)  # Note [Triton's start-up]: not for fa4's calls
    out, lse, *rest = impl.run(spec, q, k, v)
    if spec.kv_fp8:
        out, lse = _refuse_backward(spec, q, k, v, out, lse)
    if return_aux is not None:
        return out, _aux_output(return_aux, lse, rest[0] if rest else None)
    return (out, lse) if return_lse else out


# Note [Repeated inference calls]
# A decode loop calls `flexfa.attention` with the same kinds of tensors, mods and options at every
# step, and at 4k keys the host time of a call decides the step (docs/performance.md). With
# gradients disabled, a call's AttentionSpec and backend depend only on the shapes, strides, dtypes
# and devices of q, k and v; the traced score_mod (the trace cache's answer, which notices a
# replaced capture or a changed float); the BlockMask object, or None; and scale, enable_gqa,
# kernel_options, deterministic, backend and max_scores. `_memo` keeps the (spec, backend) of such
# calls under those values, with the traced mod and the BlockMask themselves (so that their ids in
# the key stay theirs), and a repeated call skips the argument checks, the block-mask binding and
# the backend choice, which would give the same answers: the checks depend on nothing else. Calls
# with gradients enabled (their spec follows requires_grad flags that may change between calls),
# packed calls (their spec follows the values of the offsets, which may change in place: Note
# [Packed calls on FA4's varlen path] in flexfa/codegen/cute/backend.py) and block masks given as
# mask_mods or torch BlockMasks take the full path. A paged call's key holds its page table and
# lengths by identity (with their shapes, strides, dtypes and devices): a serving loop passes the
# same two tensors at every step, updated in place, and the spec holds them, so a repeated call
# finds them there; their values are checked again whenever they changed (`ensure_checked`, Note
# [Checking page tables] in flexfa/paged.py), since the spec and the kernels read nothing else of
# them on the host. On the 2-core CPU a paged decode step's host work went from 48.6-49.5 to
# 20.5-21.0 us (`python bench/host_overhead.py`; a step from contiguous K/V: 17.4-18.7). A
# BlockMask changed in place is as visible as it is to the caches keyed by it already (Note
# [Decode host time]). The memo keeps the last _MEMO_SIZE calls (a model's decode step has a
# handful of distinct calls), so it holds at most that many BlockMasks, page tables and lengths
# alive beyond their callers' use, e.g. the per-step slices of a decoding loop.
_memo: dict[tuple, tuple] = {}
_MEMO_SIZE = 16
_UNTRACED = object()  # build_spec traces the score_mod itself


def _on_cuda(q) -> bool:
    return isinstance(q, torch.Tensor) and q.is_cuda


# What this process has asked of Triton's start-up (Note [Triton's start-up]): 0 nothing, 1 the
# start-up, 2 the start-up and the compile workers; calls check it first and skip the rest.
_triton_level = 0


def _start_triton(q, k, v) -> None:
    global _triton_level
    level = 2 if _needs_grad(q, k, v) else 1
    if level <= _triton_level:
        return
    from flexfa.runtime.launch import start_runtime

    start_runtime(with_workers=level == 2)
    _triton_level = level


def _needs_grad(q, k, v) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)
    )


def _memo_eligible(q, k, v, block_mask, page_table, kv_lens) -> bool:
    return (
        not torch.is_grad_enabled()
        and (page_table is None) == (kv_lens is None)
        and (page_table is None or isinstance(page_table, torch.Tensor))
        and (kv_lens is None or isinstance(kv_lens, torch.Tensor))
        and (block_mask is None or type(block_mask) is BlockMask)
        and isinstance(q, torch.Tensor)
        and isinstance(k, torch.Tensor)
        and isinstance(v, torch.Tensor)
        and q.ndim == k.ndim == v.ndim == 4
    )


def _memo_key(
    q,
    k,
    v,
    traced,
    block_mask,
    scale,
    enable_gqa,
    kernel_options,
    deterministic,
    backend,
    want_max,
    page_table=None,
    kv_lens=None,
) -> tuple | None:
    """The key of a repeated inference call (Note [Repeated inference calls]); None when an
    argument cannot be part of one."""
    paged = None
    if page_table is not None:
        paged = (
            id(page_table), page_table.shape, page_table.stride(), page_table.dtype,
            page_table.device, id(kv_lens), kv_lens.shape, kv_lens.stride(), kv_lens.dtype,
            kv_lens.device,
        )  # fmt: skip
    key = (
        q.shape, q.stride(), q.dtype, q.device,
        k.shape, k.stride(), k.dtype, k.device,
        v.shape, v.stride(), v.dtype, v.device,
        id(traced), id(block_mask), scale, enable_gqa, deterministic, backend, want_max,
        tuple(sorted(kernel_options.items())) if kernel_options else None, paged,
    )  # fmt: skip
    try:
        hash(key)
    except TypeError:  # e.g. a list among kernel_options' values
        return None
    return key


def _check_aux(request: Any, return_lse: bool) -> bool:
    """Validate `return_aux`; returns whether max_scores are asked for."""
    if return_lse:
        raise ValueError("pass either return_lse=True or return_aux=AuxRequest(lse=True), not both")
    if not (hasattr(request, "lse") and hasattr(request, "max_scores")):
        raise TypeError(
            "return_aux must be an AuxRequest(lse=..., max_scores=...) (from "
            f"torch.nn.attention.flex_attention or flexfa.AuxRequest), got {type(request).__name__}"
        )
    return bool(request.max_scores)


def _aux_output(request: Any, lse: torch.Tensor, max_scores: torch.Tensor | None) -> AuxOutput:
    return AuxOutput(
        lse=lse if request.lse else None, max_scores=max_scores if request.max_scores else None
    )


def build_spec(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Callable[..., Any] | None = None,
    block_mask: BlockMask | Callable[..., Any] | None = None,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
    kernel_options: Mapping[str, Any] | None = None,
    deterministic: bool = False,
    page_table: torch.Tensor | None = None,
    kv_lens: torch.Tensor | None = None,
    packed: PackedSequences | None = None,
    traced_score_mod: Any = _UNTRACED,
) -> AttentionSpec:
    """Validate a call's arguments, trace its mods and bind its block mask.

    `packed`: a packed call's sequences and its user's own mods (`_packed`), beside the rewritten
    mods passed as `score_mod` and `block_mask`. `traced_score_mod`: the score_mod already traced
    for these inputs (by `attention`'s repeated-call path, Note [Repeated inference calls]), so
    that a call is traced once."""
    paged = None
    if page_table is None and kv_lens is None:
        shape = validate_qkv(q, k, v, enable_gqa=enable_gqa)
    elif page_table is None or kv_lens is None:
        raise ValueError("a paged call needs both page_table and kv_lens")
    else:
        shape, paged = validate_paged(q, k, v, page_table, kv_lens, enable_gqa=enable_gqa)
    B, Hq, _, Lq, Lkv, E, _ = shape
    if kernel_options is not None and not isinstance(kernel_options, Mapping):
        raise TypeError(
            f"kernel_options must be a dict or None, got {type(kernel_options).__name__}"
        )
    traced_score = (
        _trace_score_mod(score_mod, Hq, q.device)
        if traced_score_mod is _UNTRACED
        else traced_score_mod
    )
    bm = resolve_block_mask(block_mask, B, Hq, Lq, Lkv, q.device)
    needs_grad = _wants_grad(q, k, v, traced_score)
    if needs_grad and (k.dtype != q.dtype or v.dtype != q.dtype):
        needs_grad = False  # Note [fp8 K/V]: no backward; `attention` makes asking for one raise
    if paged is not None and needs_grad:
        raise ValueError(
            "paged KV caches are for inference: call under torch.no_grad(), or with q, the pools "
            "and captured tensors not requiring grad"
        )
    return spec_from_shape(
        shape,
        q,
        scale=resolve_scale(scale, E),
        score_mod=traced_score,
        block_mask=bm,
        needs_grad=needs_grad,
        deterministic=bool(deterministic),
        kernel_options=dict(kernel_options or {}),
        # A paged pool's first dimension counts pages: the page table holds one row per sequence.
        batch_kv=k.shape[0] if paged is None else B,
        paged=paged,
        k_dtype=k.dtype,
        v_dtype=v.dtype,
        packed=packed,
    )


def _wants_grad(q, k, v, traced_score: TracedMod | None) -> bool:
    return torch.is_grad_enabled() and (
        q.requires_grad
        or k.requires_grad
        or v.requires_grad
        or (traced_score is not None and bool(traced_score.grad_slots()))
    )


class _NoBackward(torch.autograd.Function):
    """Passes (out, lse) through; their backward raises (Note [fp8 K/V] in flexfa/spec.py). The
    inputs that ask for gradients are arguments only so that autograd links the outputs to them."""

    @staticmethod
    def forward(ctx, message: str, out, lse, *inputs):
        ctx.message = message
        return out.view_as(out), lse.view_as(lse)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


def _refuse_backward(spec: AttentionSpec, q, k, v, out, lse):
    """(out, lse) of an fp8 K/V call, made to raise a clear error if a backward reaches them."""
    inputs = [t for t in (q, k, v) if t.requires_grad]
    if spec.score_mod is not None:
        inputs += [t for t in spec.score_mod.tensors if t.requires_grad]
    if not (torch.is_grad_enabled() and inputs):
        return out, lse
    msg = (
        f"flexfa cannot differentiate attention with k of dtype {k.dtype} and v of {v.dtype} "
        f"(q is {q.dtype}); like torch FlexAttention, its backward needs q, k and v of one "
        "dtype. Run inference under torch.no_grad() (or pass q.detach()), or upcast k and v "
        "to q's dtype to train."
    )
    return _NoBackward.apply(msg, out, lse, *inputs)


def _packed(q, k, score_mod, block_mask, cu_seqlens_q, cu_seqlens_kv):
    """The mods of a packed call on the concatenated sequences (Note [Packed batches as mods]),
    and its `PackedSequences` for backends with a variable-length path of their own (None inside
    torch.compile, whose ops run the concatenation)."""
    if cu_seqlens_q is None or cu_seqlens_kv is None:
        raise ValueError("a packed call needs both cu_seqlens_q and cu_seqlens_kv")
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4 or t.shape[0] != 1:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"with cu_seqlens, {name} must be (1, heads, total_len, head_dim), got {shape}"
            )
    compiling = torch.compiler.is_compiling()
    Lq, Lkv = q.shape[2], k.shape[2]
    pack = packing(cu_seqlens_q, cu_seqlens_kv, Lq, Lkv, q.device, defer=not compiling)
    packed_score, packed_mask = packed_mods(score_mod, block_mask, pack, q.shape[1])
    if compiling:
        return packed_score, packed_mask, None
    # Built (with the positions) only for a backend that runs the concatenation (Note [Block
    # masks built on first read] in flexfa/blockmask/block_mask.py).
    packed_mask = deferred_block_mask(packed_mask, pack, q.shape[1], q.device)
    sequences = PackedSequences(
        pack.cu_q,  # on q's device (Note [Offsets on the host] in flexfa/varlen.py)
        pack.cu_kv,
        pack.lengths_q,
        pack.lengths_kv,
        score_mod=_trace_score_mod(score_mod, q.shape[1], q.device),
        mask=None if block_mask is None else trace_mask_mod(block_mask, device=q.device),
    )
    return packed_score, packed_mask, sequences


def explain_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Callable[..., Any] | None = None,
    block_mask: BlockMask | Callable[..., Any] | None = None,
    **kwargs: Any,
) -> str:
    """Why each backend would or would not run this call (one line per backend, in priority order),
    then the one `backend="auto"` picks (Note [Which backend auto picks] in
    flexfa/backends/fa4.py: a backend that can run a call is not always the one auto prefers).

    >>> import torch, flexfa
    >>> q = k = v = torch.randn(1, 1, 16, 16)
    >>> print(flexfa.explain_backend(q, k, v).splitlines()[-2:])
    ['tiled: yes', 'auto: tiled']

    Keywords are `flexfa.attention`'s, packed batches (`cu_seqlens_q`, `cu_seqlens_kv`) included.
    """
    cu_q, cu_kv = kwargs.pop("cu_seqlens_q", None), kwargs.pop("cu_seqlens_kv", None)
    if cu_q is not None or cu_kv is not None:
        score_mod, block_mask, kwargs["packed"] = _packed(q, k, score_mod, block_mask, cu_q, cu_kv)
    spec = build_spec(q, k, v, score_mod, block_mask, **kwargs)
    lines = []
    for name, answer in backends.explain(spec):
        verdict = "yes" if answer.ok else "no"
        lines.append(
            f"{name}: {verdict} ({answer.reason})" if answer.reason else f"{name}: {verdict}"
        )
    for traced in (spec.score_mod, spec.mask):
        # Note [Custom ops traced through their Python implementation]
        for note in traced.traced_through if traced is not None else ():
            lines.append(f"{traced.kind} {traced.name!r}: custom op {note}")
    try:  # the lines above say why backends are skipped: no warning here
        lines.append(f"auto: {backends.select('auto', spec, warn=False).name}")
    except ValueError:
        lines.append("auto: none")
    return "\n".join(lines)
