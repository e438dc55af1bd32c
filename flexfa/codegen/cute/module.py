"""Rendering, caching and loading generated CuTe DSL modules (the mods of FA4's hooks).

# Note [CuTe compile cache]
# As for the Triton backend (Note [Compile cache] in flexfa/codegen/triton/module.py), flexfa keeps
# the rendered source of each module, keyed by `ModuleKey` (mods' IR digests, the captures that
# need gradients, a hash of the template and emitter, and the flexfa / flash-attn-4 / CuTe DSL /
# torch versions), in memory and on disk under `FLEXFA_CACHE_DIR/cute/<digest>/mods.py`. FA4 then
# compiles its kernels with these hooks and caches them itself, keyed by a hash of each hook's
# source (here flexfa's module digest, Note [FA4 kernels on disk] in jitcache.py), the tile
# configuration, dtypes, head dims and arch, and flexfa keeps those kernels on disk for later
# processes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import threading
import types
from pathlib import Path

from flexfa.codegen.cute import emit
from flexfa.frontend.trace import TracedMod
from flexfa.runtime import diskcache, jinja

TEMPLATE_DIR = Path(__file__).parent / "templates"
TEMPLATE = "mods.py.jinja"

_modules: dict[str, types.ModuleType] = {}
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class ModuleKey:
    """What a generated CuTe module depends on."""

    score_mod: str | None
    mask_mod: str | None
    grad_slots: tuple[int, ...]
    templates: str
    versions: tuple[str, ...]

    @functools.cached_property
    def digest(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def templates_digest() -> str:
    h = hashlib.sha256()
    for path in (TEMPLATE_DIR / TEMPLATE, Path(emit.__file__)):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def versions() -> tuple[str, ...]:
    """flexfa, flash-attn-4, CuTe DSL and torch versions (package metadata: imports nothing)."""
    from importlib import metadata

    import torch

    from flexfa.version import __version__

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "none"

    return (__version__, version("flash-attn-4"), version("nvidia-cutlass-dsl"), torch.__version__)


def module_key(
    score: TracedMod | None, mask: TracedMod | None, grad_slots: frozenset[int]
) -> ModuleKey:
    return ModuleKey(
        # Lifted scalars are run-time values (Note [Constants in generated CuTe source]).
        score_mod=score.key if score is not None else None,
        mask_mod=mask.key if mask is not None else None,
        grad_slots=tuple(sorted(grad_slots)),
        templates=templates_digest(),
        versions=versions(),
    )


@dataclasses.dataclass(frozen=True)
class Rendered:
    """The generated functions of one module and the module's source."""

    score_mod: emit.ModSource | None
    score_mod_bwd: emit.ModSource | None
    mask_mod: emit.ModSource | None
    aux: emit.AuxLayout
    source: str


def _aux_doc(score: TracedMod | None, mask: TracedMod | None, aux: emit.AuxLayout) -> str:
    """Where each run-time value sits in FA4's `aux_scalars` (Note [Captured tensors by
    address])."""
    entries = []
    if score is not None:
        entries += [f"[{s.slot}] {s.name} (float32)" for s in score.scalars]

    def tensor(position: int, what: str) -> str:
        first, last = aux.address(position), aux.size(position, aux.tensors[position][1] - 1)
        return f"[{first}] address, [{first + 1}:{last + 1}] sizes of {what}"

    if score is not None:
        entries += [
            tensor(aux.score_capture(c.slot), f"{c.name} (score_mod)") for c in score.captures
        ]
    if mask is not None:
        entries += [tensor(aux.mask_capture(c.slot), f"{c.name} (mask_mod)") for c in mask.captures]
    if score is not None:
        entries += [
            tensor(aux.grad_buffer(s), f"the gradient of {score.captures[s].name} (float32)")
            for s in aux.grad_slots
        ]
    return "; ".join(entries) or "none"


def render(score: TracedMod | None, mask: TracedMod | None, grad_slots: frozenset[int]) -> Rendered:
    """The generated module for these mods: helpers, then score_mod, score_mod_bwd, mask_mod."""
    from flexfa.version import __version__

    aux = emit.AuxLayout.of(score, mask, grad_slots)
    constants = emit.Constants()  # Note [Constants in generated CuTe source]
    score_src = bwd_src = mask_src = None
    if score is not None:
        score_src = emit.emit_mod(score, f"score_mod_{score.name}", aux, constants)
        grad = score.gradient(grad_slots)
        bwd_src = emit.emit_score_mod_bwd(
            score, grad, f"score_mod_bwd_{score.name}", aux, constants
        )
    if mask is not None:
        mask_src = emit.emit_mod(mask, f"mask_mod_{mask.name}", aux, constants)
    sm = score.name if score is not None else "none"
    mm = mask.name if mask is not None else "none"
    source = (
        jinja.environment(TEMPLATE_DIR)
        .get_template(TEMPLATE)
        .render(
            flexfa_version=__version__,
            summary=f"score_mod: {sm}; mask_mod: {mm}",
            aux_doc=_aux_doc(score, mask, aux),
            functions=[s.source for s in (score_src, bwd_src, mask_src) if s is not None],
            score_mod_name=score_src.name if score_src else "None",
            score_mod_bwd_name=bwd_src.name if bwd_src else "None",
            mask_mod_name=mask_src.name if mask_src else "None",
        )
    )
    return Rendered(score_src, bwd_src, mask_src, aux, source)


def load_module(
    score: TracedMod | None, mask: TracedMod | None, grad_slots: frozenset[int]
) -> tuple[ModuleKey, types.ModuleType]:
    """The generated module for these mods, imported (this imports cutlass and flash_attn): from
    memory, else rendered and checked against the disk copy, else rendered and written — the
    rules of every flexfa disk cache (Note [Disk caches] in flexfa/runtime/diskcache.py)."""
    key = module_key(score, mask, grad_slots)
    with _lock:
        module = _modules.get(key.digest)
        if module is not None:
            return key, module
        loaded = diskcache.load_generated(
            "cute",
            key.digest[:24],
            lambda: render(score, mask, grad_slots).source,
            f"flexfa_cute_{key.digest[:24]}",
            key=dataclasses.asdict(key),
            file_name="mods.py",
        )
        module = _modules[key.digest] = loaded.module
        return key, module


def clear_memory_cache() -> None:
    with _lock:
        _modules.clear()
