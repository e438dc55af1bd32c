"""transformers' masks as flexfa masks: `build_mask`, transformers' `AttentionMaskInterface`.

One call per kind of layer and forward (from `create_causal_mask`,
`create_sliding_window_causal_mask`, ...) reads transformers' mask function back into its parts
and hands every layer of that kind a `TransformersMask`: flexfa's mask_mod on the call's
positions, its BlockMask, or the other ways a call reads its keys (a static cache as pages, a
packed row as documents). `flexfa.integrations.transformers` registers it and runs the layers.

# Note [Transformers' masks as flexfa masks]
# transformers describes a mask by a `mask_function(batch_idx, head_idx, q_idx, kv_idx)` on
# absolute positions, composed from its own factories (`causal_mask_function`,
# `sliding_window_overlay(w)`, `and_masks`, the packed-sequence wrappers), plus the offsets of the
# query and key windows (`q_offset`, `kv_offset`: the cache's past length, a sliding cache's first
# kept position) and a 2-D padding mask. torch's `create_block_mask` would be compiled and run on
# the dense grid for every new length. Instead `build_mask` reads the composition back (the
# factories' code objects and closure cells: `_read_mask_function`) into `MaskParts` — causal, a
# causal window, a bidirectional window, document ids of a packed batch — and writes one flexfa
# mask_mod on *local* positions from them (`_local_mask_mod`): with delta = q_offset - kv_offset,
# causal is `q_idx - kv_idx + delta >= 0`, the window `q_idx - kv_idx + delta < w`, padding
# `padding[b, kv_idx]` on the padding mask sliced to the key window, documents
# `docs[b, q_idx] == docs[b, kv_idx]`. A packed batch remaps positions to those within each
# sequence, where they are consecutive, so relative masks (causal, windows) read the same on the
# packed indices and only the document condition is added. A part that is true on every pair of
# the call (a decode step's causal condition, a window longer than the cache) is left out, so a
# decode step without padding runs with no mask at all. A composition flexfa does not recognise (a
# vision model's `or_mask_function`, chunked attention) is kept as it is, called on absolute
# positions inside the flexfa mask_mod, which flexfa traces like any other (its BlockMask is built
# by flexfa's general path). The flexfa BlockMask is built once per `build_mask` call: the model
# passes the same `TransformersMask` to every layer of that kind, so a forward builds at most one
# BlockMask per kind of layer, and masks without captured tensors are kept across forwards
# (`_block_mask_cache`), so that repeated calls reach flexfa's repeated-call path (Note [Repeated
# inference calls] in flexfa/api.py).
#
# Note [Stable mods]
# flexfa's trace cache and repeated-call memo, and torch.compile's guards, key a mod by its
# identity; a new closure per forward would trace again in eager calls and recompile the graph in
# compiled ones. So a mask's mod is a `LocalMask`, one object per `Structure` (which conditions,
# which window, and which kind of layer: two kinds' masks, built before either's layers run, must
# not share tensors) for the life of the process, whose tensors (offset, documents, padding) each
# `build_mask` replaces; an eager BlockMask is built at once from the tensors of its own build.
# (Masks with transformers' own functions among their conditions are new objects at every build.)
#
# Note [Offsets as tensors]
# flexfa bakes the ints a mask_mod reads into its kernels (Note [Lifted scalars] in
# flexfa/ir/nodes.py), so a mask reading a decode step's offset as an int would compile a kernel
# per step. Offsets that are 0 stay ints (prefill, training); others, and a static cache's offset
# (a tensor already, so that its graph does not depend on the step), are read from a 0-dim int32
# tensor captured by the mask_mod, whole: an index (`shift[0]`) would be evaluated while the mod
# is traced, and the new tensor it gives could not be traced back to the mod by torch.compile,
# which would then keep the first step's value.
#
# Note [Masks under torch.compile and CUDA graphs]
# Inside `torch.compile` the mask builder runs outside the graph (`torch.compiler.disable`: one
# graph break per mask, that is per kind of layer and forward, not per layer): it reads the
# closures transformers made and creates flexfa's mod objects, which Dynamo cannot do inside a
# graph. The attention layers stay in the graph; they see the same `LocalMask` object at every
# step (Note [Stable mods]) and flexfa's compiled op follows it to its tensors and builds the
# BlockMask from the mask_mod for each call's lengths. The mod objects a compiled call needs are
# made by the builder (`as_score_mod`, with the config's `attn_logit_softcapping`). A BlockMask
# is built from the values the captured tensors hold when it is built; a CUDA graph
# (`mode="reduce-overhead"`, transformers' default for compiled generation) replays the kernels
# with the tiles of the warm-up step, which would be wrong for the next step's offset. So under
# compile, short queries (decode steps, at most `SHORT_QUERY` rows) get their mask as a score_mod
# instead (`-inf` where the mask excludes a pair) with no block mask: every tile is read and the
# condition is evaluated from the tensors' current values at every replay, the cost of reading a
# static cache's unused tail (as SDPA does with a dense mask). Longer queries (prefill, training)
# keep the mask_mod and its tile skipping.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, ClassVar

import torch

import flexfa
from flexfa.blockmask.block_mask import BlockMask
from flexfa.frontend.trace import TracedMod, trace
from flexfa.mods import softcap as softcap_mod

#: Queries at most this long get their mask as a score_mod under torch.compile (Note [Masks under
#: torch.compile and CUDA graphs]); the decode path's limit (flexfa/codegen/triton/decode.py).
SHORT_QUERY = 64


@dataclasses.dataclass(frozen=True)
class MaskParts:
    """What a transformers mask_function says, on absolute positions (Note [Transformers' masks as
    flexfa masks]). Every field that is set must hold for a pair to attend."""

    causal: bool = False
    window: int | None = None  # causal window: kv > q - window
    bidirectional_window: int | None = None  # |q - kv| <= window
    documents: torch.Tensor | None = None  # (B, L) sequence ids of a packed batch
    others: tuple[Callable[..., Any], ...] = ()  # kept as transformers wrote them


@dataclasses.dataclass(frozen=True, eq=False)
class StaticCacheLengths:
    """The page table and lengths that read a static cache (B, Hkv, capacity, E) as a page pool."""

    page_table: torch.Tensor  # (B, 1) int32: sequence b is page b
    kv_lens: torch.Tensor  # (B,) int32, updated in place at every step
    capacity: int


@dataclasses.dataclass(eq=False)
class PackedDocuments:
    """A packed batch row as flexfa's packed call reads it (Note [Packed sequences as a packed
    call]): the documents' ids, the mask inside each document, and the documents' offsets on the
    host, read from the ids when a layer first asks (compiled layers never do)."""

    ids: torch.Tensor  # (L,) a document id per token
    mask_mod: LocalMask | None  # causal, a window: on positions within each document
    _offsets: torch.Tensor | None = None
    _read: bool = False

    @property
    def cu_seqlens(self) -> torch.Tensor | None:
        """(documents + 1,) int32 offsets on the CPU, or None where an id is not one run of tokens
        (then they are not documents: the layers keep the document mask)."""
        if not self._read:
            ids = self.ids.cpu()  # the one copy to the host
            if ids.numel() < 2 or not bool((ids[1:] < ids[:-1]).any()):
                _, lengths = torch.unique_consecutive(ids, return_counts=True)
                self._offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
                torch.cumsum(lengths, 0, out=self._offsets[1:])
            self._read = True
        return self._offsets


@dataclasses.dataclass(frozen=True, eq=False)
class TransformersMask:
    """What `build_mask` hands to every attention layer of one kind for one forward.

    `mask_mod` is on the call's local positions (None: every pair attends); `block_mask` is its
    flexfa BlockMask, built by eager calls (inside torch.compile flexfa's op builds it from the
    mask_mod, or the mask is applied as a score_mod: Note [Masks under torch.compile and CUDA
    graphs])."""

    batch: int
    len_q: int
    len_kv: int
    mask_mod: LocalMask | None
    block_mask: BlockMask | None
    # A static cache's decode step, eagerly: the cache as a paged pool of one page per sequence
    # (Note [Static caches as page pools]).
    static_cache: StaticCacheLengths | None = None
    # A packed batch of one row, eagerly (Note [Packed sequences as a packed call]).
    packed: PackedDocuments | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, 1, Lq, Lkv), the shape of the mask it stands for."""
        return (self.batch, 1, self.len_q, self.len_kv)

    @property
    def ndim(self) -> int:
        """4, as the mask it stands for: transformers passes a prepared mask through."""
        return 4

    def contiguous(self) -> TransformersMask:
        """Itself (generate() calls this on the masks it prepares for compilable caches)."""
        return self


@torch.compiler.disable  # Note [Masks under torch.compile and CUDA graphs]
def build_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> TransformersMask:
    """transformers' mask interface: the flexfa mask of one kind of layer for one forward.

    Arguments as transformers' `flex_attention_mask` (masking_utils.py); the keywords it passes
    for other implementations (`allow_is_causal_skip`, `dtype`, `config`, `local_size`,
    `use_vmap`, ...) are not needed here.
    """
    if isinstance(attention_mask, TransformersMask):
        # generate() builds a compilable cache's masks itself, then hands them to the model,
        # whose mask functions call this again with them.
        return attention_mask
    parts = _read_mask_function(mask_function)
    padding = _padding(attention_mask, kv_length, kv_offset)
    mask_mod = _local_mask_mod(parts, padding, q_length, kv_length, q_offset, kv_offset, device)
    cap = getattr(kwargs.get("config"), "attn_logit_softcapping", None)
    cap = float(cap) if cap else None
    block_mask = static = None
    if _static_decode(parts, padding, q_length, q_offset, kv_offset):
        static = _static_cache_lengths(batch_size, kv_length, q_offset, torch.device(device))
    packed = _packed_documents(parts, padding, batch_size, q_length, kv_length, device)
    if mask_mod is not None:
        if packed is not None:
            pass  # Note [Packed sequences as a packed call]: no BlockMask of the whole row
        elif q_length <= SHORT_QUERY and not mask_mod.relative:
            pass  # Note [Short queries' padding as a score_mod]
        elif static is None:
            # Built now, from the tensors of this call (the LocalMask's are replaced by the next).
            device = torch.device(device)
            block_mask = _block_mask(mask_mod, batch_size, q_length, kv_length, device)
        if q_length <= SHORT_QUERY:  # the score_mods compiled calls take, made out of the graph
            mask_mod.as_score_mod(None)
            if cap:
                mask_mod.as_score_mod(cap)
    if cap:  # made here too, out of a compiled graph (Note [Masks under torch.compile ...])
        stable_softcap(cap)
    return TransformersMask(batch_size, q_length, kv_length, mask_mod, block_mask, static, packed)


# Note [Packed sequences as a packed call]
# transformers detects packed sequences (one row of documents, position_ids restarting at each)
# and describes them by a document id per token, a mask `docs[q_idx] == docs[kv_idx]` beside the
# causal or window condition. As a mask_mod that is a block-sparse call over the whole row, whose
# tiles where two documents meet are evaluated per pair. flexfa's packed call (`cu_seqlens_q`,
# `cu_seqlens_kv`, flexfa/varlen.py) runs the same row as documents: tiles never cross a
# document, the condition inside each is the causal or window mask on positions within it (the
# same values, since positions within a document are consecutive), and on the fa4 backend it is
# FA4's own varlen kernel. So an eager call on a packed row of one batch element takes that path:
# `build_mask` builds no BlockMask, and the first layer reads the documents' offsets from the ids
# (one copy to the host per forward, where transformers' own flash-attention path also reads its
# offsets) after checking that each id is one run of tokens; every layer passes the same host
# offsets, which cost no synchronization (Note [Offsets on the host] in flexfa/varlen.py).
# Inside torch.compile the layers keep the mask_mod (flexfa's compiled op runs it over the row)
# and never read the offsets; batches of several packed rows keep the mask_mod too. On GPUs only (`PACKED_CALL_DEVICES`): on the 2-core CPU the tiled
# backend ran a tiny Llama's packed training step (3,048 tokens, six documents) in 750 ms as a
# packed call against 634 ms with the document mask, whose per-pair condition it evaluates more
# cheaply than the packed call's positions.
#: Devices whose packed rows take flexfa's packed call (Note [Packed sequences as a packed call]).
PACKED_CALL_DEVICES = frozenset({"cuda"})


def _packed_documents(
    parts: MaskParts, padding, batch: int, len_q: int, len_kv: int, device
) -> PackedDocuments | None:
    """The packed call of a packed row (Note [Packed sequences as a packed call]), or None."""
    docs = parts.documents
    if docs is None or batch != 1 or padding is not None or parts.others or len_q != len_kv:
        return None
    if torch.device(device).type not in PACKED_CALL_DEVICES:
        return None
    if docs.ndim != 2 or docs.shape[0] != 1 or docs.shape[1] != len_q:
        return None
    inner = dataclasses.replace(parts, documents=None)
    return PackedDocuments(docs[0], _local_mask_mod(inner, None, len_q, len_kv, 0, 0, device))


# Note [Short queries' padding as a score_mod]
# A decode step's mask without a relative condition (a dynamic cache's step with padding: causal
# holds on every key of the step) can skip only the tiles of left padding, a few of the cache's.
# Its BlockMask would be built at every step (its keys grow by one) and be a new object for
# flexfa's repeated-call path; so queries of at most SHORT_QUERY rows apply such a mask as a
# score_mod (`-inf` where excluded, as under torch.compile), which reads the padding tensor per
# key and needs no BlockMask. On the 2-core CPU (tiny Llama, batch 4, left padding, 48 greedy
# steps) a step took 0.89-0.92x sdpa's time with this and the twin traces, 1.00x before. Masks
# with a causal condition or a window (static caches' steps, sliding layers) keep their BlockMask:
# it skips a static cache's unused tail and the keys outside a window.


# Note [Static caches as page pools]
# A static cache holds (B, Hkv, capacity, E) keys of which the first q_offset + 1 are written at
# a decode step. Masking the tail would build a BlockMask per step (its tiles follow the offset)
# and make every layer's call a new one for flexfa's repeated-call path. Read as a page pool
# instead — page b is sequence b's whole buffer, `page_table[b] = [b]`, page size = capacity — the
# cache needs only its lengths: `kv_lens` is one tensor per (batch, device) updated in place at
# each step and recorded as checked (`mark_checked`: valid by construction, so no step
# synchronizes to check it), so all layers and steps repeat one call (Note [Repeated inference
# calls] in flexfa/api.py) and the decode kernels stop at each sequence's length. Taken for one
# query without padding on full-attention layers in eager calls (paged calls are not supported
# inside torch.compile, where Note [Masks under torch.compile and CUDA graphs] applies).
_static_lengths: dict[tuple[int, int, str], StaticCacheLengths] = {}


def _static_decode(parts: MaskParts, padding, len_q: int, q_offset, kv_offset) -> bool:
    return (
        isinstance(q_offset, torch.Tensor)
        and not isinstance(kv_offset, torch.Tensor)
        and kv_offset == 0
        and len_q == 1
        and padding is None
        and parts.causal
        and parts.window is None
        and parts.bidirectional_window is None
        and parts.documents is None
        and not parts.others
        and not torch.is_grad_enabled()
    )


def _static_cache_lengths(batch: int, capacity: int, q_offset, device) -> StaticCacheLengths:
    from flexfa.paged import mark_checked

    key = (batch, capacity, str(device))
    found = _static_lengths.get(key)
    if found is None:
        table = torch.arange(batch, dtype=torch.int32, device=device)[:, None]
        lens = torch.zeros(batch, dtype=torch.int32, device=device)
        found = _static_lengths[key] = StaticCacheLengths(table, lens, capacity)
    found.kv_lens.copy_(q_offset.reshape(-1)[:1].expand(batch) + 1)
    mark_checked(found.page_table, found.kv_lens, batch, capacity)
    return found


def _closure(fn: Callable[..., Any]) -> dict[str, Any]:
    cells = fn.__closure__ or ()
    return {name: c.cell_contents for name, c in zip(fn.__code__.co_freevars, cells)}


class _Factories:
    """The code objects of transformers' mask factories, read once."""

    _lock = threading.Lock()
    _codes: dict[str, Any] | None = None

    @classmethod
    def codes(cls) -> dict[str, Any]:
        with cls._lock:
            if cls._codes is None:
                from transformers import masking_utils as mu

                t = torch.zeros(1, 1, dtype=torch.long)
                made = {
                    "causal": lambda: mu.causal_mask_function,
                    "bidirectional": lambda: mu.bidirectional_mask_function,
                    "and": lambda: mu.and_masks(mu.causal_mask_function),
                    "window": lambda: mu.sliding_window_overlay(1),
                    "bidirectional_window": lambda: mu.sliding_window_bidirectional_overlay(1),
                    "documents": lambda: mu.packed_sequence_mask_function(t),
                    "remap": lambda: mu.remap_positions_for_packed_sequence(
                        mu.causal_mask_function, t
                    ),
                }
                cls._codes = {}
                for name, make in made.items():
                    try:
                        cls._codes[name] = make().__code__
                    except AttributeError:  # a transformers without this factory: never matched
                        cls._codes[name] = None
            return cls._codes


def _read_mask_function(fn: Callable[..., Any] | None) -> MaskParts:
    """The `MaskParts` of a transformers mask_function (Note [Transformers' masks as flexfa
    masks]); what is not recognised is kept in `others`."""
    if fn is None:
        return MaskParts(causal=True)
    if not callable(fn):
        raise TypeError(f"mask_function must be callable, got {type(fn).__name__}")
    found = _read(fn, _Factories.codes())
    return found if found is not None else MaskParts(others=(fn,))


def _read(fn: Callable[..., Any], codes: dict[str, Any]) -> MaskParts | None:
    code = getattr(fn, "__code__", None)
    if code is None:  # (codes of missing factories are None too: `is` never matches them)
        return None
    if code is codes["causal"]:
        return MaskParts(causal=True)
    if code is codes["bidirectional"]:
        return MaskParts()
    cells = _closure(fn)
    if code is codes["window"]:
        return MaskParts(window=int(cells["sliding_window"]))
    if code is codes["bidirectional_window"]:
        return MaskParts(bidirectional_window=int(cells["sliding_window"]))
    if code is codes["documents"]:
        return MaskParts(documents=cells["packed_sequence_mask"])
    if code is codes["remap"]:
        inner = _read(cells["mask_function"], codes)
        # Positions within a sequence are consecutive: relative masks read the same on the packed
        # indices; anything else needs the remapped positions and is kept whole.
        if inner is None or inner.others or inner.documents is not None:
            return None
        return inner
    if code is codes["and"]:
        merged = MaskParts()
        for part in cells["mask_functions"]:
            found = _read(part, codes)
            if found is None:
                found = MaskParts(others=(part,))
            merged = _merge(merged, found)
        return merged
    return None


def _merge(a: MaskParts, b: MaskParts) -> MaskParts:
    def smaller(x, y):
        return y if x is None else x if y is None else min(x, y)

    if a.documents is not None and b.documents is not None:
        return MaskParts(others=(*a.others, *b.others, _documents_abs(b.documents)))
    return MaskParts(
        causal=a.causal or b.causal,
        window=smaller(a.window, b.window),
        bidirectional_window=smaller(a.bidirectional_window, b.bidirectional_window),
        documents=a.documents if a.documents is not None else b.documents,
        others=a.others + b.others,
    )


def _documents_abs(docs: torch.Tensor) -> Callable[..., Any]:
    def documents(b, h, q_idx, kv_idx):
        return docs[b, q_idx] == docs[b, kv_idx]

    return documents


def _padding(attention_mask: torch.Tensor | None, kv_length: int, kv_offset: int):
    """The padding mask over the call's keys, (B, kv_length) bool, or None without padding."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2:
        raise ValueError(
            "flexfa's mask builder expects attention_mask as a 2-D (batch, length) padding mask, "
            f"got {type(attention_mask).__name__} of shape {getattr(attention_mask, 'shape', None)}"
        )
    mask = attention_mask.to(torch.bool)
    missing = kv_offset + kv_length - mask.shape[-1]
    if missing > 0:  # a static cache's unused tail: transformers pads with False
        mask = torch.nn.functional.pad(mask, (0, missing))
    mask = mask[:, kv_offset : kv_offset + kv_length]
    # One synchronization per mask (transformers' own sdpa and flex builders pay it too): a
    # batch without padding needs no mask tensor, and its decode steps no mask at all. (Under
    # torch.compile too: the builder runs outside the graph.)
    # A sum rather than `all()`, which is about 200x slower on bool tensors on some CPUs.
    if int(mask.sum()) == mask.numel():
        return None
    return mask.contiguous()


def _offset_tensor(delta: int | torch.Tensor, device) -> torch.Tensor:
    """A 0-dim int32 tensor, read whole by the mods (Note [Offsets as tensors])."""
    if isinstance(delta, torch.Tensor):
        return delta.reshape(-1)[0].to(device=device, dtype=torch.int32)
    return torch.tensor(delta, dtype=torch.int32, device=device)


def _local_mask_mod(
    parts: MaskParts,
    padding: torch.Tensor | None,
    len_q: int,
    len_kv: int,
    q_offset: int | torch.Tensor,
    kv_offset: int,
    device,
) -> LocalMask | None:
    """The flexfa mask_mod of `parts` on local positions, None when every pair attends."""
    if isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor):
        delta: int | torch.Tensor = q_offset - kv_offset
        known = False
    else:
        delta, known = int(q_offset) - int(kv_offset), True
    # The extremes of q_idx - kv_idx + delta over the call's pairs.
    low = -(len_kv - 1) + delta if known else None
    high = (len_q - 1) + delta if known else None
    causal = parts.causal and not (known and low >= 0)
    window = parts.window
    if window is not None and known and high < window:
        window = None
    both = parts.bidirectional_window
    if both is not None and known and high <= both and -low <= both:
        both = None
    if parts.documents is not None and not (known and delta == 0 and int(q_offset) == 0):
        raise ValueError("packed sequences (document ids from position_ids) need no KV cache")
    others = tuple(_absolute(f, q_offset, kv_offset, device) for f in parts.others)
    relative = causal or window is not None or both is not None
    shifted = relative and not (known and delta == 0)
    documents, padded = parts.documents is not None, padding is not None
    if not (relative or documents or padded or others):
        return None
    kind = (parts.causal, parts.window, parts.bidirectional_window)
    structure = LocalMask.Structure(causal, window, both, shifted, documents, padded, others, kind)
    mask = LocalMask.get(structure)
    mask.shift = _offset_tensor(delta, device) if shifted else None  # Note [Offsets as tensors]
    mask.documents = parts.documents
    mask.padding = padding
    return mask


# Note [Mask tensors rebound, not retraced]
# A LocalMask's tensors are new at every build (a decode step's offset and padding, a batch's
# documents), and its Structure is not a value the trace cache can summarize, so each build would
# trace the mask again: 0.85 ms of the 3.1 ms a padded decode step spent building its mask on the
# 2-core CPU (tiny Llama, batch 4, under cProfile). LocalMask and ScoreMask therefore bring their trace (Note [Mods that bring their trace]
# in flexfa/frontend/trace.py): a *twin* — the same structure (and softcap) over stand-in tensors
# of the same dtype, rank and device — is traced once, and each build's tensors are bound to its
# captures; a trace reads only those three properties of a tensor (Note [Trace cache]). The last
# binding is kept, so the layers of one forward see one TracedMod, which flexfa's repeated-call
# path keys on. A mask with transformers' own functions among its conditions (`others`, closures
# over tensors of their own) is traced as it is, at every build.
_MASK_TENSORS = ("shift", "documents", "padding")


class LocalMask:
    """A transformers mask on a call's local positions, as one flexfa mask_mod.

    One object per `Structure` for the life of the process, whose tensors (`shift`, `documents`,
    `padding`) each `build_mask` call replaces: flexfa's trace cache and torch.compile's guards
    see the same mod at every step, and read its tensors' current values (Note [Stable mods]).
    Traced through a twin (Note [Mask tensors rebound, not retraced])."""

    @dataclasses.dataclass(frozen=True)
    class Structure:
        causal: bool
        window: int | None
        bidirectional_window: int | None
        shifted: bool  # q_idx - kv_idx is offset by shift
        documents: bool
        padding: bool
        others: tuple[Callable[..., Any], ...]
        # The relative conditions of the model's mask function before those that hold on every
        # pair of the call were left out: a full and a sliding layer's masks stay two objects
        # (with tensors of their own) where their conditions coincide, e.g. at a decode step.
        kind: tuple[bool, int | None, int | None] = (False, None, None)

    _made: ClassVar[dict[LocalMask.Structure, LocalMask]] = {}

    @classmethod
    def get(cls, structure: LocalMask.Structure) -> LocalMask:
        if structure.others:  # transformers' closures, new at every build: nothing to keep
            return cls(structure)
        found = cls._made.get(structure)
        if found is None:
            found = cls._made.setdefault(structure, cls(structure))
        return found

    def __init__(self, structure: LocalMask.Structure) -> None:
        self.structure = structure
        self.shift: torch.Tensor | None = None
        self.documents: torch.Tensor | None = None
        self.padding: torch.Tensor | None = None
        self._score_mods: dict[float | None, ScoreMask] = {}
        # Note [Mask tensors rebound, not retraced]: twins' traces and stand-ins, the last binding.
        self._twins: dict[tuple, tuple[TracedMod, tuple[torch.Tensor | None, ...]]] = {}
        self._bound: dict[tuple, tuple[tuple[torch.Tensor | None, ...], TracedMod]] = {}
        self.__name__ = "transformers_mask"

    @property
    def relative(self) -> bool:
        """Whether a condition reads q_idx - kv_idx (causal, a window): tiles it can skip."""
        s = self.structure
        return s.causal or s.window is not None or s.bidirectional_window is not None

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The tensors this mask reads now, in the order of _MASK_TENSORS (None if unused)."""
        return tuple(getattr(self, name) for name in _MASK_TENSORS)

    def __flexfa_trace__(self, fn: LocalMask | ScoreMask, kind: str, device) -> TracedMod:
        """The trace of `fn` (this mask, or one of its score_mods) from its twin's (Note [Mask
        tensors rebound, not retraced])."""
        softcap = fn.softcap if isinstance(fn, ScoreMask) else None
        real = self.tensors()
        if self.structure.others:  # traced as it is: the twin holds the real tensors
            return trace(_twin(self, fn, real), kind, device=device)
        form = tuple(None if t is None else (t.dtype, t.ndim, t.device) for t in real)
        key = (kind, str(device), softcap, form)
        bound = self._bound.get(key)
        if bound is not None and all(a is b for a, b in zip(bound[0], real)):
            return bound[1]
        found = self._twins.get(key)
        if found is None:
            stand_ins = tuple(
                None if t is None else torch.zeros((1,) * t.ndim, dtype=t.dtype, device=t.device)
                for t in real
            )
            twin = trace(_twin(self, fn, stand_ins), kind, device=device)
            found = self._twins[key] = (twin, stand_ins)
        twin, stand_ins = found
        by_id = {id(s): t for s, t in zip(stand_ins, real) if s is not None}
        traced = twin.rebound(tensors=tuple(by_id[id(t)] for t in twin.tensors), fn=fn)
        self._bound[key] = (real, traced)
        return traced

    def as_score_mod(self, softcap: float | None = None) -> ScoreMask:
        """This mask as a score_mod, after an optional softcap; one object per cap."""
        found = self._score_mods.get(softcap)
        if found is None:
            found = self._score_mods.setdefault(softcap, ScoreMask(self, softcap))
        return found

    def __call__(self, b, h, q_idx, kv_idx):
        s = self.structure
        d = q_idx - kv_idx
        if s.shifted:
            d = d + self.shift
        conditions = []
        if s.causal:
            conditions.append(d >= 0)
        if s.window is not None:
            conditions.append(d < s.window)
        if s.bidirectional_window is not None:
            conditions.append((d <= s.bidirectional_window) & (-d <= s.bidirectional_window))
        if s.documents:
            conditions.append(self.documents[b, q_idx] == self.documents[b, kv_idx])
        if s.padding:
            conditions.append(self.padding[b, kv_idx])
        for other in s.others:
            conditions.append(other(b, h, q_idx, kv_idx))
        result = conditions[0]
        for c in conditions[1:]:
            result = result & c
        return result


class ScoreMask:
    """A `LocalMask` as a score_mod: -inf where it excludes a pair (Note [Masks under
    torch.compile and CUDA graphs]), after Gemma 2's softcap when there is one. A callable object
    rather than a closure: torch.compile follows its attributes to the mask's tensors."""

    def __init__(self, mask: LocalMask, softcap: float | None) -> None:
        self.mask = mask
        self.softcap = softcap
        self.__name__ = "transformers_score_mask"

    def __call__(self, score, b, h, q_idx, kv_idx):
        if self.softcap is not None:
            score = self.softcap * torch.tanh(score / self.softcap)
        return torch.where(self.mask(b, h, q_idx, kv_idx), score, -float("inf"))

    def __flexfa_trace__(self, fn: ScoreMask, kind: str, device) -> TracedMod:
        """Its mask's twin, with this softcap (Note [Mask tensors rebound, not retraced])."""
        return self.mask.__flexfa_trace__(fn, kind, device)


class _TwinMask(LocalMask):
    """A LocalMask traced as it is (Note [Mask tensors rebound, not retraced])."""

    __flexfa_trace__ = None


class _TwinScoreMask(ScoreMask):
    __flexfa_trace__ = None


def _twin(mask: LocalMask, fn: LocalMask | ScoreMask, tensors) -> _TwinMask | _TwinScoreMask:
    """A twin of `fn` (`mask` or one of its score_mods) reading `tensors` (see `tensors()`)."""
    twin = _TwinMask(mask.structure)
    for name, tensor in zip(_MASK_TENSORS, tensors, strict=True):
        setattr(twin, name, tensor)
    return _TwinScoreMask(twin, fn.softcap) if isinstance(fn, ScoreMask) else twin


def _absolute(fn, q_offset, kv_offset, device) -> Callable[..., Any]:
    """transformers' own mask function on absolute positions."""
    ints = not isinstance(q_offset, torch.Tensor) and not isinstance(kv_offset, torch.Tensor)
    if ints and q_offset == 0 and kv_offset == 0:
        return fn
    q_shift = _offset_tensor(q_offset, device)
    kv_shift = _offset_tensor(kv_offset, device)

    def absolute(b, h, q_idx, kv_idx):
        return fn(b, h, q_idx + q_shift, kv_idx + kv_shift)

    return absolute


# BlockMasks of masks that read no tensor, by what they depend on (Note [Transformers' masks as
# flexfa masks]): prefill and training at repeated lengths reuse one BlockMask object.
_block_mask_cache: OrderedDict[tuple, BlockMask] = OrderedDict()
_BLOCK_MASK_CACHE_SIZE = 32


def _block_mask(mask_mod: LocalMask, batch: int, len_q: int, len_kv: int, device) -> BlockMask:
    st = mask_mod.structure
    reads_tensor = st.shifted or st.documents or st.padding or bool(st.others)
    key = None
    if not reads_tensor:
        key = (st, len_q, len_kv, str(device))
        found = _block_mask_cache.get(key)
        if found is not None:
            _block_mask_cache.move_to_end(key)
            return found
    per_batch = st.documents or st.padding or bool(st.others)
    bm = flexfa.create_block_mask(
        mask_mod, batch if per_batch else None, None, len_q, len_kv, device=device
    )
    if key is not None:
        _block_mask_cache[key] = bm
        while len(_block_mask_cache) > _BLOCK_MASK_CACHE_SIZE:
            _block_mask_cache.popitem(last=False)
    return bm


_softcaps: dict[float, Callable[..., Any]] = {}


def stable_softcap(cap: float) -> Callable[..., Any]:
    """One softcap score_mod object per cap, so that repeated calls find their traced mod by
    identity (Note [Stable mods])."""
    found = _softcaps.get(cap)
    if found is None:
        found = _softcaps[cap] = softcap_mod(cap)
    return found
