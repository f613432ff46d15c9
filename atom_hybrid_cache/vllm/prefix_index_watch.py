"""One watcher of vLLM's prefix index (`BlockPool.cached_block_hash_to_block`)
for everything the plugin keeps in step with it.

Two things follow the index's changes:
- per KV cache group asked for, a mirror of the group's entries keyed by
  the block hash alone ({block hash: the index's value, a block or vLLM's
  dict of the blocks filed under it}). vLLM keys its index by the hash and
  a 4-byte group id, so each read of it builds and hashes a new key; a
  long prompt's lookup reads hundreds, one per attention block
  (`attention_lookup.py`), where a read of the mirror is one dict read of
  a hash Python has already hashed. The first state group's mirror is also
  the set of hashes its states are filed under (`state_hashes.py`, for the
  state walks);
- the log of the hashes whose keys changed while a lookup is kept
  (`step_lookups.py`).
The index's `insert` and `pop` are wrapped once, by this object, and each
wrapper does both jobs inline: every page vLLM caches or evicts goes
through them (a few tens a step), where a wrapper each (or a listener call
each) would cost a Python call a page more. A reset replaces the index;
`current` wraps the new one and rebuilds the mirrors from it. One watch per
block pool (`of_pool`).
"""

from __future__ import annotations

import weakref
from typing import Optional

from . import private_api

_of_pool: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

# vLLM's key: the block hash, then the group id in this many bytes
# (`make_block_hash_with_group_id`; a suffix of another length keeps no
# mirror)
GROUP_ID_BYTES = 4


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
        # the plain dict behind it (None: not the dict this reads, no mirror)
        self._index_dict: Optional[dict] = None
        # group id -> its key suffix, for the groups mirrored
        self._suffixes: dict = {}
        # key suffix -> {block hash: the index's value}; replaced at a reset
        self._mirrors: dict = {}
        # where the hashes of changed keys go while a step's lookups are
        # kept (step_lookups.py sets and clears it); None: not logged
        self.change_log: Optional[list] = None

    def current(self):
        """The index map as watched now (wrapped again after a reset)."""
        index_map = self.pool.cached_block_hash_to_block
        if index_map is not self.index_map:
            self._wrap(index_map)
        return index_map

    def mirror(self, group_id: int) -> Optional[dict]:
        """`group_id`'s entries of the index as they stand now, keyed by the
        block hash; kept from the first ask on. None where the index is not
        the plain dict this reads (callers then read vLLM's)."""
        self.current()
        suffix = self._suffixes.get(group_id)
        if suffix is None:
            if self._index_dict is None:
                return None
            suffix = private_api.index_key_suffix(self.pool, group_id)
            if suffix is None or len(suffix) != GROUP_ID_BYTES:
                return None
            self._suffixes[group_id] = suffix
            self._mirrors[suffix] = _entries(self._index_dict, suffix)
        return self._mirrors[suffix]

    def kept_mirror(self, group_id: int) -> Optional[dict]:
        """`mirror` for a group already mirrored; None for any other."""
        return self.mirror(group_id) if group_id in self._suffixes else None

    def _wrap(self, index_map) -> None:
        cache = self._index_dict = private_api.prefix_index(self.pool)
        if cache is None:
            self._suffixes = {}   # no mirror (`mirror` answers None)
        # the mirrors of the new index (a reset: rebuilt from it)
        mirrors = self._mirrors = {s: _entries(cache, s) for s in self._suffixes.values()}
        # the unwrapped methods: a map wrapped before (its mirrors are
        # rebuilt) keeps the ones this object saved on it
        insert, pop = getattr(index_map, "_atom_unwrapped", (index_map.insert, index_map.pop))
        index_map._atom_unwrapped = (insert, pop)
        watch = self
        cut = -GROUP_ID_BYTES

        def watched_insert(key, block) -> None:
            insert(key, block)
            h = key[:cut]
            entries = mirrors.get(key[cut:])
            if entries is not None:
                entries[h] = cache[key]   # the block, or vLLM's dict of them
            log = watch.change_log
            if log is not None:
                log.append(h)

        def watched_pop(key, block_id):
            popped = pop(key, block_id)
            if popped is not None:
                h = key[:cut]
                entries = mirrors.get(key[cut:])
                # another page may still be filed under the key: vLLM puts
                # back the dict of them, the mirror's value already
                if entries is not None and key not in cache:
                    del entries[h]
                log = watch.change_log
                if log is not None:
                    log.append(h)
            return popped

        index_map.insert = watched_insert
        index_map.pop = watched_pop
        self.index_map = index_map


def _entries(cache: dict, suffix: bytes) -> dict:
    """{block hash: value} of `cache`'s keys ending in `suffix` (a group's
    key suffix, GROUP_ID_BYTES long)."""
    return {key[:-GROUP_ID_BYTES]: value for key, value in cache.items()
            if key.endswith(suffix)}
