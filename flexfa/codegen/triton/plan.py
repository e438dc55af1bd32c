"""What a call's kernels depend on beyond its tensors: the generated module, the kernel configs
and the options, resolved once per distinct configuration and cached (see `_Plan`)."""

from __future__ import annotations

import dataclasses
import types

import torch

from flexfa.codegen.triton import autotune, emit, scatter
from flexfa.codegen.triton import configs as cfgs
from flexfa.codegen.triton.module import load_module
from flexfa.codegen.triton.params import ModuleKey
from flexfa.config import config
from flexfa.spec import AttentionSpec


def _next_pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


@dataclasses.dataclass
class Plan:
    """What a call's kernels depend on beyond its tensors: the module, configs and options.

    Built once per distinct (mods, dtypes, head dims, block size, length bucket, options, device)
    and reused, so a call pays a dictionary lookup instead of key hashing, config resolution and a
    tuning-file read. Mutable only through autotuning, which replaces `configs`.
    """

    key: ModuleKey
    module: types.ModuleType
    capability: tuple[int, int] | None
    tuning_key: str | None
    configs: cfgs.KernelConfigs
    tune: bool
    fused_dq: bool
    precision: str
    head_dim_pad: int
    head_dim_v_pad: int


plans: dict[tuple, Plan] = {}


def plan_key(spec: AttentionSpec, mask, capability, force_compiled: bool) -> tuple | None:
    try:
        options = tuple(sorted(spec.kernel_options.items()))
        hash(options)
    except TypeError:
        return None  # unhashable option values: build the plan every call
    bs = spec.block_mask.block_size
    return (
        spec.score_mod.key if spec.score_mod is not None else None,
        mask.key if mask is not None else None,
        spec.score_grad_slots,
        force_compiled,
        capability,
        str(spec.device),
        spec.dtype,
        spec.k_dtype,
        spec.v_dtype,
        spec.head_dim,
        spec.head_dim_v,
        spec.group_size,
        bs.q,
        bs.kv,
        autotune.bucket(spec.len_q),
        autotune.bucket(spec.len_kv),
        options,
        torch.backends.cuda.matmul.allow_tf32,
        config.autotune,
        config.cache_dir_token(),
    )


def make_plan(
    spec: AttentionSpec, mask, capability, force_compiled: bool, has_partial: bool
) -> Plan:
    key, module = load_module(
        spec.score_mod, mask, spec.score_grad_slots, force_compiled=force_compiled
    )
    tuning_key = (
        autotune.tuning_key(key.digest, spec.device, spec) if spec.device.type == "cuda" else None
    )
    tuned = cfgs.load_tuned(tuning_key) if tuning_key else None
    mode = spec.kernel_options.get("bwd_dq", "separate")
    if mode not in ("separate", "fused"):
        raise ValueError(f"kernel_options['bwd_dq'] must be 'separate' or 'fused', got {mode!r}")
    pinned = set(spec.kernel_options) & (set(cfgs.FWD_OPTIONS) | set(cfgs.BWD_OPTIONS))
    wants = spec.kernel_options.get("autotune", config.autotune)
    if spec.dtype == torch.float32:
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    else:
        precision = "ieee"
    return Plan(
        key=key,
        module=module,
        capability=capability,
        tuning_key=tuning_key,
        configs=resolve_configs(spec, capability, tuned, has_partial),
        tune=bool(wants) and tuned is None and not pinned and tuning_key is not None,
        fused_dq=mode == "fused",
        precision=precision,
        head_dim_pad=_next_pow2(spec.head_dim),
        head_dim_v_pad=_next_pow2(spec.head_dim_v),
    )


def resolve_configs(
    spec: AttentionSpec,
    capability: tuple[int, int] | None,
    tuned: cfgs.KernelConfigs | None = None,
    has_partial: bool = True,
) -> cfgs.KernelConfigs:
    """Defaults (or tuned results), then options pinned in kernel_options, fitted to the BlockMask."""
    base = tuned or cfgs.default_configs(
        capability, spec.head_dim, spec.dtype, has_partial=has_partial
    )
    if tuned is None and capability is not None:
        staged, gathers = _pairwise_loads(spec, capability)
        scatters = _scatters_full_tiles(spec)
        if staged or gathers or scatters:
            base = cfgs.for_pairwise_access(
                base, staged_loads=staged, gathers=gathers, scatters=scatters
            )
    chosen = cfgs.apply_options(base, spec.kernel_options)
    fitted = cfgs.fit_to_block_mask(chosen, spec.block_mask.block_size)
    if fitted is None:  # supports() has checked this; keep the invariant explicit
        raise ValueError("kernel tile sizes cannot fit the BlockMask's block size")
    return fitted


def _pairwise_loads(spec: AttentionSpec, capability: tuple[int, int] | None) -> tuple[bool, bool]:
    """Whether the mods load per pair (a captured-tensor index depends on q_idx and kv_idx)
    through Triton's software pipeliner, which stages the gather through shared memory; and
    whether they load per pair through `flexfa_gather`'s own reads on CUDA (Note [Per-pair
    gathers] in emit.py)."""
    from flexfa.ir.nodes import Op, toposort

    staged = gathers = False
    for mod in (spec.score_mod, spec.mask):
        if mod is None:
            continue
        for node in toposort([mod.output]):
            if node.op is not Op.LOAD or scatter.index_axes(node) != {"q_idx", "kv_idx"}:
                continue
            if capability is not None and emit.gathered_outside_pipeline(node):
                gathers = True
            else:
                staged = True
    return staged, gathers


def _scatters_full_tiles(spec: AttentionSpec) -> bool:
    """True if a captured gradient is scattered per pair or per diagonal (its index depends on
    q_idx and kv_idx and is not constant over aligned blocks: Note [Scatter-add of captured
    gradients] in emit.py). BLOCKED sums keep the backward's tiles: at the dQ kernel's default
    128 x 64 tile with 8 warps (sm_90, Triton 3.6, D=128, a (q_idx // 64, kv_idx // 64) table)
    they compile to 216 registers without spills and 160 KiB of shared memory, where the per-tile
    run-time tests they replace spilled 720 bytes per thread even at 64 x 64 with 4 warps."""
    if spec.score_mod is None or not spec.score_grad_slots:
        return False
    grad = spec.score_mod.gradient(spec.score_grad_slots)
    per_pair = (scatter.ScatterStrategy.DIAGONAL, scatter.ScatterStrategy.GENERAL)
    return any(
        scatter.index_axes(g.load) == {"q_idx", "kv_idx"}
        and scatter.scatter_strategy(g.load) in per_pair
        for g in grad.loads
    )
