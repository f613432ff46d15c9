"""Prefix lookups answered again while their answer stands.

The admission gate and hits-first look up the requests of vLLM's admission
window (`KVCacheCoordinator.find_longest_cache_hit`) before vLLM's
`schedule()`, which looks up each request it admits once more; and a
request that waits for room is looked up again the next step, by vLLM or
the gate (on the first 30 shared traces at c4 / 40 GiB a third of the lookups,
nearly all of long prompts, gave the answer of the step before). A long
prompt's lookup walks its whole prefix (a 200k-token hit: 500 attention
blocks). The answer depends only on which of the request's prefix hashes
the pool indexes, and on which block each names; so a kept answer stands
until the pool's prefix index inserts or removes a key of one of the
request's hashes (an allocation that evicts, a running prefill that
caches). The pool's watcher of the index (`prefix_index_watch.py`) lists
each key changed while a lookup is kept, with the prefix length it hashes
where the page filed under it says; a hash names a prefix of one length,
so a change is the request's only if the request's hash at that length is
the changed one: one read a change, not one a prefix hash. Where a
change's length is not known, the request's hashes are compared with the
changed ones. A kept answer stands into the next step if it was asked in
this one; a reset (a new index) drops them all. Every caller gets the
answer it would have computed, in lists of its own.
"""

from __future__ import annotations

from itertools import islice
from typing import Optional

from . import prefix_index_watch


class StepLookups:
    def __init__(self, coordinator, pool) -> None:
        self.pool = pool
        self._find = coordinator.find_longest_cache_hit
        # the tokens a prefix hash adds (a change at length p is the
        # request's hash p // unit - 1); 0: not known, hashes are compared
        self._unit = getattr(pool, "hash_block_size", 0) or 0
        # (id of the hash list, its length, max length) -> [answer, the list,
        # the log position it stands at, asked this step]; the list is kept
        # so its id stays its own
        self._kept: dict = {}
        # (hash, prefix length or None) of the index keys inserted or
        # removed while any lookup is kept, in order (the watch appends)
        self._changes: list = []
        self._watch = prefix_index_watch.of_pool(pool)
        self._index = self._watch.current()
        # counters: lookups answered from a kept one, kept ones dropped by a change
        self.answered = 0
        self.dropped = 0
        coordinator.find_longest_cache_hit = self.find_longest_cache_hit

    def begin_step(self) -> None:
        """A step begins: the lookups kept in earlier steps stand if they
        were asked in the last one; the others go."""
        index = self._watch.current()   # after a reset: the new index
        if index is not self._index:
            self._index = index
            self._kept = {}
        else:
            self._kept = {key: entry for key, entry in self._kept.items() if entry[3]}
        for entry in self._kept.values():
            entry[3] = False
        self._trim_changes()

    def end_step(self) -> None:
        """vLLM's `schedule()` is done: the changes the kept lookups have
        read are listed no longer."""
        self._trim_changes()

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length: int):
        key = (id(block_hashes), len(block_hashes), max_cache_hit_length)
        entry: Optional[list] = self._kept.get(key)
        index_now = self.pool.cached_block_hash_to_block is self._index
        if entry is not None and entry[1] is block_hashes:
            if index_now and self._unchanged(block_hashes, entry[2]):
                entry[2] = len(self._changes)
                entry[3] = True
                self.answered += 1
                return _copy(entry[0])
            del self._kept[key]
            self.dropped += 1
        answer = self._find(block_hashes, max_cache_hit_length)
        if index_now:
            self._kept[key] = [answer, block_hashes, len(self._changes), True]
            self._watch.change_log = self._changes
            return _copy(answer)
        return answer

    def _unchanged(self, block_hashes, since: int) -> bool:
        """Whether no key of one of `block_hashes` changed after log
        position `since`."""
        if since == len(self._changes):
            return True
        unit, n = self._unit, len(block_hashes)
        changed = []
        for h, pos in islice(self._changes, since, None):
            if pos is None or not unit:
                changed.append(h)
            elif not pos % unit and 0 < pos <= n * unit and block_hashes[pos // unit - 1] == h:
                return False
        # keys whose length is not known: compared with every hash
        return not changed or set(changed).isdisjoint(block_hashes)

    def _trim_changes(self) -> None:
        """Drop the listed changes no kept lookup reads; stop listing when
        none is kept."""
        if not self._kept:
            self._changes = []
            self._watch.change_log = None
            return
        start = min(entry[2] for entry in self._kept.values())
        if start:
            # in place: the watch appends to this list
            del self._changes[:start]
            for entry in self._kept.values():
                entry[2] -= start


def _copy(answer):
    """(blocks of each group, hit, uncached) in lists of the caller's own
    (a caller may change the lists it is given)."""
    blocks, hit, uncached = answer
    return tuple([*group] for group in blocks), hit, uncached
