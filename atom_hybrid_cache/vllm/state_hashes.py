"""The block hashes under which vLLM's prefix index holds a state of the
first state group, as a set kept up to date as the index changes.

Why: the plugin's state walks (a release's refreshed states, the floors, a
lookup whose states are gone) ask position after position whether the
index holds a state there, and a long prompt's walk asks hundreds to
thousands of them, nearly all empty. Asked of vLLM's index, each question
builds the key (the hash and the group's id), hashes it and misses in a dict
of every group's pages; asked of this set, it is one membership of a hash
whose own hash Python has already computed, in a set of the states alone,
and a walk can run over the prefix in C (`first_at_or_below`). The index's
`insert` and `pop` tell this object each change of a key of the group; a
reset replaces the index, and the set is rebuilt from the new one when next
asked. A candidate found here is still confirmed in vLLM's pool.
"""

from __future__ import annotations

import weakref
from itertools import compress, count, islice
from typing import Optional, Sequence

from . import private_api

# block pool -> its StateHashes, for the state manager's lookup (a
# classmethod that vLLM hands the pool)
_of_pool: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class StateHashes:
    def __init__(self, pool, group_id: int) -> None:
        self.pool = pool
        self.group_id = group_id
        # None: the index is not the plain dict this reads (then no set)
        self._suffix = private_api.index_key_suffix(pool, group_id)
        self._map = None
        self._hashes: set = set()
        _of_pool[pool] = self

    def current(self) -> Optional[set]:
        """The hashes whose key of this group the index holds now, or None
        where they cannot be kept (callers then ask vLLM's index)."""
        if self._suffix is None:
            return None
        index_map = self.pool.cached_block_hash_to_block
        if index_map is not self._map:
            self._watch(index_map)
        return self._hashes

    def _watch(self, index_map) -> None:
        suffix = self._suffix
        cut = -len(suffix)
        index = private_api.prefix_index(self.pool)
        if index is None:
            self._suffix = None
            return
        hashes = {key[:cut] for key in index if key.endswith(suffix)}
        insert, pop = index_map.insert, index_map.pop

        def watched_insert(key, block) -> None:
            insert(key, block)
            if key.endswith(suffix):
                hashes.add(key[:cut])

        def watched_pop(key, block_id):
            popped = pop(key, block_id)
            # another page may still be filed under the key
            if popped is not None and key.endswith(suffix) and key not in index:
                hashes.discard(key[:cut])
            return popped

        index_map.insert = watched_insert
        index_map.pop = watched_pop
        self._map = index_map
        self._hashes = hashes


def of_pool(pool, group_id: int) -> Optional[set]:
    """The kept hashes of `group_id`'s states in `pool`, or None where no
    StateHashes keeps that group's."""
    kept = _of_pool.get(pool)
    if kept is None or kept.group_id != group_id:
        return None
    return kept.current()


def first_at_or_below(hashes: set, block_hashes: Sequence, first: int, last: int,
                      step: int = 1) -> int:
    """How many of the indices first, first - step, ... down to `last` (>= 0)
    come before the first whose hash of `block_hashes` is in `hashes`; the
    number of those indices if none is. Runs in C (the hashes read from the
    end of the list, every `step`-th)."""
    n = len(block_hashes)
    total = (first - last) // step + 1 if first >= last else 0
    # indices past the list (a top above its last full unit) hold nothing
    skip = min(total, max(0, -(-(first - n + 1) // step)))
    if skip == total:
        return total
    start = n - 1 - (first - skip * step)
    stop = n - last
    found = next(compress(count(), map(hashes.__contains__,
                                       islice(reversed(block_hashes), start, stop, step))),
                 None)
    return total if found is None else skip + found
