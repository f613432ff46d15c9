"""Floor states: the states a live request holds deep under its prefix
(`ATOM_STATE_CHECKPOINT_FLOOR`, on by default in a vLLM server).

Why: while a request waits in vLLM's admission window or runs, its KV
prefix is held (referenced by the request, or pinned by the admission
gate), but the states at lower positions of that prefix are not: they sit
alone in the LRU where the prefix's last release filed them. When the pool
is short, a round's new pages come from there first, a state page being all
that is evictable, and after a few such rounds a 50k-token prefix has KV and
no state below its top. The next cut of its top then costs all of it: on
the plan's workload at 0.83x (gate and hits-first), six requests resumed
from 0 with 13k-50k tokens of KV cached, 159,488 tokens of the 174,144
lost to missing states (benchmarks/loss_trace.py).

So each live request holds the highest state at or below each floor
fraction of its prompt, from the first step it is in vLLM's admission
window (the first `max_num_seqs - running` waiting requests, the same
window the admission gate looks at) to its release (finished or preempted).
The release gives the pages back with the request's own, in its units
(`CheckpointPlanner.eviction_order`), so a floor leaves the LRU only after
the KV above it. A floor costs one page per state group; a request's floors
are looked up once, and all held floors together stay under a share of the
pool (`FLOOR_MAX_POOL_SHARE`).
"""

from __future__ import annotations

import itertools
import logging
from typing import Sequence

from .state_search import StateSearch

logger = logging.getLogger("atom_hybrid_cache")

# All floors held at once take at most this share of the pool's pages: with
# hundreds of requests in vLLM's window their floors could otherwise crowd
# out the prefixes they insure. (No workload in BENCHMARKS.md reaches it:
# at most max_num_seqs requests hold floors, two states each, 5.3% of the
# pool on the smallest, 6x4 at 0.83x; 1.6% in the scheduler bench.)
FLOOR_MAX_POOL_SHARE = 1 / 16


class FloorStates:
    def __init__(self, pool, states: StateSearch, fractions: Sequence[float],
                 num_pages: int) -> None:
        self.pool = pool
        self.states = states
        self.fractions = tuple(fractions)
        self.max_pages = int(num_pages * FLOOR_MAX_POOL_SHARE)
        # request id -> [(position, pages of every state group)]; an empty
        # list: looked up, nothing found or no room (not looked up again
        # until the request is released)
        self.held: dict[str, list] = {}
        self.held_pages = 0
        # requests that hold floors / that found some but were refused them
        # for the pool share
        self.holds = 0
        self.refused = 0

    def hold_window(self, sched) -> None:
        """Hold the floors of the waiting requests vLLM could admit this
        step, those not looked up yet. (Every request is admitted from
        there, a preempted one again after its release.)"""
        limit = sched.scheduler_config.max_num_seqs - len(sched.running)
        if limit <= 0:
            return
        for request in itertools.islice(sched.waiting, limit):
            if request.request_id not in self.held:
                self.hold(request)

    def hold(self, request) -> None:
        tops = [int(request.num_prompt_tokens * f) for f in self.fractions]
        # the whole prefix, not a few pages below each top: a floor is the
        # state a long prefix falls back on, often tens of thousands of
        # tokens below (one walk per request, at page boundaries)
        found = self.states.highest_at_or_below(
            request.block_hashes, tops,
            max_pages=-(-request.num_prompt_tokens // self.states.page))
        pages = sum(len(p) for _, p in found)
        if found and self.held_pages + pages > self.max_pages:
            if not self.refused:
                logger.warning("atom_hybrid_cache: floor states fill their share of the pool "
                               "(%d pages); requests beyond it hold none (see "
                               "ATOM_STATE_CHECKPOINT_FLOOR)", self.max_pages)
            self.refused += 1
            found = []
        for _, p in found:
            self.pool.touch(p)
        self.held_pages += pages if found else 0
        self.holds += bool(found)
        self.held[request.request_id] = found

    def release_all_but(self, keep) -> None:
        """Give back the floors of every request not in `keep` (request ids)
        and forget them: they are looked up again when next in the window."""
        for rid in [r for r in self.held if r not in keep]:
            for _, pages in self.release(rid):
                self.pool.free_blocks(pages)

    def release(self, request_id: str) -> list:
        """[(position, pages)] the request held, whose references the
        caller gives back (with the request's pages)."""
        found = self.held.pop(request_id, None) or []
        self.held_pages -= sum(len(p) for _, p in found)
        return found
