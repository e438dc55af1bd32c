"""Rendering, caching and loading generated Triton modules.

# Note [Compile cache]
# Generating a module is cheap (milliseconds); compiling its kernels is not (seconds). Two caches
# cooperate:
#   - flexfa's: the rendered source of each module, keyed by `ModuleKey` (mods' IR digests, which
#     captures need gradients, a hash of the templates, and the flexfa/triton/torch versions), kept
#     in memory and on disk under `<cache>/triton/<digest>/kernels.py` with a `key.json`
#     describing the key. The disk copy is executed only when it is byte for byte what `render`
#     produces now, and the cache never stops a call (Note [Disk caches] in flexfa/runtime/diskcache.py).
#   - Triton's: compiled binaries per specialization (tile sizes, dtypes, head dims and alignment),
#     keyed by Triton from the source text and constexprs, in Triton's cache directory. Because the
#     source is byte-identical across processes, a second process finds its binaries there and
#     compiles nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import threading
import types
from pathlib import Path

import jinja2

from flexfa.codegen.triton import emit
from flexfa.codegen.triton.params import ModuleKey, TemplateParams
from flexfa.config import config
from flexfa.frontend.trace import TracedMod
from flexfa.runtime import diskcache, jinja

log = logging.getLogger("flexfa")

TEMPLATE_DIR = Path(__file__).parent / "templates"
TEMPLATE_FILES = (
    "prelude.py.jinja",
    "attention_fwd.py.jinja",
    "attention_bwd.py.jinja",
    "decode.py.jinja",
)


@dataclasses.dataclass
class CacheStats:
    """Counters of the module cache (for tests and for `flexfa.codegen.triton.cache_info()`)."""

    memory_hits: int = 0
    disk_hits: int = 0  # a verified disk copy was found
    renders: int = 0  # sources rendered (every load that misses memory renders, to verify)
    writes: int = 0  # modules written to disk


stats = CacheStats()
_modules: dict[str, types.ModuleType] = {}
_lock = threading.Lock()


def jinja_environment() -> jinja2.Environment:
    return jinja.environment(TEMPLATE_DIR)


@functools.lru_cache(maxsize=1)
def templates_digest() -> str:
    h = hashlib.sha256()
    for name in (*TEMPLATE_FILES, "../emit.py"):
        h.update((TEMPLATE_DIR / name).read_bytes())
    return h.hexdigest()[:16]


def _versions() -> tuple[str, str, str]:
    import torch
    import triton

    from flexfa.version import __version__

    return __version__, triton.__version__, torch.__version__


def module_key(
    score: TracedMod | None, mask: TracedMod | None, grad_slots: frozenset[int]
) -> ModuleKey:
    flexfa_v, triton_v, torch_v = _versions()
    return ModuleKey(
        score_mod=score.key if score is not None else None,
        mask_mod=mask.key if mask is not None else None,
        grad_slots=tuple(sorted(grad_slots)),
        templates=templates_digest(),
        flexfa_version=flexfa_v,
        triton_version=triton_v,
        torch_version=torch_v,
    )


def _arg_list(names: list[str]) -> str:
    """Render parameter names as continuation lines of a signature: '\\n    a, b,' (or '')."""
    if not names:
        return ""
    lines, line = [], []
    for n in names:
        line.append(n)
        if len(line) == 6:
            lines.append(", ".join(line) + ",")
            line = []
    if line:
        lines.append(", ".join(line) + ",")
    return "".join(f"\n    {text}" for text in lines)


def _call_suffix(names: list[str]) -> str:
    return "".join(f", {n}" for n in names)


def template_params(
    score: TracedMod | None, mask: TracedMod | None, grad_slots: frozenset[int]
) -> TemplateParams:
    """Decide function names and argument lists for the kernels of these mods."""
    score_src = grad_src = mask_src = None
    score_names: list[str] = []
    mask_names: list[str] = []
    grad_names: list[str] = []
    score_grad_names: list[str] = []
    if score is not None:
        score_src = emit.emit_mod(score, f"score_mod_{score.name}")
        # Kernel-level names get a prefix so a score_mod and a mask_mod may capture equal names.
        score_names = [f"sm_{p}" for p in score_src.params]
        grad = score.gradient(grad_slots)
        grad_src = emit.emit_score_mod_grad(score, grad, f"score_mod_{score.name}_bwd", grad_slots)
        caps = emit.capture_params(score)
        grad_caps = sorted(grad_slots)
        grad_names = [f"sm_{caps[s].grad_ptr}" for s in grad_caps]
        if grad_caps:
            grad_names.append("capture_scales")
        score_grad_names = score_names + grad_names
    if mask is not None:
        mask_src = emit.emit_mod(mask, f"mask_mod_{mask.name}")
        mask_names = [f"mm_{p}" for p in mask_src.params]
    capture_names = score_names + mask_names
    return TemplateParams(
        score_mod=score_src,
        score_mod_grad=grad_src,
        mask_mod=mask_src,
        capture_args=_arg_list(capture_names),
        capture_call_args=_arg_list(capture_names),
        grad_args=_arg_list(grad_names),
        grad_call_args=_arg_list(grad_names),
        score_call_args=_call_suffix(score_names),
        mask_call_args=_call_suffix(mask_names),
        score_grad_call_args=_call_suffix(score_grad_names),
    )


def render(score: TracedMod | None, mask: TracedMod | None, grad_slots: frozenset[int]) -> str:
    """The full source of the module for these mods: prelude, mod functions, kernels."""
    params = template_params(score, mask, grad_slots)
    env = jinja_environment()
    flexfa_v, _, _ = _versions()
    parts = [env.get_template("prelude.py.jinja").render(flexfa_version=flexfa_v)]
    for src in (params.score_mod, params.score_mod_grad, params.mask_mod):
        if src is not None:
            parts.append("\n\n" + src.source)
    context = params.as_dict()
    parts.append(env.get_template("attention_fwd.py.jinja").render(**context))
    parts.append(env.get_template("attention_bwd.py.jinja").render(**context))
    parts.append(env.get_template("decode.py.jinja").render(**context))
    return "".join(parts)


def module_dir(key: ModuleKey) -> Path | None:
    """The directory the disk cache keeps this module in (None when modules stay in memory)."""
    root = diskcache.directory("triton")
    return root / key.digest[:24] if root is not None else None


def load_module(
    score: TracedMod | None,
    mask: TracedMod | None,
    grad_slots: frozenset[int],
    *,
    force_compiled: bool = False,
) -> tuple[ModuleKey, types.ModuleType]:
    """The generated module for these mods: from memory, else rendered and checked against the
    disk copy, else rendered and written (Note [Compile cache]).

    With `force_compiled`, the module's functions are real Triton JIT functions even when
    TRITON_INTERPRET is set (for compiling without a GPU, see offline.py).
    """
    key = module_key(score, mask, grad_slots)
    digest = key.digest
    interpreted = config.triton_interpret and not force_compiled
    cache_id = digest if not force_compiled else digest + ":compiled"
    with _lock:
        module = _modules.get(cache_id)
        if module is not None:
            stats.memory_hits += 1
            return key, module
        name = f"flexfa_generated_{digest[:24]}" + (
            "" if interpreted else "_jit" if force_compiled else ""
        )

        def rendered() -> str:
            stats.renders += 1
            return render(score, mask, grad_slots)

        with _interpreter_off() if force_compiled else contextlib.nullcontext():
            loaded = diskcache.load_generated(
                "triton", digest[:24], rendered, name, key=dataclasses.asdict(key)
            )
        if loaded.origin == "disk":
            stats.disk_hits += 1
        elif loaded.origin == "written":
            stats.writes += 1
            log.debug("flexfa: wrote Triton module %s", loaded.path)
        module = _modules[cache_id] = loaded.module
        return key, module


@contextlib.contextmanager
def _interpreter_off():
    """TRITON_INTERPRET off while a module executes, so that @triton.jit makes compilable
    functions."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def compiled_kernel_count() -> int:
    """How many compiled kernel specializations the loaded generated modules hold (Triton's
    per-device caches of their JIT functions; 0 under TRITON_INTERPRET). Tests and benchmarks
    use it to count compiles."""
    total = 0
    with _lock:
        modules = list(_modules.values())
    for mod in modules:
        for obj in vars(mod).values():
            caches = getattr(obj, "device_caches", None)
            if isinstance(caches, dict):
                total += sum(len(entry[0]) for entry in caches.values())
    return total


def clear_memory_cache() -> None:
    """Forget loaded modules (the disk cache stays). Tests use this to simulate a new process."""
    with _lock:
        _modules.clear()
