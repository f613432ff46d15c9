"""Floor states: each live request holds the states deep under its prefix
(`ATOM_STATE_CHECKPOINT_FLOOR`, on by default in a vLLM server).

Why: a waiting or running request's KV prefix is held, but the states at
lower positions of it sit alone in the LRU, and under pressure a round's new
pages come from there first; after a few rounds a long prefix has KV and no
state below its top, and the next cut of its top costs all of it. So from
its first step in vLLM's admission window to its release, a request holds
the highest state at or below each floor fraction of its prompt; the
release gives them back in its units (`release.free_in_units`). All floors
together stay under `FLOOR_MAX_POOL_SHARE` of the pool, less where a
request slot's share is near the line (`core.pool_budget.floor_scale`).
What a request asks for and may hold is `core.floor_ledger`'s, which the
planner's model of the plugin runs too; this adapter finds the states in
vLLM's pool.
"""

from __future__ import annotations

import itertools
import logging

from ..core.floor_ledger import FloorLedger
from ..core.stats import CacheStats
from .state_search import StateSearch

logger = logging.getLogger("atom_hybrid_cache")


def _warn_share_full(max_pages: int) -> None:
    logger.warning("atom_hybrid_cache: floor states fill their share of the pool "
                   "(%d pages); requests beyond it hold none (see "
                   "ATOM_STATE_CHECKPOINT_FLOOR)", max_pages)


class FloorStates:
    def __init__(self, pool, states: StateSearch, policy, num_pages: int,
                 stats: CacheStats | None = None) -> None:
        """`policy`: the pool's `core.policy.CheckpointPolicy` (its floor
        fractions and the floors' pool share); `stats`: where the requests
        that hold floors are counted (`floor_holds`: the planner's, so they
        reach the log lines)."""
        self.pool = pool
        self.states = states
        self.num_pages = num_pages
        # what each request holds, and the share (core.floor_ledger)
        self.ledger = FloorLedger(policy.floor_ledger_fractions,
                                  policy.floor_max_pages(num_pages), stats, _warn_share_full)

    def resize(self, policy) -> None:
        """The floors' pool share for `policy`'s request slot share now
        (floors held stay; the next takes see it)."""
        self.ledger.max_pages = policy.floor_max_pages(self.num_pages)

    fractions = property(lambda self: self.ledger.fractions)
    max_pages = property(lambda self: self.ledger.max_pages)
    held = property(lambda self: self.ledger.held)
    held_pages = property(lambda self: self.ledger.held_pages)
    refused = property(lambda self: self.ledger.refused)
    stats = property(lambda self: self.ledger.stats)

    @property
    def holds(self) -> int:
        """Requests that held floors."""
        return self.stats.floor_holds

    def hold_window(self, sched) -> None:
        """Hold the floors of the waiting requests vLLM could admit this
        step, those not looked up yet. (Every request is admitted from
        there, a preempted one again after its release.)"""
        limit = sched.scheduler_config.max_num_seqs - len(sched.running)
        if limit <= 0:
            return
        held = self.ledger.held
        for request in itertools.islice(sched.waiting, limit):
            if request.request_id not in held:
                self.hold(request)

    def hold(self, request) -> None:
        # the whole prefix, not a few pages below each top: a floor is the
        # state a long prefix falls back on, often tens of thousands of
        # tokens below (one walk per request, at page boundaries)
        found = self.states.highest_at_or_below(
            request.block_hashes, self.ledger.tops(request.num_prompt_tokens),
            max_pages=-(-request.num_prompt_tokens // self.states.page))
        for _, p in self.ledger.take(request.request_id, found):
            self.pool.touch(p)

    def release_all_but(self, keep) -> None:
        """Give back the floors of every request not in `keep` (request ids)
        and forget them: they are looked up again when next in the window."""
        for rid in [r for r in self.ledger.held if r not in keep]:
            for _, pages in self.release(rid):
                self.pool.free_blocks(pages)

    def release(self, request_id: str) -> list:
        """[(position, pages)] the request held, whose references the
        caller gives back (with the request's pages)."""
        return self.ledger.release(request_id)
