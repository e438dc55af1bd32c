"""The Triton kernels of a call: generated fused forward and backward kernels, planned and launched.

`run` builds a `Launcher` (module + configs + launch arguments) and runs it through an autograd
Function; the "triton" backend (flexfa/backends/triton.py) says which calls it takes. Kernels come from `module.load_module` (rendered from the templates, cached);
see templates/*.jinja for the kernels themselves.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from typing import Any

import torch

from flexfa.blockmask.block_mask import BlockList, BlockMask
from flexfa.codegen.triton import autotune, decode, emit
from flexfa.codegen.triton import configs as cfgs
from flexfa.codegen.triton.params import BwdConfig, FwdConfig, KernelKey
from flexfa.codegen.triton.plan import Plan, make_plan, plan_key, plans
from flexfa.frontend.trace import TracedMod
from flexfa.layout import empty_like_query
from flexfa.runtime.launch import (
    KernelLaunch,
    concurrent_enabled,
    launch,
    prewarm,
    warm_up,
)
from flexfa.runtime.persist import persistent
from flexfa.spec import AttentionSpec

log = logging.getLogger("flexfa")

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
_COMPILE_LOG_SECONDS = 1.0


@dataclasses.dataclass(frozen=True)
class _ListArgs:
    """Block-list tensors and strides as the kernels read them (broadcast dims get stride 0)."""

    partial: BlockList
    full: BlockList

    def args(self) -> list:
        def bs(t: torch.Tensor, dim: int) -> int:
            return 0 if t.shape[dim] == 1 else t.stride(dim)

        def strides(t: torch.Tensor) -> list[int]:
            return [bs(t, 0), bs(t, 1), t.stride(2)]

        return [
            self.partial.count,
            self.partial.index,
            self.full.count,
            self.full.index,
            *strides(self.partial.count),
            *strides(self.partial.index),
            *strides(self.full.count),
            *strides(self.full.index),
        ]


@dataclasses.dataclass(frozen=True)
class _ListFlags:
    has_kv_partial: bool
    has_kv_full: bool
    has_q_partial: bool
    has_q_full: bool


_flags_cache: weakref.WeakKeyDictionary[BlockMask, _ListFlags] = weakref.WeakKeyDictionary()


def _list_flags(bm: BlockMask) -> _ListFlags:
    """Which block lists are non-empty anywhere (one host sync per BlockMask, then cached)."""
    flags = _flags_cache.get(bm)
    if flags is None:
        # on the builder thread: a host sync must not reach a stream a CUDA graph is capturing
        counts = persistent(
            bm.device,
            lambda: torch.stack(
                [bl.count.amax() for bl in (bm.kv_partial, bm.kv_full, bm.q_partial, bm.q_full)]
            ).tolist(),
        )
        flags = _ListFlags(*(bool(c > 0) for c in counts))
        _flags_cache[bm] = flags
    return flags


def _capture_args(traced: TracedMod | None, tensors: tuple[torch.Tensor, ...]) -> list:
    if traced is None:
        return []
    return emit.mod_values(traced, tensors)


# Note [Unrounded output for delta]
# The backward's delta_i = rowsum(dO_i * O_i) is subtracted from dp_ij = dO_i . v_j, which the
# kernels compute exactly enough (float32 accumulation of products of 16-bit values). An O rounded
# to float16 (bfloat16) is off by up to half an ulp, about |O| 2**-11 (2**-8), so every ds_ij =
# p_ij (dp_ij - delta_i) of row i carries the same error, whose sum over the row is the error of
# delta_i itself. dq, dk and dv hardly see it (beside the rounding of their own results), but a
# captured tensor's gradient is a sum of ds over many pairs: a per-head bias `h16[h]` receives the
# sum of every row's delta error, a query-indexed bias `bias[h, q_idx]` exactly its row's (its
# true gradient is dlse_i). For the fuzzer's per-head float16 bias (18 x 15) the float32 gradient
# was 3.0e-3 off, 4x the error of the float16 eager reference; from the kernel's float32 output
# it is 7.9e-4 off, and from the exact output 2e-6.
#
# So when captured tensors need gradients and the inputs are 16-bit, the forward also writes its
# output in float32 (`WRITE_OUT_F32`, the same accumulator as the rounded store), the autograd
# Function saves that copy instead of the rounded one, and the preprocess kernel, which upcasts
# whatever it reads, computes delta from it. The gradient buffers were float32 already (atomics),
# cast once to the tensor's dtype at the end. What remains (the 7.9e-4 above) is the rounding of
# p to the input dtype for the forward's P @ V product: eager torch rounds its probabilities too,
# and splitting p into two 16-bit halves would double that product's cost, so it stays.
#
# Cost, only for such calls: the forward writes 4 more bytes per output element (B*Hq*Lq*Ev), the
# preprocess reads 4 bytes per element instead of 2, and autograd keeps the float32 copy instead of
# the 16-bit output (2 more bytes per element held until the backward). Against the forward's own
# traffic (K and V re-read once per q tile) this is small (bench/unrounded_output_cost.py times
# both kernels each way). Calls without learnable captures compile the store out and are
# unchanged. The alternatives cost more: delta needs dO, so the forward cannot compute it;
# recomputing sum_j p_ij dp_ij in the backward is another pass over K and V. The tiled backend
# keeps its float32 output for every 16-bit call (Note [Delta from the unrounded output] in
# flexfa/backends/tiled.py).


class Launcher:
    """One call's kernels, configs and launch arguments (shared by forward and backward)."""

    def __init__(
        self,
        spec: AttentionSpec,
        capability: tuple[int, int] | None = None,
        *,
        force_compiled: bool = False,
    ) -> None:
        """`capability` overrides the device's (major, minor) and `force_compiled` loads real JIT
        functions even under TRITON_INTERPRET: both for compiling without a GPU (offline.py)."""
        self.spec = spec
        self.mask = None if spec.mask.is_trivially_true else spec.mask
        self.grad_slots = spec.score_grad_slots
        if capability is None:
            capability = cfgs.device_capability(spec.device)
        self.flags = _list_flags(spec.block_mask)
        has_partial = self.flags.has_kv_partial
        key = plan_key(spec, self.mask, capability, force_compiled)
        if key is not None:
            key = (*key, has_partial)
        found = plans.get(key) if key is not None else None
        if found is None:
            found = make_plan(spec, self.mask, capability, force_compiled, has_partial)
            if key is not None:
                plans[key] = found
        self.plan: Plan = found
        self.max_scores: torch.Tensor | None = None  # written by `forward` when the spec asks
        self.saved_out: torch.Tensor | None = None  # set by `forward`

    # The plan's fields, read as the launcher's own (autotuning writes through to the plan).
    key = property(lambda self: self.plan.key)
    module = property(lambda self: self.plan.module)
    capability = property(lambda self: self.plan.capability)
    tuning_key = property(lambda self: self.plan.tuning_key)
    fused_dq = property(lambda self: self.plan.fused_dq)
    precision = property(lambda self: self.plan.precision)
    head_dim_pad = property(lambda self: self.plan.head_dim_pad)
    head_dim_v_pad = property(lambda self: self.plan.head_dim_v_pad)

    @property
    def configs(self) -> cfgs.KernelConfigs:
        return self.plan.configs

    @configs.setter
    def configs(self, value: cfgs.KernelConfigs) -> None:
        self.plan.configs = value

    @property
    def tune(self) -> bool:
        return self.plan.tune

    @tune.setter
    def tune(self, value: bool) -> None:
        self.plan.tune = value

    def _kernel_key(self, kernel: str, cfg, **constexprs) -> KernelKey:
        return KernelKey.for_spec(self.key, kernel, self.spec, cfg, constexprs)

    def _label(self, kernel: str) -> str:
        spec = self.spec
        sm = spec.score_mod.name if spec.score_mod else "none"
        mm = self.mask.name if self.mask else "none"
        return f"{kernel} (score_mod={sm}, mask_mod={mm}, {spec.dtype_name}, D={spec.head_dim})"

    def _mod_args(self, score_tensors: tuple[torch.Tensor, ...]) -> list:
        mask_tensors = self.mask.tensors if self.mask is not None else ()
        return _capture_args(self.spec.score_mod, score_tensors) + _capture_args(
            self.mask, mask_tensors
        )

    def _make(
        self,
        name: str,
        kernel,
        grid,
        args: list,
        constexprs: dict,
        cfg,
        label: str,
        key_extra: dict | None = None,
    ) -> KernelLaunch:
        """`key_extra`: what else selects the compiled specialization (Triton specializes on the
        dtypes of pointer arguments), recorded in the launch's key only."""
        num_warps = getattr(cfg, "num_warps", 4)
        num_stages = getattr(cfg, "num_stages", 1)
        return KernelLaunch(
            name=name,
            kernel=kernel,
            grid=grid,
            args=tuple(args),
            constexprs=constexprs,
            num_warps=num_warps,
            num_stages=num_stages,
            key=self._kernel_key(name, cfg, **constexprs, **(key_extra or {})),
            label=self._label(label),
        )

    def _shape_constexprs(self) -> dict[str, Any]:
        spec = self.spec
        return dict(
            HEAD_DIM=spec.head_dim,
            HEAD_DIM_V=spec.head_dim_v,
            HEAD_DIM_PAD=self.head_dim_pad,
            HEAD_DIM_V_PAD=self.head_dim_v_pad,
            SPARSE_Q=spec.block_mask.block_size.q,
            SPARSE_KV=spec.block_mask.block_size.kv,
            INPUT_PRECISION=self.precision,
        )

    def _kv_side_constexprs(self, block_m: int, block_n: int) -> dict[str, Any]:
        """Constexprs of a kernel that owns q tiles and walks the kv-side lists (forward, dQ)."""
        spec = self.spec
        return dict(
            self._shape_constexprs(),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            # Loops walk whole KV blocks, so columns are in range only if blocks divide KV_LEN.
            EVEN_M=spec.len_q % block_m == 0,
            EVEN_N=spec.len_kv % spec.block_mask.block_size.kv == 0,
            HAS_PARTIAL=self.flags.has_kv_partial,
            HAS_FULL=self.flags.has_kv_full,
        )

    @property
    def saves_unrounded_output(self) -> bool:
        """Whether the forward also writes its output in float32 for the backward (Note
        [Unrounded output for delta])."""
        return bool(self.grad_slots) and self.spec.dtype in (torch.float16, torch.bfloat16)

    def forward_launch(
        self,
        q,
        k,
        v,
        out,
        lse,
        score_tensors,
        cfg: FwdConfig | None = None,
        max_scores=None,
        out_f32=None,
    ) -> KernelLaunch:
        """`max_scores` (laid out like `lse`): also write the row max of the modified scores.
        `out_f32` (float32, laid out like `out`): also write the output before its rounding."""
        spec = self.spec
        bm = spec.block_mask
        cfg = cfg or self.configs.fwd
        Lq, Lkv = spec.len_q, spec.len_kv
        constexprs = self._kv_side_constexprs(cfg.block_m, cfg.block_n)
        constexprs["WRITE_MAX"] = max_scores is not None
        constexprs["WRITE_OUT_F32"] = out_f32 is not None
        if out_f32 is not None and out_f32.stride() != out.stride():
            raise ValueError(
                f"out_f32 must be laid out like out: strides {out_f32.stride()} != {out.stride()}"
            )
        args = [
            q, k, v, out, lse, lse if max_scores is None else max_scores,
            out if out_f32 is None else out_f32,
            *q.stride(), *spec.kv_strides(k), *spec.kv_strides(v), *out.stride(),
            lse.stride(0), lse.stride(1),
            *_ListArgs(bm.kv_partial, bm.kv_full).args(),
            Lq, Lkv, spec.heads_q, spec.group_size, spec.scale,
            *self._mod_args(score_tensors),
        ]  # fmt: skip
        grid = (triton_cdiv(Lq, cfg.block_m), spec.batch * spec.heads_q)
        return self._make("fwd", self.module.flexfa_fwd, grid, args, constexprs, cfg, "forward")

    def backward_launches(
        self,
        q,
        k,
        v,
        out,
        lse,
        dout,
        dlse,
        delta,
        dq,
        dk,
        dv,
        score_tensors,
        grads,
        capture_mode: int,
        cfg: BwdConfig | None = None,
        dq_acc: torch.Tensor | None = None,
    ) -> list[KernelLaunch]:
        """The backward launches. With `dq_acc` (float32, zeroed) dQ is fused into the dK/dV kernel
        with atomics and the dQ launch is left out; the caller converts dq_acc to dq."""
        spec = self.spec
        fused = dq_acc is not None
        acc = dq_acc if fused else dq  # never written unless fused
        bm = spec.block_mask
        cfg = cfg or self.configs.bwd
        B, Hq, Hkv, Lq, Lkv = spec.batch, spec.heads_q, spec.heads_kv, spec.len_q, spec.len_kv
        pre_block = 64
        pre_constexprs = dict(
            HEAD_DIM_V=spec.head_dim_v,
            HEAD_DIM_V_PAD=self.head_dim_v_pad,
            BLOCK_M=pre_block,
            HAS_DLSE=dlse is not None,
        )
        pre_args = [
            out, dout, dlse if dlse is not None else lse, delta,
            *out.stride(), *dout.stride(), lse.stride(0), lse.stride(1),
            *(dlse if dlse is not None else lse).stride(), Lq, Hq,
        ]  # fmt: skip
        mod_args = self._mod_args(score_tensors)
        dkdv_constexprs = dict(
            self._shape_constexprs(),
            BLOCK_M=cfg.block_m1,
            BLOCK_N=cfg.block_n1,
            EVEN_M=Lq % bm.block_size.q == 0,
            EVEN_N=Lkv % cfg.block_n1 == 0,
            HAS_PARTIAL=self.flags.has_q_partial,
            HAS_FULL=self.flags.has_q_full,
            FUSED_DQ=fused,
            # The deterministic mode's first pass (2) runs here, where every pair is visited anyway.
            CAPTURE_MODE=capture_mode if fused or capture_mode == 2 else 0,
        )
        dkdv_args = [
            q, k, v, dout, dk, dv, lse, delta, acc,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
            *acc.stride(), lse.stride(0), lse.stride(1),
            *_ListArgs(bm.q_partial, bm.q_full).args(),
            Lq, Lkv, Hq, spec.group_size, B // spec.batch_kv, spec.scale,
            *mod_args, *grads,
        ]  # fmt: skip
        dq_constexprs = dict(
            self._kv_side_constexprs(cfg.block_m2, cfg.block_n2), CAPTURE_MODE=capture_mode
        )
        # Every captured tensor needing a gradient has a buffer (the kernel's signature has one
        # pointer per such capture); CAPTURE_MODE=0 compiles the scatter out.
        dq_args = [
            q, k, v, dout, dq, lse, delta,
            *q.stride(), *spec.kv_strides(k), *spec.kv_strides(v), *dout.stride(),
            *dq.stride(), lse.stride(0), lse.stride(1),
            *_ListArgs(bm.kv_partial, bm.kv_full).args(),
            Lq, Lkv, Hq, spec.group_size, spec.scale,
            *mod_args, *grads,
        ]  # fmt: skip
        m = self.module
        launches = [
            self._make(
                "bwd_preprocess", m.flexfa_bwd_preprocess, (triton_cdiv(Lq, pre_block), B * Hq),
                pre_args, pre_constexprs, cfg, "backward preprocess",
                # a 16-bit or float32 output (Note [Unrounded output for delta])
                key_extra={"out_dtype": str(out.dtype).removeprefix("torch.")},
            ),
            self._make(
                "bwd_dkdv", m.flexfa_bwd_dkdv,
                (triton_cdiv(Lkv, cfg.block_n1), spec.batch_kv * Hkv),
                dkdv_args, dkdv_constexprs, cfg, "backward dK/dV" + (" + dQ" if fused else ""),
            ),
        ]  # fmt: skip
        if not fused:
            launches.append(
                self._make(
                    "bwd_dq", m.flexfa_bwd_dq, (triton_cdiv(Lq, cfg.block_m2), B * Hq),
                    dq_args, dq_constexprs, cfg.dq, "backward dQ",
                )
            )  # fmt: skip
        return launches

    def forward(self, q, k, v, score_tensors):
        """(out, lse); also sets `max_scores` when the spec asks for it and `saved_out`, the
        output the backward reads (float32 where `saves_unrounded_output`, else `out`)."""
        spec = self.spec
        shape = (spec.batch, spec.heads_q, spec.len_q, spec.head_dim_v)
        out = empty_like_query(q, shape)  # Note [Output layout]
        out_f32 = empty_like_query(q, shape, torch.float32) if self.saves_unrounded_output else None
        lse = torch.empty(
            spec.batch, spec.heads_q, spec.len_q, dtype=torch.float32, device=q.device
        )
        if self.tune:
            self._tune_forward(q, k, v, out, lse, score_tensors, out_f32)
        elif spec.needs_grad and id(self.plan) not in _prewarmed and concurrent_enabled():
            _prewarmed.add(id(self.plan))
            self._prewarm_backward(q, k, v, out if out_f32 is None else out_f32, lse, score_tensors)
        max_scores = torch.empty_like(lse) if spec.max_scores else None
        launch(
            self.forward_launch(
                q, k, v, out, lse, score_tensors, max_scores=max_scores, out_f32=out_f32
            )
        )
        self.max_scores = max_scores
        self.saved_out = out if out_f32 is None else out_f32
        return out, lse

    def _prewarm_backward(self, q, k, v, out, lse, score_tensors) -> None:
        """Start compiling the backward's kernels now, with stand-ins for the tensors it will
        have (Note [Concurrent compiles])."""
        dev = q.device
        slots = sorted(self.grad_slots)
        fused = self.fused_dq and not self.spec.deterministic
        dq_acc = torch.empty(q.shape, dtype=torch.float32, device=dev) if fused else None
        grads = [
            torch.empty(score_tensors[s].shape, dtype=torch.float32, device=dev) for s in slots
        ]
        grads += [torch.empty(0, device=dev)] if slots else []
        launches = self.backward_launches(
            q, k, v, out, lse, torch.empty_like(out, dtype=q.dtype), None, torch.empty_like(lse),
            torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), score_tensors, grads,
            1 if slots else 0, dq_acc=dq_acc,
        )  # fmt: skip
        prewarm(launches)

    def _candidates(self, which: str) -> list:
        spec = self.spec
        source = autotune.fwd_candidates if which == "fwd" else autotune.bwd_candidates
        cands = source(self.capability, spec.head_dim, spec.dtype)
        return autotune.unique([autotune.fit(c, spec.block_mask.block_size) for c in cands])

    def _tune_forward(self, q, k, v, out, lse, score_tensors, out_f32=None) -> None:
        def run(c: FwdConfig) -> None:
            launch(self.forward_launch(q, k, v, out, lse, score_tensors, c, out_f32=out_f32))

        best = autotune.pick(self._candidates("fwd"), run, "forward")
        if best is not None:
            self.configs = dataclasses.replace(self.configs, fwd=best)
        if not self.spec.needs_grad:  # no backward follows: store what was tuned now
            cfgs.store_tuned(self.tuning_key, self.configs)
            self.tune = False

    def _tune_backward(self, common: tuple, grad_buffers: list) -> None:
        scratch = [torch.zeros_like(b) for b in grad_buffers]
        dq_acc = (
            torch.zeros(common[0].shape, dtype=torch.float32, device=common[0].device)
            if self.fused_dq
            else None
        )

        def run(c: BwdConfig) -> None:
            for kl in self.backward_launches(
                *common, scratch, 1 if scratch else 0, c, dq_acc=dq_acc
            ):
                launch(kl)

        best = autotune.pick(self._candidates("bwd"), run, "backward")
        if best is not None:
            self.configs = dataclasses.replace(self.configs, bwd=best)
        cfgs.store_tuned(self.tuning_key, self.configs)
        self.tune = False

    def backward(self, q, k, v, out, lse, dout, dlse, score_tensors, grad_slots):
        spec = self.spec
        # Note [Upstream gradient layouts]
        # autograd hands dO and dLSE over in whatever layout the rest of the graph made: expanded
        # (stride 0, from `out.sum()` or `lse.sum()`), a strided slice (`torch.cat` of LSEs), permuted
        # (`lse.transpose(0, 2)`), at a storage offset. dO is read in the inner loops of both backward
        # kernels, so it must have a unit last stride for vectorized loads; any other dO is copied
        # once (one pass over B*H*L*Ev elements, small beside the kernels). dLSE is read once, by the
        # preprocess kernel, so it is read through its own three strides, never copied.
        dout = dout.contiguous() if dout.stride(-1) != 1 else dout
        delta = torch.empty_like(lse)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        slots = sorted(self.grad_slots)
        shapes = [score_tensors[s].shape for s in slots]
        dev = q.device
        deterministic = spec.deterministic
        fused = self.fused_dq and not deterministic
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=dev) if fused else None
        common = (q, k, v, out, lse, dout, dlse, delta, dq, dk, dv, score_tensors)

        def run(grad_buffers: list, mode: int, only_dq: bool = False, no_dq: bool = False) -> None:
            launches = self.backward_launches(*common, grad_buffers, mode, dq_acc=dq_acc)
            launches = launches[-1:] if only_dq else launches[:-1] if no_dq else launches
            warm_up(launches)  # a cold backward compiles its kernels concurrently
            for kl in launches:
                launch(kl)

        if self.tune:
            buffers = [torch.zeros(shape, dtype=torch.float32, device=dev) for shape in shapes]
            self._tune_backward(
                common, [*buffers, torch.zeros(len(slots), device=dev)] if slots else []
            )
        placeholder = torch.empty(0, device=dev)
        if not grad_slots:
            run([placeholder for _ in slots] + ([placeholder] if slots else []), 0)
            grads: dict[int, torch.Tensor] = {}
        elif not deterministic:
            bufs = [torch.zeros(shape, dtype=torch.float32, device=dev) for shape in shapes]
            run([*bufs, placeholder], 1)
            grads = dict(zip(slots, bufs))
        else:
            # The dK/dV kernel also finds max |contribution| per capture, then the dQ kernel
            # accumulates in fixed point (Note [Deterministic captured gradients] in emit.py): the
            # same kernels as the default mode, each run once.
            ints = [torch.zeros(shape, dtype=torch.int64, device=dev) for shape in shapes]
            scales = torch.zeros(len(slots), dtype=torch.float32, device=dev)
            run([*ints, scales], 2, no_dq=True)
            pairs = spec.batch * spec.heads_q * spec.len_q * spec.len_kv
            exponent = torch.floor(62.0 - torch.log2(scales.clamp_min(1e-30)) - math.log2(pairs))
            scales.copy_(torch.where(scales > 0, torch.exp2(exponent.clamp(-126.0, 126.0)), 1.0))
            run([*ints, scales], 3, only_dq=True)
            grads = {
                s: i.to(torch.float64) / scales[j].to(torch.float64)
                for j, (s, i) in enumerate(zip(slots, ints))
            }
        if dq_acc is not None:
            dq = dq_acc.to(q.dtype)
        return dq, dk, dv, grads


_prewarmed: set[int] = set()  # ids of plans whose backward compiles a forward has started


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _TritonFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, launcher: Launcher, q, k, v, *score_tensors):
        out, lse = launcher.forward(q, k, v, score_tensors)
        # An unused output's gradient comes as None, not a tensor of zeros: no LSE gradient to
        # read then, and the backward's kernels are the ones the forward started compiling
        # (Note [Concurrent compiles]).
        ctx.set_materialize_grads(False)
        ctx.launcher = launcher
        ctx.save_for_backward(q, k, v, launcher.saved_out, lse, *score_tensors)
        max_scores = launcher.max_scores if launcher.max_scores is not None else lse.new_empty(0)
        ctx.mark_non_differentiable(max_scores)
        return out, lse, max_scores

    @staticmethod
    def backward(ctx, dout, dlse, dmax=None):
        q, k, v, out, lse, *score_tensors = ctx.saved_tensors  # `out` may be float32
        launcher: Launcher = ctx.launcher
        grad_slots = frozenset(s for s in launcher.grad_slots if ctx.needs_input_grad[4 + s])
        if dout is None:
            dout = torch.zeros_like(out, dtype=q.dtype)
        dq, dk, dv, grads = launcher.backward(
            q, k, v, out, lse, dout, dlse, tuple(score_tensors), grad_slots
        )
        capture_grads = [
            grads[i].to(t.dtype) if i in grad_slots and i in grads else None
            for i, t in enumerate(score_tensors)
        ]
        return None, dq, dk, dv, *capture_grads


_options_checked: dict[tuple, str | None] = {}


def options_problem(spec: AttentionSpec) -> str | None:
    """Why kernel_options cannot apply to this call, or None; remembered per distinct options
    (decode steps call this every few microseconds of GPU time)."""
    try:
        key = (spec.head_dim, spec.dtype, tuple(sorted(spec.kernel_options.items())))
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _options_checked:
        return _options_checked[key]
    try:
        cfgs.apply_options(
            cfgs.default_configs(None, spec.head_dim, spec.dtype), spec.kernel_options
        )
        problem = None
    except (ValueError, TypeError) as e:
        problem = str(e)
    if key is not None:
        _options_checked[key] = problem
    return problem


def run(spec: AttentionSpec, q, k, v):
    """A call on the Triton kernels: the decode kernels where they apply (decode.py), else the
    attention kernels, under autograd when the call needs gradients."""
    if decode.applies(spec):
        return decode.run(spec, q, k, v)
    launcher = Launcher(spec)
    score_tensors = tuple(
        t.contiguous() for t in (spec.score_mod.tensors if spec.score_mod is not None else ())
    )
    if spec.needs_grad:
        out, lse, max_scores = _TritonFunction.apply(launcher, q, k, v, *score_tensors)
        return (out, lse, max_scores) if spec.max_scores else (out, lse)
    with torch.no_grad():
        out, lse = launcher.forward(q, k, v, score_tensors)
        return (out, lse, launcher.max_scores) if spec.max_scores else (out, lse)
