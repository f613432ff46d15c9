"""Where vLLM's block pool holds a state of one prefix: one page of each
state group, indexed under the hash of the prefix it follows. The prompt-end
holds, the release and the floors ask; one object per scheduler keeps the
pool, the groups and the prefix index's key suffix, so each question is a
few dict lookups.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..core.eviction import highest_states_at_or_below
from . import private_api

# How far below each top (in state pages) `highest_at_or_below` looks.
SEARCH_PAGES = 64


class StateSearch:
    def __init__(self, pool, state_groups: Sequence[int], hash_unit: int, page: int) -> None:
        self.pool = pool
        self.groups = list(state_groups)
        self.hash_unit = hash_unit
        self.page = page
        # None: the pool's index is not the plain dict the filter reads
        self._suffix = private_api.index_key_suffix(pool, self.groups[0])

    def states_at(self, block_hashes: Sequence, pos: int) -> Optional[list]:
        """Every state group's page of the state after `pos` tokens of this
        prefix (`pos` a multiple of the hash unit), or None."""
        i = pos // self.hash_unit - 1
        if i >= len(block_hashes):
            return None
        hit = self.pool.get_cached_block(block_hashes[i], self.groups)
        if hit is not None and all(b.block_hash_num_tokens == pos for b in hit):
            return hit
        return None

    def probe(self, block_hashes: Sequence) -> Callable[[int], Optional[list]]:
        """`states_at` for this prefix as one call a position, behind a cheap
        filter: where the first state group certainly indexes no state
        after `pos` tokens (one dict membership, as in
        AtomStateManager.find_longest_cache_hit) it answers None without
        vLLM's lookup. A release's walk probes ~90 positions."""
        unit, n = self.hash_unit, len(block_hashes)
        suffix = self._suffix
        index = private_api.prefix_index(self.pool) if suffix is not None else None

        def state_at(pos: int) -> Optional[list]:
            i = pos // unit - 1
            if i >= n or (index is not None and block_hashes[i] + suffix not in index):
                return None
            return self.states_at(block_hashes, pos)
        return state_at

    def highest_at_or_below(self, block_hashes: Sequence, tops,
                            max_pages: int = SEARCH_PAGES) -> list[tuple[int, list]]:
        """[(position, pages of every state group)]: for each of `tops`, the
        highest position <= it where every state group indexes a state of
        this prefix; each position once, highest first. A walk looks at
        every hash unit of the page below its top (prompt-end states sit
        between pages), then at page boundaries only (where chunk ends put
        most other states), at most `max_pages` pages down."""
        return highest_states_at_or_below(tops, self.hash_unit, self.page, max_pages,
                                          self.probe(block_hashes))

    def positions(self, block_hashes: Sequence, end: int) -> list[int]:
        """Every hash-unit boundary below `end` where a state of this prefix
        is indexed, lowest first (a walk of the whole prefix: diagnostics)."""
        state_at = self.probe(block_hashes)
        return [pos for pos in range(self.hash_unit, end, self.hash_unit)
                if state_at(pos) is not None]
