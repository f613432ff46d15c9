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
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence


class PrefixOracle:
    __slots__ = ("seen", "limit")

    def __init__(self, limit: int) -> None:
        self.seen: set = set()
        self.limit = limit

    def learn(self, hashes: Sequence, start: int = 0, stop: Optional[int] = None) -> None:
        """Remember `hashes[start:stop]`, one prompt's chain, while there is
        room. The hashes below `start` are known where the request that
        computed them taught them (a hit on its pages); where they came
        from elsewhere (a KV connector's load) they are not, and learning
        starts at the highest known one instead, so no hash is kept
        without its parent."""
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
