"""A finished request's token lists are freed a slice a step, not all in the
step that releases it.

Why: vLLM drops a finished request in the step that frees its pages, and
freeing its long lists (the prompt, the prompt plus output, the block
hashes) is the most expensive thing in that step: each entry is a reference
to an object made long ago, a cache miss. Measured on the scheduler bench
(`benchmarks/slow_step_parts.py`), 0.7-0.8 ms a request against a p99 step
of 1.4-1.6 ms. The plugin's release in units already makes that step heavier
than vLLM's, so it was the one that set the plugin's p99 step. Here the
scheduler keeps those lists once the request is released and frees each
from its end, a slice in each quiet `schedule()` (one that scheduled no
prefill; async scheduling overlaps it with the forward): a `DRAIN_STEPS`-th
of what waits, at least `SLICE_ENTRIES` entries and at most
`QUIET_SLICE_MAX` (a slice of a large backlog would itself make a decode
step a slow one). A prefill step, the slowest kind, frees only what waits
beyond `BUSY_STEP_BACKLOG` entries (a run of prefills with no quiet step
between them still drains, each step freeing about what the step before
released, as vLLM would).

Measured on the held-out Mooncake trace (c8 / 40 GiB, all 3,993 requests:
`benchmarks/slow_step_parts.py --without`): with a sixteenth of what waits
in every step past a line of 2^19 entries, 134 prefill steps freed 35k
entries each (about 0.3 ms) and quiet slices reached 36k; those steps were
a quarter of the plugin's slowest percent.

A list is cut only while nothing else references it (a connector or a
caller keeping the prompt sees it whole); one still referenced elsewhere is
let go uncut, and its last holder frees it.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Optional

from . import private_api

# entries freed at least per quiet step (tens of microseconds here), the
# share of what waits freed per quiet step (its inverse), and at most
# (about 0.15 ms: a decode step stays under the prefill steps)
SLICE_ENTRIES = 8192
DRAIN_STEPS = 16
QUIET_SLICE_MAX = 16384
# entries left waiting through a prefill step (about ten 100k-token
# requests' lists: 20-80 MB of Python objects at most)
BUSY_STEP_BACKLOG = 1 << 21


def _references(entries) -> int:
    """`sys.getrefcount` of a kept list, always read through this one call
    (so that the count when only the queue holds it is one number)."""
    return sys.getrefcount(entries)


def _references_when_only_kept() -> int:
    """What `_references` reads for a list referenced by nothing but its
    request's group, read as `free_slice` reads it (in a comprehension over
    the group)."""
    group = [[]]
    return [_references(entries) for entries in group][0]


class FinishedTokenLists:
    def __init__(self) -> None:
        # per released request, its lists; `pending`: their entries
        self.groups: deque = deque()
        self.pending = 0
        self._only_kept = _references_when_only_kept()
        # whether vLLM's Request has the private list (asked of the first)
        self._private_ok: Optional[bool] = None

    def keep(self, request) -> None:
        """Keep `request`'s long lists (called as vLLM releases it: it drops
        the request right after)."""
        if self._private_ok is None:
            self._private_ok = private_api.instance_has(request, private_api.STEP_TAIL_FREES)
        # the prompt plus output is private (`all_token_ids` is a read-only
        # view of it)
        group = [entries for entries in (
            request.prompt_token_ids, request.block_hashes,
            getattr(request, "_all_token_ids", None) if self._private_ok else None)
            if type(entries) is list and entries]
        if group:
            self.groups.append(group)
            self.pending += sum(map(len, group))

    def free_slice(self, quiet: bool = True) -> int:
        """Free this step's slice from the lists' ends (`quiet`: the step
        scheduled no prefill); the entries freed.
        A request's lists shrink together, each by the same share: the
        prompt and the prompt plus output hold the same token objects at
        the same places, so the second list's references find them in
        cache (freed one list after the other: 9.2 ns an entry against
        8.0, on the scheduler bench's first 30 traces)."""
        groups = self.groups
        if not groups or (not quiet and self.pending <= BUSY_STEP_BACKLOG):
            return 0    # (it runs in every step)
        if quiet:
            budget = min(QUIET_SLICE_MAX, max(SLICE_ENTRIES, -(-self.pending // DRAIN_STEPS)))
        else:
            budget = self.pending - BUSY_STEP_BACKLOG
        freed = 0
        while groups and freed < budget:
            group = groups[0]
            ours = [entries for entries in group if _references(entries) <= self._only_kept]
            # a list referenced elsewhere is not ours to cut: let go
            self.pending -= sum(map(len, group)) - sum(map(len, ours))
            room, total = budget - freed, sum(map(len, ours))
            for entries in ours:
                # its share of the room, rounded up
                n = min(len(entries), -(-len(entries) * room // total))
                del entries[len(entries) - n:]
                freed += n
                self.pending -= n
            group[:] = [entries for entries in ours if entries]
            if not group:
                groups.popleft()
        return freed
