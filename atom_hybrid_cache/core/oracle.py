"""What an unbounded cache would reuse: the `reusable` length of the stats.

Every prefix hash ever indexed is remembered; a prompt's reusable prefix is
its longest run of remembered hashes. Bounded so a long-running server
cannot grow it without limit: past the bound it stops learning, and the
figure then under-counts, never over-counts.

Prefix hashes are chained (each hashes its parent with its tokens), and
the oracle remembers whole chains: a hash only with its parent. Along one
prompt's chain what it holds is then a prefix, and `reach` finds its end
by doubling and halving, a few probes, where a walk read every hash of a
long shared prefix (a set of millions, a cache miss each: hundreds of
microseconds in the scheduler's step for a prompt of 50k tokens).

Learning costs what reading does not: a set of millions of hashes misses
the cache on each insert (a prefill chunk's 164 hashes of 50 tokens: 50-70
us here, a tenth of a prefill step). A caller that knows which steps are
busy queues what it learns (`learn_later`) and has it learned in a quiet
step (`catch_up`); a read first learns the queued chunks that could
touch its prompt's chain, so each answer is the one learning at once
would give.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Optional, Sequence


class PrefixOracle:
    __slots__ = ("seen", "limit", "queued", "queued_units")

    def __init__(self, limit: int) -> None:
        self.seen: set = set()
        self.limit = limit
        # [hashes, start, stop] to learn, oldest first (a prompt's next
        # chunk extends its entry), and their hash units
        self.queued: list = []
        self.queued_units = 0

    def learn_later(self, chunks: Iterable[tuple]) -> None:
        """Queue `chunks`, each `learn`'s (hashes, start, stop): learned by
        `catch_up`, or before a read that could tell them apart."""
        queued = self.queued
        for hashes, start, stop in chunks:
            if stop <= start:
                continue
            self.queued_units += stop - start
            for entry in queued:
                if entry[0] is hashes and entry[2] == start:
                    entry[2] = stop
                    break
            else:
                queued.append([hashes, start, stop])

    def catch_up(self, keep_units: int = 0, max_units: Optional[int] = None) -> None:
        """Learn the queued chunks, oldest first, until at most `keep_units`
        hash units' worth stay queued, or `max_units` were learned (None: no
        limit): the last chunk is then learned in part, and its rest, whose
        parent is now known, stays queued."""
        queued = self.queued
        left = max_units
        while queued and self.queued_units > keep_units and (left is None or left > 0):
            entry = queued[0]
            hashes, start, stop = entry
            if left is not None and stop - start > left:
                entry[1] = start + left
                self.queued_units -= left
                self._learn(hashes, start, start + left)
                return
            queued.pop(0)
            self.queued_units -= stop - start
            if left is not None:
                left -= stop - start
            self._learn(hashes, start, stop)

    def _catch_up_on(self, hashes: Sequence) -> None:
        """Learn the queued entries that can hold a hash of `hashes`' chain:
        its own; one whose start it shares (chains share prefixes, so one
        it does not share at the start holds none of its hashes above);
        one whose parent is not known (learning it walks down below its
        start)."""
        seen, n, keep = self.seen, len(hashes), []
        for entry in self.queued:
            other, start, stop = entry
            if (other is hashes or (start < n and hashes[start] == other[start])
                    or (start > 0 and other[start - 1] not in seen)):
                self.queued_units -= stop - start
                self._learn(other, start, stop)
            else:
                keep.append(entry)
        self.queued = keep

    def learn(self, hashes: Sequence, start: int = 0, stop: Optional[int] = None) -> None:
        """Remember `hashes[start:stop]`, one prompt's chain, while there is
        room. The hashes below `start` are known where the request that
        computed them taught them (a hit on its pages); where they came
        from elsewhere (a KV connector's load) they are not, and learning
        starts at the highest known one instead, so no hash is kept
        without its parent. The queued chunks of its chain are learned
        first."""
        if self.queued:
            self._catch_up_on(hashes)
        self._learn(hashes, start, stop)

    def _learn(self, hashes: Sequence, start: int, stop: Optional[int]) -> None:
        seen = self.seen
        room = self.limit - len(seen)
        if room <= 0:
            return
        stop = len(hashes) if stop is None else min(stop, len(hashes))
        if stop <= start:
            return
        while start > 0 and hashes[start - 1] not in seen:
            start -= 1
        seen.update(itertools.islice(hashes, start, min(stop, start + room)))

    def reach(self, hashes: Sequence, cap: int, start: int = 0) -> int:
        """How many leading hashes of `hashes` (at most `cap`) an unbounded
        cache holds, `start` known to be held (a hit)."""
        if self.queued:
            self._catch_up_on(hashes)
        seen = self.seen
        held = min(start, cap)
        if held >= cap or hashes[held] not in seen:
            return held
        # hashes[held] is held; find one that is not, doubling the step
        step = 1
        while True:
            probe = held + step
            if probe >= cap:
                missing = cap
                break
            if hashes[probe] not in seen:
                missing = probe
                break
            held, step = probe, step * 2
        # the first hash not held lies in (held, missing]
        while missing - held > 1:
            mid = (held + missing) // 2
            if hashes[mid] in seen:
                held = mid
            else:
                missing = mid
        return missing
