"""Building what flexfa keeps between calls (block masks, decode lists) outside CUDA graph pools.

# Note [Caches under CUDA graphs]
# flexfa keeps GPU tensors between calls: the BlockMask a mask_mod gives for a shape (Note [Block
# mask cache]), a BlockMask moved to another device, the decode path's union lists. Under
# `torch.compile(mode="reduce-overhead")` CUDA graph trees run the compiled graph (and so flexfa's
# custom ops, Note [flexfa under torch.compile]) with every allocation *of the calling thread*
# routed to the graph's private memory pool, first in a warm-up run, then while recording. A cache
# entry built there would be a block of that pool that outlives the call without being one of the
# graph's outputs: the graph trees refuse it ("tensor(s) in the cudagraph pool not tracked as
# outputs"), and rightly so, since a later replay may write over it.
# So on CUDA a cache miss is built by `persistent(...)` on flexfa's one builder thread, on a stream
# of its own: its allocations are ordinary ones, outside any pool. The builder's stream first waits
# for the caller's stream (the mask may read tensors the caller has just written), except while the
# caller's stream is being captured, where a wait would pull the builder into the graph; the caller
# then gets the result only once the builder's stream is done, so no synchronisation is left to the
# caller. A cache hit costs nothing more; a miss costs one thread hop (tens of microseconds) on top
# of the build. A graph records only kernels, so what the builder does on the host (its syncs
# included) never enters a graph; the graph replays the attention kernels with the cached lists.
# A miss while a graph is recorded (a mask whose captured tensors are new at each call) is built
# the same way and its lists become constants of the recorded graph, as the Note on
# torch.compile says.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")

_executor: ThreadPoolExecutor | None = None
_streams: dict[int, torch.cuda.Stream] = {}
_lock = threading.Lock()
_local = threading.local()


def _builder() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flexfa-builder")
        return _executor


def _stream(index: int) -> torch.cuda.Stream:
    stream = _streams.get(index)
    if stream is None:
        stream = _streams[index] = torch.cuda.Stream(device=index)
    return stream


def persistent(device: torch.device, build: Callable[[], T]) -> T:
    """`build()`, run so that the GPU tensors it makes may outlive the call (Note [Caches under
    CUDA graphs]): on flexfa's builder thread for a CUDA device, inline otherwise.

    >>> persistent(torch.device("cpu"), lambda: torch.arange(3)).tolist()
    [0, 1, 2]
    """
    if device.type != "cuda" or getattr(_local, "building", False):
        return build()
    index = device.index if device.index is not None else torch.cuda.current_device()
    caller = torch.cuda.current_stream(index)
    capturing = torch.cuda.is_current_stream_capturing()

    def work() -> T:
        _local.building = True
        try:
            with torch.cuda.device(index):
                stream = _stream(index)
                if not capturing:
                    stream.wait_stream(caller)
                with torch.cuda.stream(stream):
                    result = build()
                stream.synchronize()
                return result
        finally:
            _local.building = False

    return _builder().submit(work).result()
