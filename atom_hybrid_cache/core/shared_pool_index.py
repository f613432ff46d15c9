"""Where the planner's model of the plugin (`shared_pool_manager`) files
pages in its one pool, and the lookups vLLM makes there.

The keys are vLLM's: a KV page under the hash of its last hash unit;
vLLM's partial KV entry (a prompt's last hash-unit boundary inside a page)
and each state group's page under the same hash with a salt of its own.
A hit is the longest prefix whose KV pages are indexed (whole pages, then
the partial entry) and ending on a state of every group.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .eviction import SEARCH_PAGES, highest_states_at_or_below
from .page_pool import PagePool

_PARTIAL_SALT = 0x5A17_0000_0000_0001
_STATE_SALT = 0x3C3C_0000_0000_0000


class SharedPoolIndex:
    def __init__(self, pool: PagePool, page_tokens: int, hash_unit: int,
                 pages_per_state: int) -> None:
        self.pool = pool
        self.page = page_tokens
        self.unit = hash_unit
        self.sub = page_tokens // hash_unit
        self._state_salts = [_STATE_SALT + g for g in range(pages_per_state)]

    def state_keys(self, h: int) -> list:
        """Each state group's key of the state filed under hash `h`."""
        return [h ^ s for s in self._state_salts]

    @staticmethod
    def partial_key(h: int) -> int:
        """The key of vLLM's partial KV entry under hash `h`."""
        return h ^ _PARTIAL_SALT

    def state_at(self, hashes: Sequence, pos: int) -> Optional[list]:
        """Every group's page of the state after `pos` tokens, or None."""
        i = pos // self.unit - 1
        if i < 0 or i >= len(hashes):
            return None
        lookup = self.pool.lookup
        pages = []
        for k in self.state_keys(hashes[i]):
            p = lookup(k)
            if p is None:
                return None
            pages.append(p)
        return pages

    def kv_prefix(self, hashes: Sequence, limit: int) -> tuple[list, int, Optional[int]]:
        """(full KV pages from the start, tokens the KV reaches, the page of
        vLLM's partial entry if the reach ends on one) within `limit` tokens."""
        P, U, sub = self.page, self.unit, self.sub
        lookup = self.pool.lookup
        pages = []
        while (len(pages) + 1) * P <= limit and (len(pages) + 1) * sub <= len(hashes):
            p = lookup(hashes[(len(pages) + 1) * sub - 1])
            if p is None:
                break
            pages.append(p)
        reach = len(pages) * P
        first = len(pages) * sub
        for f in range(min(first + sub - 1, limit // U, len(hashes)) - 1, first - 1, -1):
            p = lookup(self.partial_key(hashes[f]))
            if p is not None:
                return pages, (f + 1) * U, p
        return pages, reach, None

    def state_hit(self, hashes: Sequence, reach: int) -> tuple[int, Optional[list]]:
        """The highest hash-unit boundary at or below `reach` with a state."""
        U = self.unit
        for pos in range(reach // U * U, 0, -U):
            pages = self.state_at(hashes, pos)
            if pages is not None:
                return pos, pages
        return 0, None

    def highest_states_at_or_below(self, hashes: Sequence, tops,
                                   max_pages: int = SEARCH_PAGES) -> list:
        """vllm/state_search.StateSearch.highest_at_or_below over this pool."""
        return highest_states_at_or_below(tops, self.unit, self.page, max_pages,
                                          lambda pos: self.state_at(hashes, pos))
