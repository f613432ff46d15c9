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
- for the first state group, the token position of each mirrored hash
  (`KeyPositions`): a state walk over a long prefix then reads only the
  hashes at positions where some state sits, not every hash down to it;
- the log of the keys changed while a lookup is kept, each as its hash
  and its prefix length where known (`step_lookups.py`).
The index's `insert` and `pop` are wrapped once, by this object, and each
wrapper does both jobs inline: every page vLLM caches or evicts goes
through them (a few tens a step), where a wrapper each (or a listener call
each) would cost a Python call a page more. A reset replaces the index;
`current` wraps the new one and rebuilds the mirrors from it. One watch per
block pool (`of_pool`).
"""

from __future__ import annotations

import weakref
from bisect import bisect_left, insort
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
        # where (hash, position or None) of each changed key goes while
        # lookups are kept (step_lookups.py sets and clears it); None: not
        # logged
        self.change_log: Optional[list] = None
        # the one group whose keys' positions are kept, and them
        self._positioned: Optional[int] = None
        self._positions: Optional[KeyPositions] = None
        # counts the wraps: the mirrors and positions a reader took stand
        # while it is unchanged (a new group's mirror joins the same dict)
        self.generation = 0
        # group id -> (generation, what a reader took for it): the readers'
        # own store (`state_hashes.kept_of_pool`)
        self.taken: dict = {}

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

    def positions(self, group_id: int) -> Optional["KeyPositions"]:
        """The token positions of `group_id`'s mirrored hashes, kept from
        the first ask on (one group a pool: the first state group's); None
        where that group has no mirror or another group's are kept."""
        if self.mirror(group_id) is None:
            return None
        if self._positioned is None:
            self._positioned = group_id
            self._wrap(self.index_map)   # the wrappers keep them from now on
        if self._positioned != group_id:
            return None
        return self._positions

    def kept_positions(self, group_id: int) -> Optional["KeyPositions"]:
        """`positions` for a group already positioned; None for any other."""
        return self.positions(group_id) if group_id == self._positioned else None

    def kept_mirror(self, group_id: int) -> Optional[dict]:
        """`mirror` for a group already mirrored; None for any other."""
        return self.mirror(group_id) if group_id in self._suffixes else None

    def _wrap(self, index_map) -> None:
        self.generation += 1
        cache = self._index_dict = private_api.prefix_index(self.pool)
        if cache is None:
            self._suffixes = {}   # no mirror (`mirror` answers None)
        # the mirrors of the new index (a reset: rebuilt from it)
        mirrors = self._mirrors = {s: _entries(cache, s) for s in self._suffixes.values()}
        positioned = self._suffixes.get(self._positioned)
        track = self._positions = (KeyPositions.of(mirrors[positioned], positioned)
                                   if positioned is not None else None)
        tracked = mirrors.get(positioned)
        # the unwrapped methods: a map wrapped before (its mirrors are
        # rebuilt) keeps the ones this object saved on it
        insert, pop = getattr(index_map, "_atom_unwrapped", (index_map.insert, index_map.pop))
        index_map._atom_unwrapped = (insert, pop)
        watch = self
        cut = -GROUP_ID_BYTES

        # (every page vLLM caches or evicts comes through these two: a
        # group without a mirror while nothing is logged costs one dict
        # read, and a page's position is read once)
        def watched_insert(key, block) -> None:
            insert(key, block)
            entries = mirrors.get(key[cut:])
            log = watch.change_log
            if entries is None and log is None:
                return
            h = key[:cut]
            position = _position(block, key)
            if entries is not None:
                if entries is tracked:
                    track.add(h, position)
                entries[h] = cache[key]   # the block, or vLLM's dict of them
            if log is not None:
                log.append((h, position))

        def watched_pop(key, block_id):
            popped = pop(key, block_id)
            if popped is None:
                return None
            entries = mirrors.get(key[cut:])
            log = watch.change_log
            if entries is None and log is None:
                return popped
            h = key[:cut]
            # another page may still be filed under the key: vLLM puts back
            # the dict of them, the mirror's value already
            if entries is not None and key not in cache:
                del entries[h]
                if entries is tracked:
                    track.remove(h)
            if log is not None:
                # vLLM resets the page's hash after the pop: read here
                log.append((h, _position(popped, key)))
            return popped

        index_map.insert = watched_insert
        index_map.pop = watched_pop
        self.index_map = index_map


class KeyPositions:
    """The token position of each hash of one group's mirror: the length of
    the prefix it hashes, read off the block first filed under it (vLLM's
    `block_hash_num_tokens` belongs to a block's first key; a key filed
    only as blocks' second key has no position here: `unknown` counts
    those, and while any is kept the positions do not cover the hashes).
    A prefix length is the key's own: it stays while any page is filed
    under the key.

    `order`: the distinct positions, ascending; a walk bisects it for the
    positions in its range and reads only the hashes there."""

    def __init__(self) -> None:
        self.position_of: dict = {}
        self.count: dict = {}
        self.order: list = []
        self.unknown = 0

    @classmethod
    def of(cls, entries: dict, suffix: bytes) -> "KeyPositions":
        out = cls()
        for h, value in entries.items():
            blocks = value.values() if isinstance(value, dict) else (value,)
            key = h + suffix
            positions = (_position(b, key) for b in blocks)
            out.add(h, next((p for p in positions if p is not None), None))
        return out

    def add(self, h, position: Optional[int]) -> None:
        """`h` filed (again) with a page that gives its `position` (None:
        one that does not)."""
        if h in self.position_of:
            if position is None or self.position_of[h] is not None:
                return
            self.unknown -= 1   # a key known so far only as a second key
        elif position is None:
            self.position_of[h] = None
            self.unknown += 1
            return
        self.position_of[h] = position
        n = self.count.get(position, 0)
        if not n:
            insort(self.order, position)
        self.count[position] = n + 1

    def remove(self, h) -> None:
        position = self.position_of.pop(h)
        if position is None:
            self.unknown -= 1
            return
        n = self.count[position] - 1
        if n:
            self.count[position] = n
        else:
            del self.count[position]
            del self.order[bisect_left(self.order, position)]

    def complete(self) -> bool:
        """Whether every kept hash has its position."""
        return not self.unknown


def _position(block, key) -> Optional[int]:
    """The prefix length `key` hashes, where `block` holds it as its own
    key (vLLM's first for the page); None otherwise."""
    return block.block_hash_num_tokens if block.block_hash == key else None


def _entries(cache: dict, suffix: bytes) -> dict:
    """{block hash: value} of `cache`'s keys ending in `suffix` (a group's
    key suffix, GROUP_ID_BYTES long)."""
    return {key[:-GROUP_ID_BYTES]: value for key, value in cache.items()
            if key.endswith(suffix)}
