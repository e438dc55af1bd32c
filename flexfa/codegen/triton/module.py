"""Rendering, caching and loading generated Triton modules.

# Note [Compile cache]
# Generating a module is cheap (milliseconds); compiling its kernels is not (seconds). Two caches
# cooperate:
#   - flexfa's: the rendered source of each module, keyed by `ModuleKey` (mods' IR digests, which
#     captures need gradients, a hash of the templates, and the flexfa/triton/torch versions), kept
#     in memory and on disk under `FLEXFA_CACHE_DIR/triton/<digest>/kernels.py` with a
#     `key.json` describing the key. A later process loads the file instead of rendering.
#   - Triton's: compiled binaries per specialization (tile sizes, dtypes, head dims and alignment),
#     keyed by Triton from the source text and constexprs, in Triton's cache directory. Because the
#     source file is byte-identical across processes, a second process finds its binaries there
#     and compiles nothing.
# Writes are atomic (write to a temporary file, then rename), so concurrent processes never read a
# half-written module.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
import threading
import types
from pathlib import Path

import jinja2

from flexfa.codegen.triton import emit
from flexfa.codegen.triton.params import ModuleKey, TemplateParams
from flexfa.config import config
from flexfa.frontend.trace import TracedMod

log = logging.getLogger("flexfa")

TEMPLATE_DIR = Path(__file__).parent / "templates"
TEMPLATE_FILES = ("prelude.py.jinja", "attention_fwd.py.jinja", "attention_bwd.py.jinja")


@dataclasses.dataclass
class CacheStats:
    """Counters of the module cache (for tests and for `flexfa.codegen.triton.cache_info()`)."""

    memory_hits: int = 0
    disk_hits: int = 0
    renders: int = 0


stats = CacheStats()
_modules: dict[str, types.ModuleType] = {}
_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def jinja_environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


@functools.lru_cache(maxsize=1)
def templates_digest() -> str:
    h = hashlib.sha256()
    for name in (*TEMPLATE_FILES, "../emit.py"):
        h.update((TEMPLATE_DIR / name).read_bytes())
    return h.hexdigest()[:16]


def _versions() -> tuple[str, str, str]:
    import torch
    import triton

    from flexfa import __version__

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
    return "".join(parts)


def module_dir(key: ModuleKey) -> Path:
    return config.cache_dir / "triton" / key.digest[:24]


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def import_file(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Triton resolves helper functions through the module's globals
    spec.loader.exec_module(module)
    return module


def load_module(
    score: TracedMod | None,
    mask: TracedMod | None,
    grad_slots: frozenset[int],
    *,
    force_compiled: bool = False,
) -> tuple[ModuleKey, types.ModuleType]:
    """The generated module for these mods: from memory, else from disk, else rendered now.

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
        directory = module_dir(key)
        path = directory / "kernels.py"
        if path.exists():
            stats.disk_hits += 1
        else:
            source = render(score, mask, grad_slots)
            atomic_write(path, source)
            atomic_write(
                directory / "key.json", json.dumps(dataclasses.asdict(key), indent=1) + "\n"
            )
            stats.renders += 1
            log.debug("flexfa: rendered Triton module %s", path)
        name = f"flexfa_generated_{digest[:24]}" + (
            "" if interpreted else "_jit" if force_compiled else ""
        )
        module = (
            _import_without_interpreter(path, name) if force_compiled else import_file(path, name)
        )
        _modules[cache_id] = module
        return key, module


def _import_without_interpreter(path: Path, name: str) -> types.ModuleType:
    """Import with TRITON_INTERPRET off, so that @triton.jit makes compilable functions."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        return import_file(path, name)
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
