"""Priced eviction: a freed page stays in the free queue longer the more a
resume would recompute without it.

vLLM's free queue is a FIFO: a page freed with indexed content leaves
after every page freed before it. Where one checkpoint costs a large share
of a small pool, that order decides which resumes keep their state, and it
treats a unit whose loss costs a resume a whole conversation like one whose
loss costs a page. This is GreedyDual-Size over a release's units
(`eviction.py`), with the FIFO's clock:

- a page freed with indexed content gets the key `clock + weight * price`,
  where `clock` counts the pages handed out before it was freed and
  `price` is its unit's (`span_prices`), rounded to whole pages;
- the weight is set in pool traversals (`pages_per_token`): a unit whose
  loss would cost a resume a whole page of tokens per page stays the
  setting times the pool's pages longer, in a pool of any size or page;
- pages without indexed content go first, as in vLLM (`push_front`);
- the page with the smallest key is handed out next; equal keys, the one
  freed first. At weight 0 that is vLLM's FIFO.

The clock counts pages handed out, not pages freed: a page freed and
taken again before anything is handed out (vLLM's scheduler pins and
unpins prefixes so within a step) then moves no other page's key, and the
planner's model, which does not make those moves, keeps vLLM's order.

A unit's price is the tokens a resume at its state would recompute if the
unit were gone, down to the state below, over the unit's pages: what each
of its pages buys. It is raised to the price of the unit above, so that a
prefix still leaves from the top. KV above every state buys nothing (no
resume can read it): price 0. Weight 0 is vLLM's order.

A page freed again (a hold given back, a floor) keeps the price its last
release gave it; it loses it when it is handed out.

Where it pays: in small pools. Measured (BENCHMARKS.md, "Priced
eviction"), it gains where a request slot's share of the pool holds few
checkpoints, the pool churns within a conversation's turns and a unit's
price tells which resumes the churn will cost, and it loses in larger pools
(from about 100 checkpoints' worth a slot), where the FIFO already keeps a
conversation's units and the prices only reorder what ages out. So
`auto` (the default) prices where a slot's share is under the line the
insurance states are on above (`pool_budget.MIN_SLOT_CHECKPOINTS`), and
fades out above it: AUTO_PRICE_WEIGHT at the line falling in a straight
line to none at PRICE_FADE_END_CHECKPOINTS a slot. A share just above the
line holds the round with a few pages to spare under native and the
insurance states take them (BENCHMARKS.md, "The knee"): the prices then
decide which unit a cut takes, where the FIFO takes the oldest whatever it
costs.

Pages are ints (vLLM's block ids in the adapter, `vllm/priced_free_queue.py`;
the planner's pages in `page_pool.PagePool`): one order for both.
"""

from __future__ import annotations

from collections import OrderedDict
from heapq import heappop, heappush, heapreplace
from typing import Iterable, Optional, Sequence

from .pool_budget import MIN_SLOT_CHECKPOINTS, past_line

# `_where[page]` of a page at the head end (no indexed content)
_FRONT = -1

# ATOM_EVICTION_PRICE_WEIGHT=auto where a request slot's share of the pool
# holds up to MIN_SLOT_CHECKPOINTS checkpoints' worth
AUTO_PRICE_WEIGHT = 0.25
# ... falling to none at this share (checkpoints' worth a slot)
PRICE_FADE_END_CHECKPOINTS = 120


def resolved_weight(setting: Optional[float], kv_share_tokens: int,
                    checkpoint_kv_tokens: int) -> float:
    """The weight a pool runs: `setting`, or for auto (None)
    AUTO_PRICE_WEIGHT where a request slot's share (`kv_share_tokens`)
    holds at most MIN_SLOT_CHECKPOINTS checkpoints of
    `checkpoint_kv_tokens`, none from PRICE_FADE_END_CHECKPOINTS, a
    straight line between (none where a checkpoint's cost is unknown)."""
    if setting is not None:
        return float(setting)
    return AUTO_PRICE_WEIGHT * (1.0 - past_line(kv_share_tokens, checkpoint_kv_tokens,
                                                PRICE_FADE_END_CHECKPOINTS - MIN_SLOT_CHECKPOINTS))


def pages_per_token(setting: float, num_pages: int, page_tokens: int) -> float:
    """`PricedFreeOrder`'s weight for `ATOM_EVICTION_PRICE_WEIGHT` =
    `setting` in a pool of `num_pages` pages of `page_tokens` tokens: a
    price of a whole page (every token of each page recomputed) buys
    `setting` times the pool's pages of life. (An absolute weight would
    make a unit outlive many traversals of a small pool, and none of a
    large one.)"""
    return setting * num_pages / page_tokens


def span_prices(spans: Sequence[tuple]) -> list[tuple]:
    """[(start, stop, price)] for a release's spans (`eviction.freed_order`'s
    `spans`: (start, stop, position) of each unit, top first, position None
    for the KV above every state): a unit's price is the tokens between its
    state and the next lower one over its pages, at least the unit
    above's."""
    units = [s for s in spans if s[2] is not None]
    out = [(a, b, 0.0) for a, b, pos in spans if pos is None]
    price = 0.0
    for i, (a, b, pos) in enumerate(units):
        lower = units[i + 1][2] if i + 1 < len(units) else 0
        price = max(price, (pos - lower) / max(1, b - a))
        out.append((a, b, price))
    return out


class PricedFreeOrder:
    """The free pages, smallest key first (see the module).

    Pages with one rounded price share a class, a FIFO (an OrderedDict of
    page -> clock when freed): within it the keys rise, so only the
    classes' heads are compared, in a heap. A heap entry whose class head
    has moved on (its head taken by a hit) is refiled when it surfaces."""

    def __init__(self, num_pages: int, pages: Iterable[int], weight: float) -> None:
        """`pages`: the free pages at start, without indexed content, handed
        out in this order."""
        if weight < 0:
            raise ValueError(f"a price weight is >= 0, got {weight!r}")
        self.weight = weight
        # tokens recomputed per page, set by a release, cleared when handed out
        self.price = [0.0] * num_pages
        self._where: list = [None] * num_pages     # _FRONT, a class's offset, None
        self._front: OrderedDict = OrderedDict()
        self._classes: dict[int, OrderedDict] = {}
        self._heads: list = []                      # (key, -offset)
        self._head_key: dict[int, int] = {}         # offset -> key of its live entry
        self._clock = 0
        self._len = 0
        self.push_front(list(pages))

    def __len__(self) -> int:
        return self._len

    def __contains__(self, page: int) -> bool:
        return self._where[page] is not None

    def set_prices(self, pages: Sequence[int], priced_spans: Iterable[tuple]) -> None:
        """pages[start:stop] cost `price` each, for (start, stop, price) in
        `priced_spans` (`span_prices`)."""
        price = self.price
        for a, b, v in priced_spans:
            for p in pages[a:b]:
                price[p] = v

    def push_front(self, pages: Sequence[int]) -> None:
        """Pages without indexed content: handed out before any other, the
        first given first (vLLM's `prepend_n`)."""
        front, where = self._front, self._where
        for p in reversed(pages):
            front[p] = None
            front.move_to_end(p, last=False)
            where[p] = _FRONT
        self._len += len(pages)

    def push_back(self, pages: Sequence[int]) -> None:
        """Pages with indexed content, in the order freed, each behind the
        pages freed before it by its price."""
        w, t = self.weight, self._clock
        price, where, classes = self.price, self._where, self._classes
        for p in pages:
            off = int(w * price[p] + 0.5)
            cls = classes.get(off)
            if cls is None:
                cls = classes[off] = OrderedDict()
                self._head_key[off] = t + off
                heappush(self._heads, (t + off, -off))
            cls[p] = t
            where[p] = off
        self._len += len(pages)

    def remove(self, page: int) -> None:
        """Take a free page out (a hit on it)."""
        off = self._where[page]
        if off is None:
            raise KeyError(f"page {page} is not free")
        self._where[page] = None
        self._len -= 1
        if off == _FRONT:
            del self._front[page]
            return
        cls = self._classes[off]
        del cls[page]
        if not cls:
            del self._classes[off]
            del self._head_key[off]

    def pop_n(self, n: int) -> list[int]:
        """The next n pages to hand out, their prices cleared."""
        if n > self._len:
            raise ValueError(f"{n} pages asked for, {self._len} free")
        front = self._front
        if n == 1:
            # (vLLM's state groups ask for one page at a time: most calls;
            # one page is no run, so no look at the next class)
            if front:
                page = front.popitem(last=False)[0]
            else:
                off, neg, cls = self._head_class()
                page = cls.popitem(last=False)[0]
                self._refile(off, neg, cls)
            self._where[page] = None
            self.price[page] = 0.0
            self._len -= 1
            self._clock += 1
            return [page]
        out: list[int] = []
        while front and len(out) < n:
            out.append(front.popitem(last=False)[0])
        heads = self._heads
        while len(out) < n:
            off, neg, cls = self._head_class()
            # a run from this class while it stays at or below the next
            # class's head, the least of the root's children (a stale entry
            # there only ends the run early): the last base that may go
            if len(heads) > 2:
                next_key, next_neg = min(heads[1], heads[2])
            elif len(heads) == 2:
                next_key, next_neg = heads[1]
            else:
                next_key, next_neg = None, 0
            last = None if next_key is None else next_key - off - (neg > next_neg)
            popitem = cls.popitem
            while len(out) < n and cls:
                page, base = popitem(last=False)
                if last is not None and base > last:
                    # past the next head: back where it was (once a run)
                    cls[page] = base
                    cls.move_to_end(page, last=False)
                    break
                out.append(page)
            self._refile(off, neg, cls)
        where, price = self._where, self.price
        for p in out:
            where[p] = None
            price[p] = 0.0
        self._len -= n
        self._clock += n
        return out

    def _head_class(self) -> tuple:
        """(offset, its heap sign, the class) with the smallest key, its
        entry at the heap's root; stale entries on the way dropped (a class
        emptied or refiled since) or refiled (its head taken by a hit)."""
        heads, classes, head_key = self._heads, self._classes, self._head_key
        while True:
            key, neg = heads[0]
            off = -neg
            if head_key.get(off) != key:
                heappop(heads)
                continue
            cls = classes[off]
            base = next(iter(cls.values()))
            if base + off == key:
                return off, neg, cls
            head_key[off] = base + off
            heapreplace(heads, (base + off, neg))

    def _refile(self, off: int, neg: int, cls: OrderedDict) -> None:
        """The root entry of class `off` after pages left its front: at its
        new head's key, or gone with the class."""
        if cls:
            key = next(iter(cls.values())) + off
            self._head_key[off] = key
            heapreplace(self._heads, (key, neg))
        else:
            heappop(self._heads)
            del self._classes[off]
            del self._head_key[off]

    def in_order(self) -> list[int]:
        """Every free page, next handed out first (for tests and vLLM's
        `get_all_free_blocks`; sorts)."""
        rest = sorted((base + off, base, i, p) for off, cls in self._classes.items()
                      for i, (p, base) in enumerate(cls.items()))
        return list(self._front) + [e[-1] for e in rest]

    def key(self, page: int) -> Optional[int]:
        """A free page's key (None at the head end or not free)."""
        off = self._where[page]
        if off is None or off == _FRONT:
            return None
        return self._classes[off][page] + off
