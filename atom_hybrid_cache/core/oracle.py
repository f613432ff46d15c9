"""What an unbounded cache would reuse: the `reusable` length of the stats.

Every prefix hash ever indexed is remembered; a prompt's reusable prefix is
its longest run of remembered hashes. Bounded so a long-running server
cannot grow it without limit: past the bound it stops learning, and the
figure then under-counts, never over-counts.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Sequence


class PrefixOracle:
    __slots__ = ("seen", "limit")

    def __init__(self, limit: int) -> None:
        self.seen: set = set()
        self.limit = limit

    def learn(self, hashes: Iterable) -> None:
        """Remember `hashes` while there is room."""
        room = self.limit - len(self.seen)
        if room > 0:
            self.seen.update(itertools.islice(hashes, room))

    def learn_one(self, block_hash) -> None:
        if len(self.seen) < self.limit:
            self.seen.add(block_hash)

    def reach(self, hashes: Sequence, cap: int, start: int = 0) -> int:
        """How many leading hashes of `hashes` (at most `cap`) an unbounded
        cache holds. The walk starts at `start`, which the caller knows to
        be held (a hit: a long prompt has thousands of hashes below it)."""
        seen = self.seen
        n = min(start, cap)
        while n < cap and hashes[n] in seen:
            n += 1
        return n
