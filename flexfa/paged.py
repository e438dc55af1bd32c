"""Paged KV caches: K and V in pools of fixed-size pages, read through a page table.

`flexfa.attention(q, k_pages, v_pages, ..., page_table=..., kv_lens=...)` takes
- `k_pages` (num_pages, Hkv, page_size, E) and `v_pages` (num_pages, Hkv, page_size, Ev): pools;
- `page_table` (B, max_pages) int32: logical page j of sequence b is physical page
  `page_table[b, j]`;
- `kv_lens` (B,) int32: sequence b has keys 0 .. kv_lens[b] - 1.

Key `kv_idx` of sequence b lives in page `page_table[b, kv_idx // page_size]` at offset
`kv_idx % page_size`. Mods and block masks see these logical positions, and the call's logical KV
length is the page table's capacity `max_pages * page_size` (a BlockMask must be built for it);
keys at or past `kv_lens[b]` never attend. `PagedKVCache` keeps such a cache for a serving loop.

# Note [Checking page tables]
# An out-of-range page id would read another sequence's keys or unmapped memory, so the values are
# checked: 0 <= kv_lens[b] <= capacity, and every page a sequence uses (j < ceil(kv_lens[b] /
# page_size)) is in [0, num_pages). On a GPU that check costs a reduction and a host sync, so it
# runs once per (page_table, kv_lens) state: the tensors' identities and versions (bumped by every
# in-place write) are remembered, with weak references so that a new tensor reusing a dead one's id
# is checked again. `PagedKVCache` records its own updates as checked: its tables are valid by
# construction, so a decode loop through it never syncs. Entries past a sequence's pages are never
# read (kernels mask those keys before loading), so they may hold anything.
"""

from __future__ import annotations

import collections
import weakref

import torch

from flexfa.spec import PagedKV, check_dtypes

_MAX_CHECKED = 64
_checked: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()


def _state(page_table: torch.Tensor, kv_lens: torch.Tensor, num_pages: int, page_size: int):
    key = (id(page_table), page_table._version, id(kv_lens), kv_lens._version, num_pages, page_size)
    return key, (weakref.ref(page_table), weakref.ref(kv_lens))


def _is_checked(page_table, kv_lens, num_pages: int, page_size: int) -> bool:
    key, _ = _state(page_table, kv_lens, num_pages, page_size)
    refs = _checked.get(key)
    return refs is not None and refs[0]() is page_table and refs[1]() is kv_lens


def mark_checked(page_table, kv_lens, num_pages: int, page_size: int) -> None:
    """Record a (page_table, kv_lens) state as valid (Note [Checking page tables])."""
    key, refs = _state(page_table, kv_lens, num_pages, page_size)
    _checked[key] = refs
    _checked.move_to_end(key)
    while len(_checked) > _MAX_CHECKED:
        _checked.popitem(last=False)


def validate_paged(
    q: object,
    k_pages: object,
    v_pages: object,
    page_table: object,
    kv_lens: object,
    *,
    enable_gqa: bool,
) -> tuple[tuple[int, int, int, int, int, int, int], PagedKV]:
    """Check a paged call; returns ((B, Hq, Hkv, Lq, capacity, E, Ev), PagedKV).

    Raises ValueError/TypeError naming the argument (Note [Checking page tables])."""
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            what = (
                "(batch, heads, seq_len, head_dim)"
                if name == "q"
                else "(num_pages, heads, page_size, head_dim)"
            )
            raise ValueError(f"{name} must have 4 dims {what}, got shape {tuple(t.shape)}")
    for name, t, ndim in (("page_table", page_table, 2), ("kv_lens", kv_lens, 1)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32 or t.ndim != ndim:
            shape = "(B, max_pages)" if ndim == 2 else "(B,)"
            raise ValueError(
                f"{name} must be an int32 tensor of shape {shape}, got {t.dtype} of shape "
                f"{tuple(t.shape)}"
            )
    assert isinstance(q, torch.Tensor) and isinstance(k_pages, torch.Tensor)
    assert isinstance(v_pages, torch.Tensor) and isinstance(page_table, torch.Tensor)
    assert isinstance(kv_lens, torch.Tensor)
    check_dtypes(q, k_pages, v_pages, kv="k_pages and v_pages")  # Note [fp8 K/V]
    devices = {t.device for t in (q, k_pages, v_pages, page_table, kv_lens)}
    if len(devices) != 1:
        raise ValueError(
            f"q, k_pages, v_pages, page_table and kv_lens must be on one device, got {devices}"
        )
    B, Hq, Lq, E = q.shape
    num_pages, Hkv, page_size, Ek = k_pages.shape
    if tuple(v_pages.shape[:3]) != (num_pages, Hkv, page_size):
        raise ValueError(
            f"v_pages must have k_pages' pages, heads and page size, got k_pages "
            f"{tuple(k_pages.shape)} and v_pages {tuple(v_pages.shape)}"
        )
    Ev = v_pages.shape[3]
    if Ek != E:
        raise ValueError(f"k_pages' head dim ({Ek}) must equal q's ({E})")
    if page_table.shape[0] != B or kv_lens.shape[0] != B:
        raise ValueError(
            f"page_table {tuple(page_table.shape)} and kv_lens {tuple(kv_lens.shape)} must have "
            f"q's batch size {B} as their first dim"
        )
    if num_pages < 1 or page_table.shape[1] < 1 or page_size < 1:
        raise ValueError("k_pages must hold at least one page and page_table at least one column")
    if Lq < 1 or Hq < 1:
        raise ValueError("q's length and number of heads must be at least 1")
    if E < 8 or Ev < 8:
        raise ValueError(f"head dims must be at least 8, got E={E} for q/k and Ev={Ev} for v")
    if Hq != Hkv:
        if not enable_gqa:
            raise ValueError(
                f"q has {Hq} heads but k_pages/v_pages have {Hkv}; pass enable_gqa=True for "
                "grouped-query attention"
            )
        if Hq % Hkv:
            raise ValueError(
                f"with enable_gqa=True, q's heads ({Hq}) must be a multiple of the pools' ({Hkv})"
            )
    paged = PagedKV(page_table, kv_lens, page_size, num_pages)
    ensure_checked(paged)
    return (B, Hq, Hkv, Lq, paged.capacity, E, Ev), paged


def ensure_checked(paged: PagedKV) -> None:
    """Check the values of a call's page table and lengths unless this state was checked (Note
    [Checking page tables]); raises ValueError naming the bad entry."""
    if not _is_checked(paged.page_table, paged.kv_lens, paged.num_pages, paged.page_size):
        _check_values(paged)
        mark_checked(paged.page_table, paged.kv_lens, paged.num_pages, paged.page_size)


def _check_values(paged: PagedKV) -> None:
    lens = paged.kv_lens
    used = torch.arange(paged.max_pages, device=lens.device) * paged.page_size < lens[:, None]
    bad_page = used & ((paged.page_table < 0) | (paged.page_table >= paged.num_pages))
    bad_len = (lens < 0) | (lens > paged.capacity)
    flags = torch.stack([bad_len.any(), bad_page.any()]).tolist()
    if flags[0]:
        b = int(torch.nonzero(bad_len)[0, 0])
        raise ValueError(
            f"kv_lens[{b}] = {int(lens[b])} is outside [0, {paged.capacity}] (page_table has "
            f"{paged.max_pages} pages of {paged.page_size} per sequence)"
        )
    if flags[1]:
        b, j = (int(x) for x in torch.nonzero(bad_page)[0])
        raise ValueError(
            f"page_table[{b}, {j}] = {int(paged.page_table[b, j])} is not a page of the pools "
            f"(expected 0 <= page < {paged.num_pages}); sequence {b} uses its first "
            f"{-(-int(lens[b]) // paged.page_size)} pages"
        )


class PagedKVCache:
    """A paged KV cache for a serving loop: page pools, a page table and lengths, kept valid.

    Pages come from a free list; `reserve` maps pages for coming tokens, `append` writes one step's
    keys and values (reserving as needed), `free` returns a sequence's pages, and `attention` runs
    `flexfa.attention` over the cache.

    >>> import torch, flexfa
    >>> cache = flexfa.PagedKVCache(num_pages=8, batch=2, heads_kv=2, page_size=16, head_dim=32)
    >>> k = v = torch.randn(2, 2, 20, 32)  # a 20-token prompt for both sequences
    >>> cache.append(k, v)
    >>> cache.kv_lens.tolist(), cache.pages_in_use
    ([20, 20], 4)
    >>> q = torch.randn(2, 4, 1, 32)
    >>> out = cache.attention(q, enable_gqa=True)
    >>> out.shape
    torch.Size([2, 4, 1, 32])
    >>> cache.free(0)
    >>> cache.kv_lens.tolist(), cache.pages_in_use
    ([0, 20], 2)
    """

    def __init__(
        self,
        num_pages: int,
        batch: int,
        heads_kv: int,
        page_size: int,
        head_dim: int,
        head_dim_v: int | None = None,
        *,
        max_pages_per_seq: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_pages", num_pages),
            ("batch", batch),
            ("heads_kv", heads_kv),
            ("page_size", page_size),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        max_pages = num_pages if max_pages_per_seq is None else max_pages_per_seq
        self.page_size = page_size
        self.k_pages = torch.zeros(
            num_pages, heads_kv, page_size, head_dim, dtype=dtype, device=device
        )
        self.v_pages = torch.zeros(
            num_pages, heads_kv, page_size, head_dim_v, dtype=dtype, device=device
        )
        self.page_table = torch.zeros(batch, max_pages, dtype=torch.int32, device=device)
        self.kv_lens = torch.zeros(batch, dtype=torch.int32, device=device)
        # Host mirrors, so that bookkeeping never reads the device.
        self._lens = [0] * batch
        self._pages: list[list[int]] = [[] for _ in range(batch)]
        self._free = list(range(num_pages - 1, -1, -1))
        self._mark()

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free)

    def _mark(self) -> None:
        mark_checked(self.page_table, self.kv_lens, self.num_pages, self.page_size)

    def reserve(self, seq: int, tokens: int) -> None:
        """Map pages so that sequence `seq` can take `tokens` more keys."""
        need = -(-(self._lens[seq] + tokens) // self.page_size)
        if need > self.page_table.shape[1]:
            raise ValueError(
                f"sequence {seq} would need {need} pages; the page table holds "
                f"{self.page_table.shape[1]} per sequence"
            )
        new = need - len(self._pages[seq])
        if new <= 0:
            return
        if new > len(self._free):
            raise RuntimeError(
                f"out of pages: sequence {seq} needs {new} more, {len(self._free)} are free"
            )
        pages = [self._free.pop() for _ in range(new)]
        start = len(self._pages[seq])
        self._pages[seq].extend(pages)
        self.page_table[seq, start : start + new] = torch.tensor(pages, dtype=torch.int32)
        self._mark()

    def append(self, k: torch.Tensor, v: torch.Tensor, seqs: list[int] | None = None) -> None:
        """Append keys k (n, Hkv, T, E) and values v (n, Hkv, T, Ev) to sequences `seqs` (all
        by default, n = batch), after their current keys."""
        seqs = list(range(len(self._lens))) if seqs is None else list(seqs)
        if k.ndim != 4 or v.ndim != 4 or k.shape[0] != len(seqs) or v.shape[:3] != k.shape[:3]:
            raise ValueError(
                f"k and v must be (len(seqs)={len(seqs)}, Hkv, T, E|Ev), got {tuple(k.shape)} "
                f"and {tuple(v.shape)}"
            )
        T = k.shape[2]
        pages, offsets = [], []
        for seq in seqs:
            self.reserve(seq, T)
            for pos in range(self._lens[seq], self._lens[seq] + T):
                pages.append(self._pages[seq][pos // self.page_size])
                offsets.append(pos % self.page_size)
        dev = self.k_pages.device
        page_idx = torch.tensor(pages, device=dev)
        off_idx = torch.tensor(offsets, device=dev)
        # [n, Hkv, T, E] -> [n * T, Hkv, E], rows in the order of (page_idx, off_idx).
        self.k_pages[page_idx, :, off_idx] = (
            k.transpose(1, 2).reshape(-1, *k.shape[1:2], k.shape[3]).to(self.k_pages.dtype)
        )
        self.v_pages[page_idx, :, off_idx] = (
            v.transpose(1, 2).reshape(-1, *v.shape[1:2], v.shape[3]).to(self.v_pages.dtype)
        )
        for seq in seqs:
            self._lens[seq] += T
        self.kv_lens.copy_(torch.tensor(self._lens, dtype=torch.int32))
        self._mark()

    def free(self, seq: int) -> None:
        """Return sequence `seq`'s pages to the free list and set its length to 0."""
        self._free.extend(reversed(self._pages[seq]))
        self._pages[seq] = []
        self._lens[seq] = 0
        self.kv_lens[seq] = 0
        self._mark()

    def attention(self, q: torch.Tensor, score_mod=None, block_mask=None, **kwargs):
        """`flexfa.attention(q, k_pages, v_pages, score_mod, block_mask, page_table=...,
        kv_lens=..., **kwargs)` over this cache."""
        from flexfa.api import attention

        return attention(
            q,
            self.k_pages,
            self.v_pages,
            score_mod,
            block_mask,
            page_table=self.page_table,
            kv_lens=self.kv_lens,
            **kwargs,
        )
