"""The "triton" backend: generated fused forward and backward kernels.

`TritonBackend.run` builds a `Launcher` (module + configs + launch arguments) and runs it through
an autograd Function. Kernels come from `module.load_module` (rendered from the templates, cached);
see templates/*.jinja for the kernels themselves.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import types
import weakref

import torch

from flexfa.backends.base import Backend, Support, register
from flexfa.blockmask.block_mask import BlockList, BlockMask
from flexfa.codegen.triton import configs as cfgs
from flexfa.codegen.triton.module import load_module
from flexfa.codegen.triton.params import KernelKey, ModuleKey
from flexfa.config import config
from flexfa.frontend.trace import TracedMod
from flexfa.spec import AttentionSpec

log = logging.getLogger("flexfa")

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
_COMPILE_LOG_SECONDS = 1.0


def _next_pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class _ListArgs:
    """Block-list tensors and strides as the kernels read them (broadcast dims get stride 0)."""

    partial: BlockList
    full: BlockList

    def args(self) -> list:
        c, i = self.partial.count, self.partial.index
        assert self.full.count.stride() == c.stride() and self.full.index.stride() == i.stride()

        def bs(t: torch.Tensor, dim: int) -> int:
            return 0 if t.shape[dim] == 1 else t.stride(dim)

        return [
            self.partial.count,
            self.partial.index,
            self.full.count,
            self.full.index,
            bs(c, 0),
            bs(c, 1),
            c.stride(2),
            bs(i, 0),
            bs(i, 1),
            i.stride(2),
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
        counts = torch.stack(
            [bl.count.amax() for bl in (bm.kv_partial, bm.kv_full, bm.q_partial, bm.q_full)]
        ).tolist()
        flags = _ListFlags(*(bool(c > 0) for c in counts))
        _flags_cache[bm] = flags
    return flags


_launched: set[str] = set()


def _launch(kernel, grid, key: KernelKey, label: str, *args, **constexprs) -> None:
    """Launch, logging the first launch of each specialization if it takes long (a compile)."""
    first = key.digest not in _launched
    if not first:
        kernel[grid](*args, **constexprs)
        return
    start = time.perf_counter()
    kernel[grid](*args, **constexprs)
    if torch.cuda.is_available() and not config.triton_interpret:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    _launched.add(key.digest)
    level = (
        logging.INFO if (elapsed > _COMPILE_LOG_SECONDS or config.log_compiles) else logging.DEBUG
    )
    log.log(
        level, "flexfa: %s kernel ready in %.2f s (compile or load on first use)", label, elapsed
    )


def _capture_args(traced: TracedMod | None, tensors: tuple[torch.Tensor, ...]) -> list:
    if traced is None:
        return []
    args: list = []
    for t in tensors:
        args.append(t)
        args.extend(t.stride())
        args.extend(t.shape)
    return args


class Launcher:
    """One call's kernels, configs and launch arguments (shared by forward and backward)."""

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec
        self.mask = None if spec.mask.is_trivially_true else spec.mask
        self.grad_slots = spec.score_grad_slots
        self.key, self.module = load_module(spec.score_mod, self.mask, self.grad_slots)
        self.configs = _resolve_configs(spec)
        self.flags = _list_flags(spec.block_mask)
        if spec.dtype == torch.float32:
            self.precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
        else:
            self.precision = "ieee"
        self.head_dim_pad = _next_pow2(spec.head_dim)
        self.head_dim_v_pad = _next_pow2(spec.head_dim_v)

    def _kernel_key(self, kernel: str, cfg, **constexprs) -> KernelKey:
        spec = self.spec
        return KernelKey(
            module=self.key,
            kernel=kernel,
            dtype=str(spec.dtype).removeprefix("torch."),
            head_dim=spec.head_dim,
            head_dim_v=spec.head_dim_v,
            config=cfg,
            constexprs=tuple(sorted(constexprs.items())),
        )

    def _label(self, kernel: str) -> str:
        spec = self.spec
        sm = spec.score_mod.name if spec.score_mod else "none"
        mm = self.mask.name if self.mask else "none"
        return f"{kernel} (score_mod={sm}, mask_mod={mm}, {spec.dtype}, D={spec.head_dim})"

    def _mod_args(self, score_tensors: tuple[torch.Tensor, ...]) -> list:
        mask_tensors = self.mask.tensors if self.mask is not None else ()
        return _capture_args(self.spec.score_mod, score_tensors) + _capture_args(
            self.mask, mask_tensors
        )

    def forward(self, q, k, v, score_tensors):
        spec = self.spec
        bm = spec.block_mask
        cfg = self.configs.fwd
        B, Hq, Lq, Lkv = spec.batch, spec.heads_q, spec.len_q, spec.len_kv
        out = torch.empty(B, Hq, Lq, spec.head_dim_v, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
        constexprs = dict(
            HEAD_DIM=spec.head_dim,
            HEAD_DIM_V=spec.head_dim_v,
            HEAD_DIM_PAD=self.head_dim_pad,
            HEAD_DIM_V_PAD=self.head_dim_v_pad,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            SPARSE_Q=bm.block_size.q,
            SPARSE_KV=bm.block_size.kv,
            EVEN_M=Lq % cfg.block_m == 0,
            EVEN_N=Lkv % cfg.block_n == 0,
            HAS_PARTIAL=self.flags.has_kv_partial,
            HAS_FULL=self.flags.has_kv_full,
            INPUT_PRECISION=self.precision,
        )
        key = self._kernel_key("fwd", cfg, **constexprs)
        grid = (triton_cdiv(Lq, cfg.block_m), B * Hq)
        _launch(
            self.module.flexfa_fwd,
            grid,
            key,
            self._label("forward"),
            q,
            k,
            v,
            out,
            lse,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *out.stride(),
            lse.stride(0),
            lse.stride(1),
            *_ListArgs(bm.kv_partial, bm.kv_full).args(),
            Lq,
            Lkv,
            Hq,
            spec.group_size,
            spec.scale,
            *self._mod_args(score_tensors),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **constexprs,
        )
        return out, lse

    def backward(self, q, k, v, out, lse, dout, dlse, score_tensors, grad_slots):
        spec = self.spec
        bm = spec.block_mask
        cfg = self.configs.bwd
        B, Hq, Hkv, Lq, Lkv = spec.batch, spec.heads_q, spec.heads_kv, spec.len_q, spec.len_kv
        dout = dout.contiguous() if dout.stride(-1) != 1 else dout
        delta = torch.empty_like(lse)
        pre_block = 64
        pre_constexprs = dict(
            HEAD_DIM_V=spec.head_dim_v,
            HEAD_DIM_V_PAD=self.head_dim_v_pad,
            BLOCK_M=pre_block,
            HAS_DLSE=dlse is not None,
        )
        _launch(
            self.module.flexfa_bwd_preprocess,
            (triton_cdiv(Lq, pre_block), B * Hq),
            self._kernel_key("bwd_preprocess", cfg, **pre_constexprs),
            self._label("backward preprocess"),
            out,
            dout,
            dlse if dlse is not None else lse,
            delta,
            *out.stride(),
            *dout.stride(),
            lse.stride(0),
            lse.stride(1),
            Lq,
            Hq,
            **pre_constexprs,
        )
        dq = torch.empty_like(q)
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        mod_args = self._mod_args(score_tensors)
        common = dict(
            HEAD_DIM=spec.head_dim,
            HEAD_DIM_V=spec.head_dim_v,
            HEAD_DIM_PAD=self.head_dim_pad,
            HEAD_DIM_V_PAD=self.head_dim_v_pad,
            SPARSE_Q=bm.block_size.q,
            SPARSE_KV=bm.block_size.kv,
            INPUT_PRECISION=self.precision,
        )
        dkdv_constexprs = dict(
            common,
            BLOCK_M=cfg.block_m1,
            BLOCK_N=cfg.block_n1,
            EVEN_M=Lq % cfg.block_m1 == 0,
            EVEN_N=Lkv % cfg.block_n1 == 0,
            HAS_PARTIAL=self.flags.has_q_partial,
            HAS_FULL=self.flags.has_q_full,
        )
        _launch(
            self.module.flexfa_bwd_dkdv,
            (triton_cdiv(Lkv, cfg.block_n1), B * Hkv),
            self._kernel_key("bwd_dkdv", cfg, **dkdv_constexprs),
            self._label("backward dK/dV"),
            q,
            k,
            v,
            dout,
            dk,
            dv,
            lse,
            delta,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *dout.stride(),
            *dk.stride(),
            *dv.stride(),
            lse.stride(0),
            lse.stride(1),
            *_ListArgs(bm.q_partial, bm.q_full).args(),
            Lq,
            Lkv,
            Hq,
            spec.group_size,
            spec.scale,
            *mod_args,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **dkdv_constexprs,
        )
        grads = {
            slot: torch.zeros(score_tensors[slot].shape, dtype=torch.float32, device=q.device)
            for slot in sorted(self.grad_slots)
        }
        dq_constexprs = dict(
            common,
            BLOCK_M=cfg.block_m2,
            BLOCK_N=cfg.block_n2,
            EVEN_M=Lq % cfg.block_m2 == 0,
            EVEN_N=Lkv % cfg.block_n2 == 0,
            HAS_PARTIAL=self.flags.has_kv_partial,
            HAS_FULL=self.flags.has_kv_full,
            CAPTURE_GRADS=bool(grad_slots),
        )
        # Every captured tensor needing a gradient gets a buffer (the kernel's signature has one
        # pointer per such capture); CAPTURE_GRADS=False skips the scatter entirely.
        _launch(
            self.module.flexfa_bwd_dq,
            (triton_cdiv(Lq, cfg.block_m2), B * Hq),
            self._kernel_key("bwd_dq", cfg, **dq_constexprs),
            self._label("backward dQ"),
            q,
            k,
            v,
            dout,
            dq,
            lse,
            delta,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *dout.stride(),
            *dq.stride(),
            lse.stride(0),
            lse.stride(1),
            *_ListArgs(bm.kv_partial, bm.kv_full).args(),
            Lq,
            Lkv,
            Hq,
            spec.group_size,
            spec.scale,
            *mod_args,
            *grads.values(),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **dq_constexprs,
        )
        return dq, dk, dv, grads


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _resolve_configs(spec: AttentionSpec) -> cfgs.KernelConfigs:
    base = cfgs.default_configs(spec.device, spec.head_dim, spec.dtype)
    chosen = cfgs.apply_options(base, spec.kernel_options)
    fitted = cfgs.fit_to_block_mask(chosen, spec.block_mask.block_size)
    if fitted is None:  # supports() has checked this; keep the invariant explicit
        raise ValueError("kernel tile sizes cannot fit the BlockMask's block size")
    return fitted


class _TritonFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, launcher: Launcher, q, k, v, *score_tensors):
        out, lse = launcher.forward(q, k, v, score_tensors)
        ctx.launcher = launcher
        ctx.save_for_backward(q, k, v, out, lse, *score_tensors)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *score_tensors = ctx.saved_tensors
        launcher: Launcher = ctx.launcher
        grad_slots = frozenset(s for s in launcher.grad_slots if ctx.needs_input_grad[4 + s])
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, grads = launcher.backward(
            q, k, v, out, lse, dout, dlse, tuple(score_tensors), grad_slots
        )
        capture_grads = [
            grads[i].to(t.dtype) if i in grad_slots else None for i, t in enumerate(score_tensors)
        ]
        return None, dq, dk, dv, *capture_grads


class TritonBackend(Backend):
    """Generated Triton kernels (CUDA; on CPU only under TRITON_INTERPRET=1)."""

    name = "triton"
    auto_device_types = frozenset({"cuda"})

    def supports(self, spec: AttentionSpec) -> Support:
        if spec.device.type != "cuda" and not (
            spec.device.type == "cpu" and config.triton_interpret
        ):
            return Support.no(
                f"inputs are on {spec.device.type}; Triton kernels run on CUDA GPUs "
                "(or on the CPU under TRITON_INTERPRET=1, for testing)"
            )
        if spec.dtype not in _SUPPORTED_DTYPES:
            return Support.no(
                f"dtype {spec.dtype} is not supported (float16, bfloat16, float32 are)"
            )
        if max(spec.head_dim, spec.head_dim_v) > MAX_HEAD_DIM:
            return Support.no(f"head dims above {MAX_HEAD_DIM} are not supported")
        reason = cfgs.supports_block_size(spec.block_mask.block_size)
        if reason:
            return Support.no(reason)
        if spec.deterministic and spec.score_grad_slots:
            return Support.no(
                "deterministic=True with gradients for captured tensors is not available in Triton"
            )
        try:
            cfgs.apply_options(
                cfgs.default_configs(spec.device, spec.head_dim, spec.dtype), spec.kernel_options
            )
        except (ValueError, TypeError) as e:
            return Support.no(str(e))
        return Support.yes()

    def run(self, spec, q, k, v):
        launcher = Launcher(spec)
        score_tensors = tuple(
            t.contiguous() for t in (spec.score_mod.tensors if spec.score_mod is not None else ())
        )
        if spec.needs_grad:
            return _TritonFunction.apply(launcher, q, k, v, *score_tensors)
        with torch.no_grad():
            return launcher.forward(q, k, v, score_tensors)


def module_for(
    score: TracedMod | None, mask: TracedMod | None, grad_slots: frozenset[int] = frozenset()
) -> tuple[ModuleKey, types.ModuleType]:
    """The generated module (for export and tests)."""
    return load_module(score, mask, grad_slots)


register(TritonBackend())
