"""The prefix lookups the plugin makes before vLLM's `schedule()`, answered
again to vLLM's own lookup of the same request in that step.

The admission gate and hits-first look up the requests of vLLM's admission
window (`KVCacheCoordinator.find_longest_cache_hit`); vLLM's `schedule()`
then looks up each request it admits once more. A long prompt's lookup walks
its whole prefix (a 200k-token hit: 500 attention blocks), and in the
slowest steps the two lookups were a third of the step. The answer depends
only on which of the request's prefix hashes the pool indexes, and on which
block each names; so a kept answer stands until the pool's prefix index
inserts or removes a key of one of the request's hashes (an allocation that
evicts, a running prefill that caches). The index's `insert` and `pop` tell
this object; any other change (a reset replaces the index) drops them all.
vLLM gets the same answer it would have computed, in lists of its own.
"""

from __future__ import annotations

from typing import Optional


class StepLookups:
    def __init__(self, coordinator, pool) -> None:
        self.pool = pool
        self._find = coordinator.find_longest_cache_hit
        # (id of the hash list, its length, max length) -> [answer, the list's
        # hashes as a set, the list]; the list is kept so its id stays its own
        self._kept: dict = {}
        self._recording = False
        self._index = None
        # counters: lookups answered from a kept one, kept ones dropped by a change
        self.answered = 0
        self.dropped = 0
        coordinator.find_longest_cache_hit = self.find_longest_cache_hit
        self._watch(pool.cached_block_hash_to_block)

    def _watch(self, index) -> None:
        """Have the prefix index report each key it inserts or removes."""
        self._index = index
        insert, pop = index.insert, index.pop

        def watched_insert(key, block) -> None:
            if self._kept:
                self._changed(key)
            insert(key, block)

        def watched_pop(key, block_id):
            popped = pop(key, block_id)
            if popped is not None and self._kept:
                self._changed(key)
            return popped

        index.insert = watched_insert
        index.pop = watched_pop

    def _changed(self, key) -> None:
        block_hash = key[:-4]   # (the key is the hash and a 4-byte group id)
        stale = [k for k, entry in self._kept.items() if block_hash in entry[1]]
        for k in stale:
            del self._kept[k]
        self.dropped += len(stale)

    def record(self) -> None:
        """From now until `forget`, lookups are kept (the plugin's, before
        vLLM's `schedule()`)."""
        self._kept = {}
        self._recording = True
        if self.pool.cached_block_hash_to_block is not self._index:
            self._watch(self.pool.cached_block_hash_to_block)   # reset: a new index

    def stop_recording(self) -> None:
        """vLLM's own lookups are answered from the kept ones, not kept."""
        self._recording = False

    def forget(self) -> None:
        self._kept = {}
        self._recording = False

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length: int):
        key = (id(block_hashes), len(block_hashes), max_cache_hit_length)
        entry: Optional[list] = self._kept.get(key)
        if entry is not None and entry[2] is block_hashes:
            blocks, hit, uncached = entry[0]
            self.answered += 1
            return tuple([*group] for group in blocks), hit, uncached
        answer = self._find(block_hashes, max_cache_hit_length)
        if self._recording and self.pool.cached_block_hash_to_block is self._index:
            self._kept[key] = [answer, set(block_hashes), block_hashes]
        return answer
