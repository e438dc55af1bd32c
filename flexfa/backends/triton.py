"""The "triton" backend: flexfa's generated Triton kernels (flexfa/codegen/triton), on CUDA GPUs.

Which calls it takes is decided here; the kernels, their plans and launches are the generator's
(`flexfa.codegen.triton.backend.run`).
"""

from __future__ import annotations

import torch

from flexfa.backends.base import Backend, Support, register
from flexfa.codegen.triton import backend as kernels
from flexfa.codegen.triton import configs as cfgs
from flexfa.config import config
from flexfa.spec import AttentionSpec


def _score_tensors(spec: AttentionSpec) -> tuple[torch.Tensor, ...]:
    return tuple(
        t.contiguous() for t in (spec.score_mod.tensors if spec.score_mod is not None else ())
    )


class TritonBackend(Backend):
    """Generated Triton kernels (CUDA; on CPU only under TRITON_INTERPRET=1)."""

    name = "triton"
    auto_device_types = frozenset({"cuda"})
    supports_paged = True  # through the decode kernels (flexfa/codegen/triton/decode.py)

    def supports(self, spec: AttentionSpec) -> Support:
        if spec.device.type != "cuda" and not (
            spec.device.type == "cpu" and config.triton_interpret
        ):
            return Support.no(
                f"inputs are on {spec.device.type}; Triton kernels run on CUDA GPUs "
                "(or on the CPU under TRITON_INTERPRET=1, for testing)"
            )
        if spec.dtype not in kernels.SUPPORTED_DTYPES:
            return Support.no(
                f"dtype {spec.dtype} is not supported (float16, bfloat16, float32 are)"
            )
        if spec.dtype == torch.bfloat16 and spec.device.type == "cpu":
            # Seen with Triton 3.9: its interpreter multiplies bfloat16 tiles incorrectly in tl.dot.
            return Support.no("Triton's interpreter computes bfloat16 dot products incorrectly")
        if max(spec.head_dim, spec.head_dim_v) > kernels.MAX_HEAD_DIM:
            return Support.no(f"head dims above {kernels.MAX_HEAD_DIM} are not supported")
        reason = cfgs.supports_block_size(spec.block_mask.block_size)
        if reason:
            return Support.no(reason)
        reason = kernels.options_problem(spec)
        if reason:
            return Support.no(reason)
        if spec.paged is not None and spec.max_scores:
            return Support.no("the decode kernels that read paged caches write no max_scores")
        return Support.yes()

    def forward(self, spec, q, k, v):
        launcher = kernels.Launcher(spec)
        out, lse = launcher.forward(q, k, v, _score_tensors(spec))
        return out, lse, launcher.saved_out, launcher.max_scores

    def backward(self, spec, q, k, v, saved, lse, dout, dlse, grad_slots):
        launcher = kernels.Launcher(spec)
        dq, dk, dv, grads = launcher.backward(
            q, k, v, saved, lse, dout, dlse, _score_tensors(spec), grad_slots
        )
        tensors = spec.score_mod.tensors if spec.score_mod is not None else ()
        return dq, dk, dv, {i: g.to(tensors[i].dtype) for i, g in grads.items()}

    def run(self, spec, q, k, v):
        return kernels.run(spec, q, k, v)


register(TritonBackend())
