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
evicts, a running prefill that caches). The pool's watcher of the index
(`prefix_index_watch.py`) lists the hashes of the keys changed in the step
while a lookup is kept; when
vLLM asks again, a kept answer is given only if none of the hashes changed
since it was kept is one of the request's (one pass over its hashes, and
none where nothing changed: no set of a long prompt's thousands of hashes
is built for each lookup the gate keeps and vLLM may never ask for). Any
other change (a reset replaces the index) drops them all. vLLM gets the
same answer it would have computed, in lists of its own.
"""

from __future__ import annotations

from typing import Optional

from . import prefix_index_watch


class StepLookups:
    def __init__(self, coordinator, pool) -> None:
        self.pool = pool
        self._find = coordinator.find_longest_cache_hit
        # (id of the hash list, its length, max length) -> [answer, the list,
        # how many changes were listed when it was kept]; the list is kept
        # so its id stays its own
        self._kept: dict = {}
        # the hashes of the index keys inserted or removed while any lookup
        # is kept, in order (the watch appends them)
        self._changes: list = []
        self._recording = False
        self._watch = prefix_index_watch.of_pool(pool)
        self._index = self._watch.current()
        # counters: lookups answered from a kept one, kept ones dropped by a change
        self.answered = 0
        self.dropped = 0
        coordinator.find_longest_cache_hit = self.find_longest_cache_hit

    def record(self) -> None:
        """From now until `forget`, lookups are kept (the plugin's, before
        vLLM's `schedule()`)."""
        self.forget()
        self._recording = True
        self._index = self._watch.current()   # after a reset: the new index

    def stop_recording(self) -> None:
        """vLLM's own lookups are answered from the kept ones, not kept."""
        self._recording = False

    def forget(self) -> None:
        self._kept = {}
        self._changes = []
        self._watch.change_log = None
        self._recording = False

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length: int):
        key = (id(block_hashes), len(block_hashes), max_cache_hit_length)
        entry: Optional[list] = self._kept.get(key)
        if entry is not None and entry[1] is block_hashes:
            since = self._changes[entry[2]:]
            if not since or set(since).isdisjoint(block_hashes):
                blocks, hit, uncached = entry[0]
                self.answered += 1
                return tuple([*group] for group in blocks), hit, uncached
            del self._kept[key]
            self.dropped += 1
        answer = self._find(block_hashes, max_cache_hit_length)
        if self._recording and self.pool.cached_block_hash_to_block is self._index:
            self._kept[key] = [answer, block_hashes, len(self._changes)]
            self._watch.change_log = self._changes
        return answer
