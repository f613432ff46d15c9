"""One pool of pages with vLLM's free order: what the plugin's KV pages and
state pages share inside vLLM (its `BlockPool`).

Why a pool of its own next to `kv_pool.KVBlockPool`: vLLM keeps ONE free
queue, and a new page always comes from its head, evicting what the head
page held. A freed page with indexed content joins the tail, one without
goes to the head (`BlockPool.free_blocks`: reused first), each batch in the
order given; so the order a request frees its cached pages in is the order
they are evicted in. Page 0 is the null page, never handed out.

A page may be indexed under several keys (vLLM's partial-tail entries sit on
a page that may later hold a full block's hash too), and a key on several
pages: two requests that computed the same block both index it, as vLLM
does, so the content stays findable while either page holds it. Keys are
opaque ints.

With a price weight the plugin's free order is priced
(`priced_eviction.PricedFreeOrder`, which the adapter puts in vLLM's
`BlockPool`); without, vLLM's FIFO (`FifoFreeOrder`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Optional, Sequence

from .priced_eviction import PricedFreeOrder

NULL_PAGE = 0


class FifoFreeOrder(OrderedDict):
    """vLLM's free queue (`FreeKVCacheBlockQueue`), in the operations of
    `PricedFreeOrder`: the head is handed out next."""

    def push_front(self, pages: Sequence[int]) -> None:
        for p in reversed(pages):
            self[p] = None
            self.move_to_end(p, last=False)

    def push_back(self, pages: Sequence[int]) -> None:
        for p in pages:
            self[p] = None

    def remove(self, page: int) -> None:
        del self[page]

    def pop_n(self, n: int) -> list[int]:
        return [self.popitem(last=False)[0] for _ in range(n)]

    def set_prices(self, pages, priced_spans) -> None:
        """A FIFO ignores prices."""

    def in_order(self) -> list[int]:
        return list(self)


class PagePool:
    def __init__(self, num_pages: int, on_evict: Optional[Callable[[int], None]] = None,
                 price_weight: float = 0.0) -> None:
        """`num_pages`: vLLM's num_gpu_blocks, the null page included;
        `on_evict(key)`: an indexed key left the index because its page was
        handed out again; `price_weight` > 0: the priced free order (or
        from `set_price_weight` on)."""
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (page 0 is the null page), "
                             f"got {num_pages}")
        self.num_pages = num_pages
        self.ref_cnt = [0] * num_pages
        self.page_keys: list[Optional[list]] = [None] * num_pages
        # key -> {page: None}, first indexed first
        self.index: dict[int, dict] = {}
        # handed out next first
        pages = range(1, num_pages)
        self.free_order = (PricedFreeOrder(num_pages, pages, price_weight) if price_weight > 0
                           else FifoFreeOrder((p, None) for p in pages))
        self.on_evict = on_evict
        self.evicted_keys = 0

    @property
    def priced(self) -> bool:
        """Whether a release's prices order the free pages now."""
        return self.priced_order and self.free_order.weight > 0

    @property
    def priced_order(self) -> bool:
        """Whether the free order is the priced one (at any weight)."""
        return isinstance(self.free_order, PricedFreeOrder)

    def set_price_weight(self, weight: float) -> None:
        """The priced order's weight from now on. A FIFO turns priced at
        the first weight > 0, its free pages first in their order, as
        `vllm/priced_free_queue.install` turns vLLM's queue."""
        if self.priced_order:
            self.free_order.weight = weight
        elif weight > 0:
            self.free_order = PricedFreeOrder(self.num_pages, list(self.free_order), weight)

    @property
    def num_free(self) -> int:
        return len(self.free_order)

    def lookup(self, key: int) -> Optional[int]:
        """The first page indexed under `key` that still holds it, or None."""
        pages = self.index.get(key)
        return None if pages is None else next(iter(pages))

    def allocate(self, n: int) -> list[int]:
        """n pages from the head of the free queue, each with one reference;
        what they held leaves the index."""
        if n > len(self.free_order):
            raise MemoryError(f"page pool: asked for {n} pages, {len(self.free_order)} free")
        out = self.free_order.pop_n(n)
        for p in out:
            self._drop_keys(p, evicted=True)
            self.ref_cnt[p] = 1
        return out

    def touch(self, pages: Iterable[int]) -> None:
        """Take a reference (a hit on a free cached page takes it out of the
        free queue)."""
        rc = self.ref_cnt
        for p in pages:
            if rc[p] == 0:
                self.free_order.remove(p)
            rc[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop a reference. Pages whose last reference goes return in the
        order given (first given, first evicted): those holding indexed
        content to the tail of the free queue, the others to its head."""
        rc = self.ref_cnt
        first = []
        last = []
        for p in pages:
            if p == NULL_PAGE:
                continue
            n = rc[p] - 1
            if n < 0:
                raise AssertionError(f"page {p} freed more often than taken")
            rc[p] = n
            if n == 0:
                if self.page_keys[p] is None:
                    first.append(p)
                else:
                    last.append(p)
        self.free_order.push_front(first)
        self.free_order.push_back(last)

    def index_page(self, page: int, key: int) -> bool:
        """Index `page` under `key`; False when this page already holds it."""
        if page == NULL_PAGE:
            raise AssertionError("the null page is never indexed")
        pages = self.index.setdefault(key, {})
        if page in pages:
            return False
        pages[page] = None
        keys = self.page_keys[page]
        if keys is None:
            self.page_keys[page] = [key]
        else:
            keys.append(key)
        return True

    def unindex(self, page: int, key: Optional[int] = None) -> None:
        """Take `page` out of the index under `key` (every key: None), as
        vLLM's `BlockPool.evict_blocks` does; not an eviction."""
        keys = self.page_keys[page]
        if keys is None:
            return
        if key is None or keys == [key]:
            self._drop_keys(page, evicted=False)
        elif key in keys:
            keys.remove(key)
            pages = self.index[key]
            del pages[page]
            if not pages:
                del self.index[key]

    def is_indexed(self, page: int) -> bool:
        return self.page_keys[page] is not None

    def _drop_keys(self, page: int, evicted: bool) -> None:
        keys = self.page_keys[page]
        if keys is None:
            return
        self.page_keys[page] = None
        for k in keys:
            pages = self.index[k]
            del pages[page]
            if pages:
                continue   # another page still holds the content
            del self.index[k]
            if evicted:
                self.evicted_keys += 1
                if self.on_evict is not None:
                    self.on_evict(k)
