"""The backend interface and registry.

A backend says whether it can run a call (`supports(spec)` -> yes, or no and why) and runs it
(`run(spec, q, k, v)` -> output and natural-log LSE, differentiable). `backend="auto"` asks the
registered backends in priority order and takes the first that says yes for the inputs' device.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import warnings

import torch

from flexfa.spec import AttentionSpec

log = logging.getLogger("flexfa")


@dataclasses.dataclass(frozen=True)
class Support:
    """A backend's answer: `ok`, or not and `reason`; a yes may carry a note on how the call will
    run (printed by `flexfa.explain_backend`)."""

    ok: bool
    reason: str = ""

    @staticmethod
    def yes(note: str = "") -> Support:
        return Support(True, note)

    @staticmethod
    def no(reason: str) -> Support:
        return Support(False, reason)

    def __bool__(self) -> bool:
        return self.ok


class Backend(abc.ABC):
    """One way to run attention. Subclasses register themselves with `register`."""

    #: Name users pass as `backend=`.
    name: str
    #: Device types `auto` considers this backend for, in preference order of registration.
    auto_device_types: frozenset[str]
    #: Whether `run` reads K and V through a page table (`spec.paged`, flexfa/paged.py).
    supports_paged: bool = False

    def auto_prefers(self, spec: AttentionSpec) -> bool:
        """Whether `auto` tries this backend for `spec` at all. A backend that declines is skipped
        without a warning: `auto` takes it only where measurements say it is the faster one
        (Note [Which backend auto picks])."""
        return True

    @abc.abstractmethod
    def supports(self, spec: AttentionSpec) -> Support: ...

    def reads_packed_mods(self, spec: AttentionSpec) -> bool:
        """Whether `run` runs a packed call (`spec.packed`) as one call on the concatenation, with
        its rewritten mods and BlockMask (Note [Packed batches as mods] in flexfa/varlen.py), so
        that its block lists and packed positions must be built first (Note [Block masks built
        on first read]). A backend with a variable-length path of its own says False where it
        takes that path."""
        return True

    @abc.abstractmethod
    def run(
        self, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (out [B, Hq, Lq, Ev] in q's dtype, lse [B, Hq, Lq] float32, natural log), and
        with `spec.max_scores` a third value, the row max of the modified scores (like lse,
        -inf for empty rows, not differentiable)."""

    # The two halves of `run` without autograd, for callers that register their own (the
    # torch.library ops of flexfa/compiled.py). `saved` is what the backward reads for the output
    # (the unrounded output where the backend keeps one, else `out` itself).
    def forward(
        self, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(out, lse, saved, max_scores) of a forward pass; max_scores None unless
        `spec.max_scores`."""
        raise NotImplementedError(f"backend {self.name!r} has no separate forward")

    def backward(
        self,
        spec: AttentionSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        saved: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
        grad_slots: frozenset[int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """(dq, dk, dv, {slot: gradient of that captured tensor of the score_mod})."""
        raise NotImplementedError(f"backend {self.name!r} has no separate backward")


_REGISTRY: dict[str, Backend] = {}
_LAZY: dict[str, str] = {}  # name -> module that registers it on import
_warned: set[tuple[str, str]] = set()


def register(backend: Backend) -> Backend:
    _REGISTRY[backend.name] = backend
    return backend


def register_lazy(name: str, module: str) -> None:
    """Register a backend whose module is imported only when it is first needed."""
    _LAZY[name] = module


_unavailable: dict[str, str] = {}


def _load(name: str) -> Backend | None:
    if name not in _REGISTRY and name in _LAZY and name not in _unavailable:
        import importlib

        try:
            importlib.import_module(_LAZY[name])
        except ImportError as e:  # an optional dependency (e.g. triton) is missing
            _unavailable[name] = f"cannot import {_LAZY[name]}: {e}"
    return _REGISTRY.get(name)


def names() -> list[str]:
    return list(dict.fromkeys([*_LAZY, *_REGISTRY]))


def _supports(backend: Backend, spec: AttentionSpec) -> Support:
    if spec.paged is not None and not backend.supports_paged:
        return Support.no("it does not read paged KV caches")
    return backend.supports(spec)


def explain(spec: AttentionSpec) -> list[tuple[str, Support]]:
    """Each backend's answer for `spec`, in priority order."""
    answers = []
    for name in names():
        backend = _load(name)
        if backend is None:
            answers.append((name, Support.no(_unavailable.get(name, "not available"))))
        else:
            answers.append((name, _supports(backend, spec)))
    return answers


def select(requested: str, spec: AttentionSpec, *, warn: bool = True) -> Backend:
    """The backend for `spec`: the one named, or with "auto" the first that supports it (and
    that auto prefers for it). `warn=False` leaves out the warning about skipped backends."""
    if requested != "auto":
        backend = _load(requested)
        if backend is None and requested in _unavailable:
            raise ValueError(f"backend {requested!r} is not available: {_unavailable[requested]}")
        if backend is None:
            raise ValueError(f"unknown backend {requested!r}; expected 'auto' or one of {names()}")
        answer = _supports(backend, spec)
        if not answer:
            raise ValueError(f"backend {requested!r} cannot run this call: {answer.reason}")
        return backend
    device_type = spec.device.type
    skipped: list[tuple[str, str]] = []
    for name in names():
        backend = _load(name)
        if backend is None or device_type not in backend.auto_device_types:
            continue
        if not backend.auto_prefers(spec):
            log.debug("flexfa: auto skips backend %s for this call", backend.name)
            continue
        answer = _supports(backend, spec)
        if answer:
            for other, reason in skipped if warn else ():
                _warn_once(other, backend.name, reason)
            log.debug("flexfa: backend %s chosen for %s", backend.name, device_type)
            return backend
        skipped.append((name, answer.reason))
    reasons = "; ".join(f"{n}: {r}" for n, r in skipped) or "no backend handles this device"
    raise ValueError(f"no flexfa backend can run this call on {spec.device} ({reasons})")


def _warn_once(skipped: str, chosen: str, reason: str) -> None:
    key = (skipped, reason)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(
        f"flexfa: the {skipped!r} backend cannot run this call ({reason}); using the slower "
        f"{chosen!r} backend instead",
        stacklevel=4,
    )
