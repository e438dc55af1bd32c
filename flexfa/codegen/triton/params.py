"""Typed parameters of the Triton backend: template parameters, kernel configs, cache keys."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from flexfa.codegen.triton.emit import ModSource

if TYPE_CHECKING:
    from flexfa.spec import AttentionSpec


@dataclasses.dataclass(frozen=True)
class TemplateParams:
    """Everything a kernel template prints. Decisions are made in Python; templates only print.

    `*_args` are rendered parameter lists (`"\\n    name, name,"` or empty) and `*_call_args`
    the matching `", name, name"` suffixes for calls of the mod functions.
    """

    score_mod: ModSource | None
    score_mod_grad: ModSource | None
    mask_mod: ModSource | None
    capture_args: str
    capture_call_args: str
    grad_args: str
    grad_call_args: str
    score_call_args: str
    mask_call_args: str
    score_grad_call_args: str

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """Forward kernel tile sizes and launch options."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        _check_pow2("block_m", self.block_m)
        _check_pow2("block_n", self.block_n)
        _check_positive("num_warps", self.num_warps)
        _check_positive("num_stages", self.num_stages)


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """Backward tile sizes: (block_m1, block_n1) for dK/dV programs, (block_m2, block_n2) for dQ;
    `dq_num_warps` the dQ kernel's warps where they differ from `num_warps` (None: the same)."""

    block_m1: int = 64
    block_n1: int = 128
    block_m2: int = 128
    block_n2: int = 64
    num_warps: int = 8
    num_stages: int = 3
    dq_num_warps: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_m1", "block_n1", "block_m2", "block_n2"):
            _check_pow2(name, getattr(self, name))
        _check_positive("num_warps", self.num_warps)
        _check_positive("num_stages", self.num_stages)
        if self.dq_num_warps is not None:
            _check_positive("dq_num_warps", self.dq_num_warps)

    @property
    def dq(self) -> BwdConfig:
        """This config as the dQ kernel is launched (its own warps)."""
        if self.dq_num_warps is None or self.dq_num_warps == self.num_warps:
            return self
        return dataclasses.replace(self, num_warps=self.dq_num_warps, dq_num_warps=None)


def _check_pow2(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModuleKey:
    """Identity of a generated source module: what its text depends on, plus versions.

    The text depends on the mods' IR (which includes Python-number closures, captured tensors'
    dtypes and ranks, and the mods' names), which captured tensors need gradients, and the
    templates. Shapes, dtypes of q/k/v and tile sizes are launch-time constexprs, so they select
    compiled specializations of the same module (see `KernelKey`).
    """

    score_mod: str | None
    mask_mod: str | None
    grad_slots: tuple[int, ...]
    templates: str
    flexfa_version: str
    triton_version: str
    torch_version: str

    @functools.cached_property
    def digest(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """Identity of one compiled kernel: its module, which kernel, and the launch specialization."""

    module: ModuleKey
    kernel: str
    dtype: str
    head_dim: int
    head_dim_v: int
    config: FwdConfig | BwdConfig
    constexprs: tuple[tuple[str, Any], ...]

    @classmethod
    def for_spec(
        cls,
        module: ModuleKey,
        kernel: str,
        spec: AttentionSpec,
        config: FwdConfig | BwdConfig,
        constexprs: Mapping[str, Any],
    ) -> KernelKey:
        """The key of `kernel` of `module` launched for `spec`'s dtype and head dims."""
        return cls(
            module=module,
            kernel=kernel,
            dtype=spec.dtype_name,  # with K/V's when float8 (Note [fp8 K/V])
            head_dim=spec.head_dim,
            head_dim_v=spec.head_dim_v,
            config=config,
            constexprs=tuple(sorted(constexprs.items())),
        )

    @functools.cached_property
    def digest(self) -> str:
        blob = json.dumps(
            {
                "module": self.module.digest,
                "kernel": self.kernel,
                "dtype": self.dtype,
                "head_dim": self.head_dim,
                "head_dim_v": self.head_dim_v,
                "config": {type(self.config).__name__: dataclasses.asdict(self.config)},
                "constexprs": [list(c) for c in self.constexprs],
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()
