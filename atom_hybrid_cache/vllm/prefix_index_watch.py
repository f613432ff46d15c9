"""One watcher of vLLM's prefix index (`BlockPool.cached_block_hash_to_block`)
for everything the plugin keeps in step with it.

Two things follow the index's changes: the set of hashes under which it
holds a state of the first state group (`state_hashes.py`, for the state
walks) and the log of the hashes whose keys changed while a lookup is kept
(`step_lookups.py`). The index's `insert` and `pop` are wrapped once, by
this object, and each wrapper does both jobs inline: every page vLLM
caches or evicts goes through them, a few hundred in a long prefill's step,
where a wrapper each (or a listener call each) would cost a Python call a
page more. A reset replaces the index; `current` wraps the new one and
rebuilds the set from it. One watch per block pool (`of_pool`).
"""

from __future__ import annotations

import weakref
from typing import Optional

from . import private_api

_of_pool: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def of_pool(pool) -> "PrefixIndexWatch":
    """The pool's watch, made on first use."""
    watch = _of_pool.get(pool)
    if watch is None:
        watch = _of_pool[pool] = PrefixIndexWatch(pool)
    return watch


def existing(pool) -> Optional["PrefixIndexWatch"]:
    """The pool's watch, or None where nothing made one."""
    return _of_pool.get(pool)


class PrefixIndexWatch:
    def __init__(self, pool) -> None:
        self.pool = pool
        # the index map whose insert and pop are wrapped (None: not yet)
        self.index_map = None
        # the state group whose keys' hashes are kept, and its key suffix
        # (None: no set kept, or the index is not the plain dict this reads)
        self.state_group: Optional[int] = None
        self._suffix: Optional[bytes] = None
        self.state_hashes: set = set()
        # where the hashes of changed keys go while a step's lookups are
        # kept (step_lookups.py sets and clears it); None: not logged
        self.change_log: Optional[list] = None

    def keep_state_hashes(self, group_id: int) -> None:
        """Keep the hashes of `group_id`'s keys (one group per pool)."""
        self.state_group = group_id
        self._suffix = private_api.index_key_suffix(self.pool, group_id)
        self.index_map = None   # wrapped again, with the set, when next asked

    def current(self):
        """The index map as watched now (wrapped again after a reset)."""
        index_map = self.pool.cached_block_hash_to_block
        if index_map is not self.index_map:
            self._wrap(index_map)
        return index_map

    def kept_state_hashes(self) -> Optional[set]:
        """The hashes whose key of the state group the index holds now, or
        None where they are not kept (callers then ask vLLM's index)."""
        if self._suffix is None:
            return None
        self.current()
        return self.state_hashes if self._suffix is not None else None

    def _wrap(self, index_map) -> None:
        suffix = self._suffix
        index = None
        if suffix is not None:
            index = private_api.prefix_index(self.pool)
            if index is None:
                suffix = self._suffix = None
        # the unwrapped methods: a map wrapped before (its set is rebuilt)
        # keeps the ones this object saved on it
        insert, pop = getattr(index_map, "_atom_unwrapped", (index_map.insert, index_map.pop))
        index_map._atom_unwrapped = (insert, pop)
        watch = self
        # the set's keys: those ending in the state group's suffix (none
        # where no set is kept)
        keeps = suffix is not None
        cut = -len(suffix) if keeps else 0
        hashes = {key[:cut] for key in index if key.endswith(suffix)} if keeps else set()
        self.state_hashes = hashes

        # (a key is the block hash and a 4-byte group id)
        def watched_insert(key, block) -> None:
            insert(key, block)
            if keeps and key.endswith(suffix):
                hashes.add(key[:cut])
            log = watch.change_log
            if log is not None:
                log.append(key[:-4])

        def watched_pop(key, block_id):
            popped = pop(key, block_id)
            if popped is not None:
                # another page may still be filed under the key
                if keeps and key.endswith(suffix) and key not in index:
                    hashes.discard(key[:cut])
                log = watch.change_log
                if log is not None:
                    log.append(key[:-4])
            return popped

        index_map.insert = watched_insert
        index_map.pop = watched_pop
        self.index_map = index_map
