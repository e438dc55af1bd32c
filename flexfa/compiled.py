"""flexfa inside `torch.compile`: the attention as two torch.library ops.

# Note [flexfa under torch.compile]
# Dynamo cannot trace flexfa's front end (the trace cache hashes code objects and ids, the tracer
# runs the mod on proxies), and should not: the front end's job is to turn Python mods into
# kernels once, which is exactly what a compiled graph wants to skip. So under `torch.compile`,
# `flexfa.attention` splits a call into what is decided once, while Dynamo traces, and what runs
# every step, inside the graph:
#   - `_describe(...)`, marked `torch.compiler.assume_constant_result`, runs in plain Python when
#     Dynamo reaches the call: it traces the score_mod and mask_mod (the usual trace cache), stores
#     them with the call's options in a registry under a short hashable key, and returns that key
#     together with *paths* to the tensors the mods capture (flexfa/capture_paths.py: closure
#     cell i, global `name`, default i, attribute `name`, item i, ...). It is never traced by
#     Dynamo.
#   - Dynamo then follows those paths itself (`fn.__closure__[i].cell_contents`, ...), so each
#     captured tensor reaches the graph as what it is there: an `nn.Parameter` of the model, a
#     buffer, an input, an intermediate. Guards on those tensors come with it, and a parameter's
#     values changing (an optimizer step) changes nothing in the graph: no recompile.
#   - A mod defined inside the compiled function exists only as Dynamo's variable, which can be
#     neither passed to `_describe` nor followed by paths: `local_mod` rebuilds it first and
#     `_describe` gets a token for the rebuilt mod, whose paths start at its roots (the tensors
#     and outside objects of its closure, as Dynamo's variables): Note [Local mods under
#     torch.compile] in flexfa/local_mods.py.
#   - `torch.ops.flexfa.attention(q, k, v, score_tensors, mask_tensors, scalars, key, ...)` is a
#     custom op with a fake (meta) implementation, so the graph has no break and dynamic shapes
#     flow through it; its autograd formula is registered and calls `flexfa::attention_backward`,
#     another custom op, so gradients reach q, k, v and the captured tensors, under AOTAutograd as
#     in eager. Inside, the ops look the key up, bind the tensors to the traced mods, build (or find
#     in its cache) the BlockMask for the actual lengths and run a backend's forward or backward.
# The ops run the same backends as eager calls; only where the block mask is built differs: inside
# the op, per call shape, from the mask_mod, so sequence lengths may change under `dynamic=True`
# without a recompile. A `flexfa.BlockMask` or torch `BlockMask` given to a compiled call is used
# through its mask_mod (rebuilt for the call's lengths, cached); block lists given by hand
# (`BlockMask.from_kv_blocks`) are not supported under torch.compile and raise.
# Lifted scalars (Note [Lifted scalars]) are passed as a `float[]` argument holding the values
# `_describe` saw: graph constants. Dynamo guards on the identity of a mod defined outside the
# compiled function, so a new mod object (a new `softcap(c)` made outside) traces again; a float
# changed in place inside the same mod's closure (`nonlocal`) is not seen until the graph is
# traced again. A local mod's floats are guarded by value (Note [Local mods under torch.compile]).
# Under CUDA graphs (`mode="reduce-overhead"`) the BlockMask is built in the warm-up run, outside
# the graph's memory pool (Note [Caches under CUDA graphs] in flexfa/runtime/persist.py), and the recorded
# graph replays the kernels with it: a mask_mod that reads a captured tensor (document ids) must
# keep that tensor's values fixed across replays, or be called outside the graphed region. On the
# H200 a decode loop (forward only) runs and replays right under CUDA graphs; a training step
# must set its grads to None each step (torch's rule for CUDA graph outputs, tests/e2e/
# test_compile.py).
# Eager calls never reach this module: `torch.compiler.is_compiling()` is the only cost they pay.
# Importing it must not import Dynamo either (Note [Marked constant without Dynamo]).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from flexfa import backends, local_mods
from flexfa.blockmask.bind import (
    DEFAULT_BLOCK_SIZE,
    cached_block_mask,
    is_torch_block_mask,
    uncached_block_mask,
)
from flexfa.blockmask.block_mask import BlockMask, BlockSize
from flexfa.capture_paths import follow, paths_for, unreachable_capture
from flexfa.frontend.proxy import ModTraceError
from flexfa.frontend.trace import TracedMod, trace_mask_mod, trace_score_mod
from flexfa.layout import empty_like_query
from flexfa.local_mods import Path
from flexfa.mods import HeadsDependentMod
from flexfa.spec import AttentionSpec, resolve_scale, spec_from_shape, validate_qkv


# -- the registry of described calls ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Described:
    """What `_describe` decided for one call site: traced mods, where their tensors come from, and
    the options. `*_inputs[slot]` is the index of that capture among the op's tensor inputs, or
    None where the tensor is not reachable by a path and the traced tensor is used as a constant."""

    heads: Callable[[int], Any] | None  # a HeadsDependentMod's factory, bound per call
    score: TracedMod | None
    mask: TracedMod | None
    score_paths: tuple[Path, ...]
    mask_paths: tuple[Path, ...]
    score_inputs: tuple[int | None, ...]
    mask_inputs: tuple[int | None, ...]
    block_size: BlockSize
    backend: str
    kernel_options: tuple[tuple[str, Any], ...]
    deterministic: bool
    enable_gqa: bool
    # Captures of a local mask_mod computed inside the graph (Note [Local mods under CUDA graphs])
    mask_computed: tuple[str, ...] = ()

    def bind(
        self,
        score_tensors: list[torch.Tensor],
        mask_tensors: list[torch.Tensor],
        scalars: list,
        q: torch.Tensor,
    ) -> tuple[TracedMod | None, TracedMod | None]:
        score, mask = self.score, self.mask
        if self.heads is not None:
            score = trace_score_mod(self.heads(q.shape[1]), device=q.device)
            score = None if score.is_identity else score
        elif score is not None:
            tensors = tuple(
                t if i is None else score_tensors[i]
                for t, i in zip(score.tensors, self.score_inputs)
            )
            score = score.rebound(tensors=tensors, scalar_values=tuple(scalars))
        if mask is not None and self.mask_inputs:
            tensors = tuple(
                t if i is None else mask_tensors[i] for t, i in zip(mask.tensors, self.mask_inputs)
            )
            mask = mask.with_tensors(tensors)
        return score, mask


_registry: dict[str, Described] = {}
_lock = threading.Lock()


def _mask_parts(block_mask: Any) -> tuple[Callable[..., Any] | None, BlockSize]:
    """The mask_mod and block size a compiled call builds its BlockMask from."""
    if block_mask is None:
        return None, DEFAULT_BLOCK_SIZE
    if isinstance(block_mask, BlockMask):
        if not block_mask.tiles_from_mask:
            raise NotImplementedError(
                "block_mask: a BlockMask whose block lists were given by hand (from_kv_blocks) "
                "cannot be used inside torch.compile; pass its mask_mod, or call flexfa.attention "
                "outside the compiled region"
            )
        return block_mask.mask.fn, block_mask.block_size
    if is_torch_block_mask(block_mask):
        bq, bkv = block_mask.BLOCK_SIZE
        return block_mask.mask_mod, BlockSize(int(bq), int(bkv))
    if callable(block_mask):
        return block_mask, DEFAULT_BLOCK_SIZE
    raise TypeError(
        "block_mask must be a flexfa.BlockMask, a torch BlockMask, a mask_mod(b, h, q_idx, kv_idx) "
        f"or None, got {type(block_mask).__name__}"
    )


# Note [Marked constant without Dynamo]
# `torch.compiler.assume_constant_result` imports torch._dynamo to set one attribute on the
# function, and `import flexfa` paid for it: 2.4 of its 5.1 s on a 2-core CPU, for every user,
# compiling or not. Dynamo reads the attribute only when it traces, by which time it is imported.
# So flexfa sets the same attribute itself; tests/e2e/test_compile.py checks that it is exactly
# what torch's decorator sets (a torch that marks constants differently fails that test) and that
# `import flexfa` leaves Dynamo unimported.
def _assume_constant_result(fn: Callable) -> Callable:
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@_assume_constant_result
def _describe(
    score_mod: Any,
    heads: Callable[[int], Any] | None,
    block_mask: Any,
    device_type: str,
    backend: str,
    kernel_options: tuple[tuple[str, Any], ...],
    deterministic: bool,
    enable_gqa: bool,
    score_local: str | None = None,
    mask_local: str | None = None,
) -> tuple:
    """Trace the mods in plain Python and register them (Note [flexfa under torch.compile]).

    `score_local`, `mask_local`: the tokens of local mods, passed instead of `score_mod` and
    `block_mask` (Note [Local mods under torch.compile]); their paths start at their roots.

    Returns (key, paths to the score_mod's tensors, which input each of its slots reads, paths to
    the mask_mod's tensors, lifted scalars, None), or (None, ..., (flexfa's message, whether the
    mod was traced)) where a mod cannot be traced or reads a tensor without a path (Note
    [Captured tensors torch.compile cannot reach])."""
    device = torch.device(device_type)
    local_score = local_mods.take(score_local) if score_local is not None else None
    local_mask = local_mods.take(mask_local) if mask_local is not None else None
    if local_score is not None:
        score_mod = local_score.fn
    if local_mask is not None:
        block_mask = local_mask.fn
    mask_fn, block_size = _mask_parts(block_mask)
    try:
        score = trace_score_mod(score_mod, device=device) if score_mod is not None else None
        mask = trace_mask_mod(mask_fn, device=device) if mask_fn is not None else None
    except ModTraceError as e:  # reported by the hook already under fullgraph=True
        return _refusal(str(e), traced=False)
    if score is not None and score.is_identity:
        score = None
    score_paths, score_inputs = paths_for(score, score_mod, local_score)  # none for a bound mod
    mask_paths, mask_inputs = paths_for(mask, mask_fn, local_mask)
    for traced, inputs in ((score, score_inputs), (mask, mask_inputs)):
        # Note [Captured tensors torch.compile cannot reach]: not registered; the caller raises.
        problem = unreachable_capture(traced, inputs)
        if problem is not None:
            return _refusal(problem, traced=True)
    described = Described(
        heads=heads,
        score=score,
        mask=mask,
        score_paths=score_paths,
        mask_paths=mask_paths,
        score_inputs=score_inputs,
        mask_inputs=mask_inputs,
        block_size=block_size,
        backend=backend,
        kernel_options=kernel_options,
        deterministic=deterministic,
        enable_gqa=enable_gqa,
        mask_computed=tuple(
            cap.name
            for cap, t in zip(mask.captures, mask.tensors)
            if local_mask is not None and id(t) in local_mask.computed
        )
        if mask is not None
        else (),
    )
    constants = tuple(
        id(t)
        for traced, inputs in ((score, score_inputs), (mask, mask_inputs))
        if traced is not None
        for t, i in zip(traced.tensors, inputs)
        if i is None
    )
    text = repr(
        (
            heads,
            score.key if score else None,
            mask.key if mask else None,
            score_paths,
            mask_paths,
            constants,
            block_size,
            backend,
            kernel_options,
            deterministic,
            enable_gqa,
            described.mask_computed,
        )
    )
    key = hashlib.sha256(text.encode()).hexdigest()[:20]
    with _lock:
        _registry[key] = described
    scalars = score.scalar_values if score is not None else ()
    return key, score_paths, score_inputs, mask_paths, scalars, None


def _lookup(key: str) -> Described:
    try:
        return _registry[key]
    except KeyError:
        raise RuntimeError(
            f"flexfa: no compiled attention call with key {key!r} in this process; the graph was "
            "made by another process (flexfa registers its mods while torch.compile traces)"
        ) from None


# -- the ops ------------------------------------------------------------------------------------------
def _spec(
    d: Described,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score: TracedMod | None,
    mask: TracedMod | None,
    scale: float,
    needs_grad: bool,
    grad_slots: frozenset[int],
    max_scores: bool = False,
) -> AttentionSpec:
    shape = validate_qkv(q, k, v, enable_gqa=d.enable_gqa)
    _check_same_dtype(q, k, v)
    if d.mask_computed and _capturing(q):
        raise RuntimeError(
            f"flexfa: the mask_mod {d.mask.name!r} reads {', '.join(d.mask_computed)}, computed "
            "inside the compiled graph; under CUDA graphs (mode='reduce-overhead') its BlockMask "
            "would be built while the graph is recorded, before that value exists (Note [Local "
            "mods under CUDA graphs]). Compute it outside the compiled function and pass it in "
            "as an input, or compile without CUDA graphs."
        )
    B, Hq, _, Lq, Lkv, _, _ = shape
    if mask is None:
        from flexfa.blockmask.bind import allow_all

        mask = trace_mask_mod(allow_all, device=q.device)
    build = uncached_block_mask if d.mask_computed else cached_block_mask
    bm = build(mask, B, Hq, Lq, Lkv, q.device, d.block_size)
    return spec_from_shape(
        shape,
        q,
        scale=scale,
        score_mod=score,
        block_mask=bm,
        needs_grad=needs_grad,
        deterministic=d.deterministic,
        kernel_options=dict(d.kernel_options),
        capture_grads=grad_slots if needs_grad else None,
        max_scores=max_scores,
        # batch 1: one K/V for every query batch element (Note [K/V batch broadcast])
        batch_kv=k.shape[0],
    )


def saved_dtype(
    backend: str, device: torch.device, dtype: torch.dtype, capture_grads: bool
) -> torch.dtype | None:
    """The dtype of the forward's saved output, or None where the output itself is saved.

    Decided from the call's description alone, since the fake implementation must know it: for
    float16/bfloat16 inputs the tiled backend always keeps a float32 output (Note [Delta from the
    unrounded output]), the Triton kernels only when a captured tensor needs a gradient (Note
    [Unrounded output for delta] in flexfa/codegen/triton/backend.py).
    """
    if dtype in (torch.float32, torch.float64) or backend == "fa4":
        return None
    # On CUDA, auto runs such calls on triton (fa4 only without 16-bit captured gradients: Note
    # [Which backend auto picks] in flexfa/backends/fa4.py), so the answer is the same for both.
    triton = backend == "triton" or (backend == "auto" and device.type == "cuda")
    return torch.float32 if capture_grads or not triton else None


@torch.library.custom_op("flexfa::attention", mutates_args=())
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_tensors: list[torch.Tensor],
    mask_tensors: list[torch.Tensor],
    scalars: list[float],
    key: str,
    scale: float,
    grad_mask: int,
    max_scores: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, saved, max_scores): `saved` is empty unless the backward needs an unrounded
    output, `max_scores` empty unless asked for.

    Bit i of `grad_mask` says that the score_mod's captured tensor in slot i gets a gradient."""
    d = _lookup(key)
    score, mask = d.bind(score_tensors, mask_tensors, scalars, q)
    spec = _spec(d, q, k, v, score, mask, scale, True, _slots(grad_mask), max_scores)
    impl = backends.select(d.backend, spec)
    out, lse, saved, row_max = impl.forward(spec, q, k, v)
    want = saved_dtype(d.backend, q.device, q.dtype, grad_mask != 0)
    saved = q.new_empty(0) if want is None else saved.to(want)
    return out, lse, saved, row_max.to(lse.dtype) if row_max is not None else lse.new_empty(0)


@attention_op.register_fake
def _(q, k, v, score_tensors, mask_tensors, scalars, key, scale, grad_mask, max_scores):
    d = _lookup(key)
    B, Hq, Lq = q.shape[0], q.shape[1], q.shape[2]
    Ev = v.shape[3]
    out = empty_like_query(q, (B, Hq, Lq, Ev))  # the real output's strides: Note [Output layout]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = q.new_empty(B, Hq, Lq, dtype=lse_dtype)
    want = saved_dtype(d.backend, q.device, q.dtype, grad_mask != 0)
    saved = q.new_empty(0) if want is None else empty_like_query(q, (B, Hq, Lq, Ev), want)
    row_max = q.new_empty(B, Hq, Lq, dtype=lse_dtype) if max_scores else lse.new_empty(0)
    return out, lse, saved, row_max


@torch.library.custom_op("flexfa::attention_backward", mutates_args=())
def attention_backward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    saved: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    score_tensors: list[torch.Tensor],
    mask_tensors: list[torch.Tensor],
    scalars: list[float],
    key: str,
    scale: float,
    grad_mask: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(dq, dk, dv, gradients of the score_mod's captured tensors in `grad_mask`, by slot)."""
    d = _lookup(key)
    score, mask = d.bind(score_tensors, mask_tensors, scalars, q)
    slots = _slots(grad_mask)
    spec = _spec(d, q, k, v, score, mask, scale, True, slots)
    impl = backends.select(d.backend, spec)
    saved_out = out if saved.numel() == 0 else saved
    dq, dk, dv, grads = impl.backward(spec, q, k, v, saved_out, lse, dout, dlse, slots)
    tensors = score.tensors if score is not None else ()
    capture_grads = [
        grads[s] if s in grads else torch.zeros_like(tensors[s]) for s in sorted(slots)
    ]
    return _like(dq, q), _like(dk, k), _like(dv, v), capture_grads


def _like(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`grad` in the strides of `x`, which the fake implementation promised (`empty_like`): a
    backend may return another layout (that of the contiguous dout), and compiled code after the
    op relies on the promise, e.g. viewing dq of a q transposed from (B, L, H, E) back."""
    if grad.stride() == x.stride():
        return grad
    return torch.empty_like(x).copy_(grad)


@attention_backward_op.register_fake
def _(q, k, v, out, saved, lse, dout, dlse, score_tensors, mask_tensors, scalars, key, scale, gm):
    d = _lookup(key)
    grads = []
    for s in sorted(_slots(gm)):
        i = d.score_inputs[s] if d.score is not None else None
        like = score_tensors[i] if i is not None else d.score.tensors[s]  # type: ignore[union-attr]
        grads.append(torch.empty_like(like))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), grads


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, score_tensors, mask_tensors, scalars, key, scale, grad_mask, _ = inputs
    out, lse, saved, row_max = output
    ctx.mark_non_differentiable(row_max)
    ctx.save_for_backward(q, k, v, out, saved, lse, *score_tensors, *mask_tensors)
    ctx.num_score = len(score_tensors)
    ctx.info = (list(scalars), key, scale, grad_mask)


def _backward(ctx, dout, dlse, dsaved, dmax):
    q, k, v, out, saved, lse, *tensors = ctx.saved_tensors
    score_tensors, mask_tensors = tensors[: ctx.num_score], tensors[ctx.num_score :]
    scalars, key, scale, grad_mask = ctx.info
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, grads = attention_backward_op(
        q, k, v, out, saved, lse, dout.contiguous(), dlse, list(score_tensors),
        list(mask_tensors), scalars, key, scale, grad_mask,
    )  # fmt: skip
    d = _lookup(key)
    score_grads: list[torch.Tensor | None] = [None] * len(score_tensors)
    for slot, g in zip(sorted(_slots(grad_mask)), grads):
        i = d.score_inputs[slot]
        if i is not None:
            score_grads[i] = g
    mask_grads = [None] * len(mask_tensors)
    # torch.library's autograd wants the inputs' structure back: a non-empty float list is one
    # leaf (None), an empty one an empty list.
    scalar_grads = None if scalars else []
    return dq, dk, dv, score_grads, mask_grads, scalar_grads, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


# -- the Dynamo-traced front -------------------------------------------------------------------------
def compiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Any,
    block_mask: Any,
    *,
    scale: float | None,
    enable_gqa: bool,
    backend: str,
    kernel_options: Mapping[str, Any] | None,
    deterministic: bool,
    max_scores: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`flexfa.attention` while torch.compile traces: (out, lse, max_scores) from the ops above
    (max_scores empty unless asked for)."""
    _check_same_dtype(q, k, v)
    options = tuple(sorted((kernel_options or {}).items()))
    heads = None
    if isinstance(score_mod, HeadsDependentMod):  # bound in the ops, per number of heads
        heads, score_mod = score_mod._make, None
    # Note [Local mods under torch.compile]: a mod defined inside the compiled function is
    # rebuilt where Dynamo keeps it; `_describe` gets its token, `follow` starts at its roots.
    device_type = q.device.type
    score_local = local_mod(score_mod, "score_mod", device_type) if score_mod is not None else None
    mask_local = local_mod(block_mask, "mask_mod", device_type) if block_mask is not None else None
    key, score_paths, score_inputs, mask_paths, scalars, problem = _describe(
        None if score_local else score_mod, heads, None if mask_local else block_mask,
        device_type, backend, options, bool(deterministic), bool(enable_gqa),
        score_local[0] if score_local else None, mask_local[0] if mask_local else None,
    )  # fmt: skip
    if problem is not None:  # Note [Captured tensors torch.compile cannot reach]
        _refuse(*problem)  # type: ignore[misc]  # set by `_describe`, outside Dynamo
    score_root = score_local[1] if score_local else score_mod
    mask_root = mask_local[1] if mask_local else _mask_root(block_mask)
    score_tensors = [follow(score_root, p) for p in score_paths]
    mask_tensors = [follow(mask_root, p) for p in mask_paths]
    grad_mask = 0
    for slot, i in enumerate(score_inputs):
        if i is not None and _needs_grad(score_tensors[i]):
            grad_mask |= 1 << slot
    out, lse, _, row_max = attention_op(
        q, k, v, score_tensors, mask_tensors, list(scalars), key,
        resolve_scale(scale, q.shape[-1]), grad_mask, max_scores,
    )  # fmt: skip
    return out, lse, row_max


def local_mod(fn: Any, kind: str, device_type: str) -> tuple[str, tuple] | None:
    """(token, roots) of `fn` if it is a mod defined inside the compiled region, else None (Note
    [Local mods under torch.compile] in flexfa/local_mods.py). Traced by Dynamo: `comptime` runs
    `_split_hook` on Dynamo's variable for `fn`, which sets `split`; in eager Python it is None."""
    from torch._dynamo.comptime import comptime

    split = None
    comptime(_split_hook)
    return split


def _split_hook(ctx: Any) -> None:
    """Run by Dynamo inside `local_mod`'s frame: set its local `split` for a local mod `fn`."""
    from torch._dynamo import variables as dv
    from torch._dynamo.exc import unimplemented

    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    fn = ctx.get_local("fn")._i_will_not_complain_if_bc_breaks_VariableTracker()
    kind = ctx.get_local("kind").as_python_constant()
    device = torch.device(ctx.get_local("device_type").as_python_constant())
    if not local_mods.is_local(fn):
        _check_outside_mod(fn, kind, device)
        return
    split = None
    try:
        split = local_mods.split(tx, fn, kind)
        # Traced here, where an error can be Dynamo's graph break with flexfa's message (raised
        # from `_describe`, it would reach the user wrapped as an internal Dynamo error);
        # `_describe` finds the trace in the trace cache.
        local = local_mods.peek(split.token)
        trace = trace_score_mod if kind == "score_mod" else trace_mask_mod
        local_mods.check_captures(local, trace(local.fn, device=device))
    except (local_mods.LocalModError, ModTraceError) as e:
        if split is not None:
            local_mods.take(split.token)
        what = "captured" if isinstance(e, local_mods.LocalModError) else "traced"
        unimplemented(
            gb_type=f"flexfa: a mod defined inside the compiled function cannot be {what}",
            context=kind,
            explanation=str(e),
            hints=[],
            log_warning=True,
        )
    # What `local_mod` returns, as Dynamo's variables: (token, roots).
    tx.symbolic_locals["split"] = dv.TupleVariable(
        [dv.ConstantVariable.create(split.token), dv.TupleVariable(list(split.roots))]
    )


def _check_outside_mod(vt: Any, kind: str, device: torch.device) -> None:
    """Run by `_split_hook` for a mod made outside the compiled region (Dynamo's variable `vt`):
    trace it here, so that a mod flexfa cannot trace, or one that reads a tensor torch.compile
    cannot reach (Note [Captured tensors torch.compile cannot reach]), is a graph break with
    flexfa's message; raised from `_describe`, it would reach the user wrapped as an internal
    Dynamo error. `_describe` then finds the trace in the trace cache."""
    from torch._dynamo.exc import unimplemented

    value = _python_value(vt)
    if value is None or isinstance(value, HeadsDependentMod):
        return
    try:
        fn = _mask_parts(value)[0] if kind == "mask_mod" else value
    except (TypeError, NotImplementedError):
        return  # `_describe` raises these, naming the argument
    if fn is None:
        return
    trace = trace_score_mod if kind == "score_mod" else trace_mask_mod
    try:
        traced = trace(fn, device=device)
    except ModTraceError as e:
        message, what = str(e), "traced"
    else:
        if kind == "score_mod" and traced.is_identity:
            return
        message, what = unreachable_capture(traced, paths_for(traced, fn)[1]), "captured"
    if message is not None:
        unimplemented(
            gb_type=f"flexfa: a mod cannot be {what} under torch.compile",
            context=kind,
            explanation=message,
            hints=[],
            log_warning=True,
        )


def _raise(message: str, traced: bool) -> None:
    """flexfa's error for a call `_describe` refused: a mod that reads a tensor without a path
    (`traced`), or one that cannot be traced (ModTraceError, as in eager)."""
    raise RuntimeError(message) if traced else ModTraceError(message)


# `_raise` as run outside Dynamo (`torch.compiler.disable`), made by `_describe` when it first
# refuses a call: disabling a function imports Dynamo (Note [Marked constant without Dynamo]).
_refuse: Callable[[str, bool], None] | None = None


def _refusal(message: str, traced: bool) -> tuple:
    """What `_describe` returns for a call it refuses: no key, and the arguments of `_refuse`."""
    global _refuse
    if _refuse is None:
        _refuse = torch.compiler.disable(_raise, recursive=True)
    return None, (), (), (), (), (message, traced)


def _python_value(vt: Any) -> Any:
    """The Python object behind Dynamo's variable for a mod made outside the compiled region (a
    function, a module, a BlockMask), or None where Dynamo does not keep one."""
    vt = vt.realize()
    try:
        return vt.as_python_constant()
    except Exception:
        pass
    for attr in ("value", "fn"):
        obj = getattr(vt, attr, None)
        if obj is not None:
            return obj
    return None


def _check_same_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"k and v of dtypes {k.dtype} and {v.dtype} with q of {q.dtype} are not supported "
            "inside torch.compile yet (Note [fp8 K/V] in flexfa/spec.py): call flexfa.attention "
            "with fp8 K/V outside the compiled region"
        )


def _mask_root(block_mask: Any) -> Any:
    if isinstance(block_mask, BlockMask):
        return block_mask.mask.fn
    if is_torch_block_mask(block_mask):
        return block_mask.mask_mod
    return block_mask


# Note [Local mods under CUDA graphs]
# A BlockMask is built from the values of the mask_mod's tensors. Under CUDA graphs the op runs
# once more while the graph is recorded, where a cache miss is built on flexfa's builder thread
# without waiting for the captured stream (Note [Caches under CUDA graphs]): the values it reads
# are those already in memory. That holds for inputs, parameters and globals, whose memory holds
# their values; a tensor the graph itself computes (a local mask_mod's intermediate, such as
# document ids made in `forward`) has no value yet while the graph is recorded, so its BlockMask
# would be built from stale memory and replayed: a silently wrong mask. So `_describe` records
# which captures of a local mask_mod are computed in the graph (Note [Local mods under
# torch.compile] in flexfa/local_mods.py), and building a BlockMask from them while a stream is
# captured raises instead. A local score_mod's intermediates are fine: the kernels read them at
# every replay. Such a BlockMask is also never cached (`uncached_block_mask`): its tensors are new
# at every call, and a cache entry would keep them alive; under CUDA graphs the warm-up runs
# allocate them in the graph's pool, and a tensor kept there makes cudagraph trees stop the
# recording with an error of its own ("tensor(s) in the cudagraph pool not tracked as outputs")
# before this one could say why.
def _capturing(q: torch.Tensor) -> bool:
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


def _slots(grad_mask: int) -> frozenset[int]:
    return frozenset(i for i in range(grad_mask.bit_length()) if grad_mask >> i & 1)


def _needs_grad(t: torch.Tensor) -> bool:
    return t.requires_grad and t.dtype.is_floating_point and torch.is_grad_enabled()
