"""Where vLLM's block pool holds a state of one prefix: one page of each
state group, indexed under the hash of the prefix it follows. The prompt-end
holds, the release and the floors ask; one object per scheduler keeps the
pool, the groups and the prefix index's key suffix, so each question is a
few dict lookups.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..core.eviction import SEARCH_PAGES, highest_states_at_or_below
from . import state_hashes
from .attention_lookup import one_block
from .state_hashes import StateHashes, first_at_or_below


class StateSearch:
    def __init__(self, pool, state_groups: Sequence[int], hash_unit: int, page: int) -> None:
        self.pool = pool
        self.groups = list(state_groups)
        self.hash_unit = hash_unit
        self.page = page
        # the hashes the first state group indexes a state under (the filter),
        # and the pool's watcher, whose mirror of each group's entries the
        # reads use
        self.hashes = StateHashes(pool, self.groups[0])
        self._watch = self.hashes.watch
        # (the watch's generation, the reader) as last made: a walk a
        # request (the floors, the release) then asks the watch one
        # question, not a dozen
        self._read: Optional[tuple] = None

    def _kept(self) -> tuple:
        """(kept hashes or None, their positions or None, the reader) as
        the watch keeps them now (rewrapped after a reset)."""
        hashes, positions = state_hashes.kept_of_pool(self.pool, self.groups[0])
        made = self._read
        if made is None or made[0] != self._watch.generation:
            made = self._read = (self._watch.generation, self._reader())
        return hashes, positions, made[1]

    def states_at(self, block_hashes: Sequence, pos: int) -> Optional[list]:
        """Every state group's page of the state after `pos` tokens of this
        prefix (`pos` a multiple of the hash unit), or None."""
        i = pos // self.hash_unit - 1
        if i >= len(block_hashes):
            return None
        return self._kept()[2](block_hashes[i], pos)

    def _reader(self) -> Callable[[object, int], Optional[list]]:
        """(block hash, pos) -> every state group's page of the state after
        `pos` tokens filed under that hash, or None: vLLM's
        `get_cached_block` and a check of each page's position, as one read
        of each group's mirror of the prefix index (`prefix_index_watch`;
        a state walk asks a few a step, each through a key built per group
        and two calls a page in vLLM's)."""
        watch = self._watch
        mirrors = [watch.mirror(g) for g in self.groups]
        if None in mirrors:
            pool, groups = self.pool, self.groups

            def read(block_hash, pos: int) -> Optional[list]:
                hit = pool.get_cached_block(block_hash, groups)
                if hit is not None and all(b.block_hash_num_tokens == pos for b in hit):
                    return hit
                return None
            return read
        gets = [entries.get for entries in mirrors]

        def read(block_hash, pos: int) -> Optional[list]:
            out = []
            for get in gets:
                b = one_block(get(block_hash))   # filed twice: vLLM's first
                if b is None or b.block_hash_num_tokens != pos:
                    return None
                out.append(b)
            return out
        return read

    def probe(self, block_hashes: Sequence, kept: Optional[tuple] = None
              ) -> Callable[[int], Optional[list]]:
        """`states_at` for this prefix as one call a position, behind a cheap
        filter: where the first state group certainly indexes no state
        after `pos` tokens (one set membership, `StateHashes`) it answers
        None without vLLM's lookup. `kept`: `_kept()`'s answer, if the
        caller took it already."""
        unit, n = self.hash_unit, len(block_hashes)
        hashes, _, read = kept if kept is not None else self._kept()

        def state_at(pos: int) -> Optional[list]:
            i = pos // unit - 1
            if i >= n or (hashes is not None and block_hashes[i] not in hashes):
                return None
            return read(block_hashes[i], pos)
        return state_at

    def highest_at_or_below(self, block_hashes: Sequence, tops,
                            max_pages: int = SEARCH_PAGES) -> list[tuple[int, list]]:
        """[(position, pages of every state group)]: for each of `tops`, the
        highest position <= it where every state group indexes a state of
        this prefix; each position once, highest first. A walk looks at
        every hash unit of the page below its top (prompt-end states sit
        between pages), then at page boundaries only (where chunk ends put
        most other states), at most `max_pages` pages down."""
        taken = self._kept()
        state_at = self.probe(block_hashes, taken)
        positions = taken[1]
        if positions is not None and positions.complete():
            # only the positions where some state sits (prefix_index_watch)
            return highest_states_at_or_below(tops, self.hash_unit, self.page, max_pages,
                                              state_at, kept_positions=positions.order)
        return highest_states_at_or_below(tops, self.hash_unit, self.page, max_pages,
                                          state_at, self._first_candidate(block_hashes, taken[0]))

    def _first_candidate(self, block_hashes: Sequence, hashes):
        """`probe`'s filter over a descending range of positions at once
        (core.eviction.highest_states_at_or_below's `first_candidate`), run
        in C (`first_at_or_below`); None where it cannot run. `hashes`: the
        kept hashes the walk took (`_kept`)."""
        unit = self.hash_unit
        if hashes is None or self.page % unit:
            return None

        def first_candidate(positions: range, start: int) -> int:
            rest = positions[start:]
            if not rest:
                return start
            return start + first_at_or_below(hashes, block_hashes, rest[0] // unit - 1,
                                             rest[-1] // unit - 1, -rest.step // unit)
        return first_candidate

    def positions(self, block_hashes: Sequence, end: int) -> list[int]:
        """Every hash-unit boundary below `end` where a state of this prefix
        is indexed, lowest first (a walk of the whole prefix: diagnostics)."""
        state_at = self.probe(block_hashes)
        return [pos for pos in range(self.hash_unit, end, self.hash_unit)
                if state_at(pos) is not None]
