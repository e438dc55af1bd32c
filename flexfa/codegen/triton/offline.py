"""Compile generated kernels for a GPU architecture without a GPU.

Triton's compiler runs on any machine; only launching needs a device. `compile_launch` takes a
`KernelLaunch` (what the backend would launch) and compiles the same kernel and specialization for,
say, sm_90, returning Triton's compiled kernel with its `asm` dict (ttir, ttgir, llir, ptx, cubin).
Tests use it to catch compile errors in CI, where there is no GPU, and
`python -m flexfa export --ptx` uses it to write PTX next to the source. `compile_spec` compiles
every kernel of a call's spec; `flexfa.export.compile_call` builds that spec from q, k, v and the
mods as `flexfa.attention` does:

>>> import torch, flexfa
>>> from flexfa.export import compile_call  # doctest: +SKIP
>>> kernels = compile_call(q, k, v, score_mod=flexfa.mods.alibi, arch=90)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from flexfa.runtime.launch import KernelLaunch
from flexfa.spec import AttentionSpec

log = logging.getLogger("flexfa")

_DTYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


def _type_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type a kernel argument of type {type(value).__name__}")


def signature(kl: KernelLaunch) -> dict[str, str]:
    """Triton's signature for the launch: argument name -> type (constexprs marked as such)."""
    names = kl.arg_names()
    if len(names) != len(kl.args):
        raise ValueError(f"{kl.name}: {len(kl.args)} arguments for {len(names)} parameters")
    sig = {n: _type_of(a) for n, a in zip(names, kl.args)}
    for n in kl.constexprs:
        sig[n] = "constexpr"
    return {n: sig[n] for n in kl.kernel.arg_names}


# Note [Offline compiles specialize as launches do]
# At a launch, Triton specializes a kernel on its arguments' values: a pointer whose address is a
# multiple of 16 and an integer divisible by 16 are marked so (`tt.divisibility`), and an integer
# equal to 1 becomes a constant. Those marks decide whether loads are vectorized and pipelined
# (cp.async on sm_80+); without them the attention and decode kernels compile to one scalar load
# per element, another kernel from the one that runs. So `compile_launch` asks Triton's own launch
# binder (the code `JITFunction.run` calls, built for the target without a GPU) for the launch's
# signature, constants and attributes, and compiles those: exported PTX and the analyses in
# bench/ read the kernel a launch with these arguments runs. Should a Triton version lack that
# binder, the launch compiles unspecialized, and a warning says its PTX is not the launched one.
def _specialized_source(kl: KernelLaunch, target: Any) -> tuple[Any, dict[str, Any]]:
    """Triton's ASTSource and compile options for the launch, specialized as a launch would be."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = kl.kernel
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {**kl.constexprs, "num_warps": kl.num_warps, "num_stages": kl.num_stages}
    kwargs["debug"] = False
    bound, specialization, options = binder(*kl.args, **kwargs)
    options, sig, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return ASTSource(fn, sig, constexprs, attrs), options.__dict__


def compile_launch(kl: KernelLaunch, arch: int = 90):
    """Compile one launch's kernel for `sm_<arch>` (CUDA), specialized on the launch's arguments
    as Triton specializes a launch (Note [Offline compiles specialize as launches do]); returns
    Triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    try:
        src, options = _specialized_source(kl, target)
    except (ImportError, AttributeError, TypeError) as e:  # another Triton's internals
        log.warning(
            "flexfa: compiling %s without Triton's launch specialization (%s); its PTX is not "
            "exactly the launched kernel's",
            kl.name,
            e,
        )
        fn = kl.kernel
        constexprs = {(fn.arg_names.index(n),): v for n, v in kl.constexprs.items()}
        src = ASTSource(fn=fn, signature=signature(kl), constexprs=constexprs)
        options = {"num_warps": kl.num_warps, "num_stages": kl.num_stages}
    return triton.compile(src, target=target, options=options)


def meta_device_launches(
    spec, *, capability: tuple[int, int] | None = None, with_backward: bool = True
) -> list[KernelLaunch]:
    """The launches a call would make, built on tensors of the spec's shapes (for offline compiles).

    The tensors are real but tiny-cost placeholders on the CPU: only their dtypes matter to the
    compiler, and nothing is launched.
    """
    from flexfa.codegen.triton.backend import Launcher

    launcher = Launcher(spec, capability=capability, force_compiled=True)
    B, Hq, Hkv = spec.batch, spec.heads_q, spec.heads_kv
    Lq, Lkv, E, Ev = spec.len_q, spec.len_kv, spec.head_dim, spec.head_dim_v
    dt = spec.dtype
    q = torch.empty(B, Hq, Lq, E, dtype=dt)
    k = torch.empty(spec.batch_kv, Hkv, Lkv, E, dtype=spec.k_dtype)
    v = torch.empty(spec.batch_kv, Hkv, Lkv, Ev, dtype=spec.v_dtype)
    out = torch.empty(B, Hq, Lq, Ev, dtype=dt)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32)
    score_tensors = tuple(spec.score_mod.tensors) if spec.score_mod is not None else ()
    saved = torch.empty(B, Hq, Lq, Ev) if launcher.saves_unrounded_output else None
    launches = [launcher.forward_launch(q, k, v, out, lse, score_tensors, out_f32=saved)]
    saved = out if saved is None else saved
    if with_backward:
        grads = [torch.empty(score_tensors[s].shape) for s in sorted(launcher.grad_slots)]
        if grads:
            grads.append(torch.empty(len(grads)))  # the capture-scales buffer
        launches += launcher.backward_launches(
            q, k, v, saved, lse, out, None, torch.empty_like(lse), q, k, v, score_tensors, grads,
            1 if grads else 0,
        )  # fmt: skip
    return launches


def compile_spec(spec: AttentionSpec, *, arch: int = 90, with_backward: bool = True) -> dict:
    """Compile every kernel a call described by `spec` would launch, for `sm_<arch>`.

    Returns {launch name: CompiledKernel}; nothing runs. `flexfa.export.compile_call` builds the
    spec from q, k, v and the mods as `flexfa.attention` would.
    """
    launches = meta_device_launches(
        spec, capability=(arch // 10, arch % 10), with_backward=with_backward
    )
    return {kl.name: compile_launch(kl, arch) for kl in launches}
