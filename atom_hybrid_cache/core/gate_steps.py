"""The admission gate from one step to the next: which waiting prefills it
holds, which hit pages it pins, and what it remembers for the next step.

The vLLM adapter (`vllm/admission_gate.py`) and the planner's model of the
plugin (`shared_pool_manager.py`) each look the window's requests up in
their own pool, hand the candidates here, and pin and hold what this
decides; the page arithmetic is `admission.decide`. Pages are opaque
handles; `key(page)` names one (vLLM's block id, the model's page number).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from .admission import GateCandidate, decide
from .stats import CacheStats


@dataclass
class GateLookup:
    """A waiting request that starts on a prefix lookup: `hit_pages` (per
    group, the hit's pages), `hit` tokens, `need` pages to admit it,
    `tokens` it computes, `evictable` (the hit pages nobody references,
    bottom up)."""

    request_id: str
    hit_pages: tuple
    hit: int
    need: int
    tokens: int
    evictable: list = field(default_factory=list)


@dataclass
class GateDecision:
    """One step: `pinned`, referenced through the step and given back in
    this order after it; `held`, indices of the candidates kept out of it."""

    pinned: list = field(default_factory=list)
    held: list = field(default_factory=list)


def protected_pages(candidates: Sequence, key: Callable) -> dict:
    """{key: page} of the candidates' evictable hit pages, in window order,
    each prefix bottom up."""
    protected: dict = {}
    for c in candidates:
        # (a page's key names it alone: a page met again keeps its first
        # place, as with setdefault, at C speed over a long prefix)
        protected.update(zip(map(key, c.evictable), c.evictable))
    return protected


def unprotect_last(hit_pages: Sequence, protected: dict, room: int, key: Callable) -> int:
    """What runs must finish: the last candidates' prefixes (`hit_pages`,
    per candidate the pages of each group, bottom up) lose their protection
    first, until the running requests' reserve fits; the room left.

    A prefix loses its pages top down, every group's top together: the hit
    then falls back to a lower boundary that may still hold a state, where
    losing its bottom pages would leave nothing of it usable."""
    for groups in reversed(hit_pages):
        depth = max((len(g) for g in groups), default=0)
        for d in range(1, depth + 1):
            for group in groups:
                if room >= 0:
                    return room
                if d <= len(group) and protected.pop(key(group[-d]), None) is not None:
                    room += 1
    return room


def gate_step(candidates: Sequence, protected: dict, room: int, token_budget: int,
              anything_running: bool, overdue=frozenset(), key: Callable = lambda p: p
              ) -> tuple[list, list]:
    """(indices held, pages pinned). `candidates` have `request_id`, `need`,
    `tokens` and `hit_pages`; `overdue`: ids of requests held too long to be
    held again."""
    held, alone, room = decide([GateCandidate(c.need, c.tokens, c.request_id in overdue)
                                for c in candidates], room, token_budget, anything_running)
    if alone:
        # the lone request evicts what it must: nothing is pinned
        return held, []
    if room < 0:
        # an overdue request goes: the held ones' prefixes make its room,
        # or vLLM would find the pool pinned full and schedule nothing
        unprotect_last([candidates[i].hit_pages for i in held], protected, room, key)
    # given back in reverse: the last request's top pages end up nearest
    # the LRU head, as vLLM frees a request's pages tail first
    return held, list(protected.values())[::-1]


class GateSteps:
    def __init__(self, stats: Optional[CacheStats] = None) -> None:
        """`stats`: where the holds are counted (the planner's)."""
        self.stats = stats if stats is not None else CacheStats()
        self._stalled = False   # the last gated step scheduled nothing
        # request id -> steps held, for the requests that can still be held
        self._holds: dict = {}
        # request id -> (hit pages, hit): the last step's lookups whose pages
        # it pinned; only a step's allocations evict, so they still stand
        # (one may have grown since: the gate then holds what could go)
        self._lookups: dict = {}

    def begin(self) -> Optional[dict]:
        """The remembered lookups of this step ({request id: (hit pages,
        hit)}), or None: the last gated step scheduled nothing, so this one
        is vLLM's admission. Either way they are forgotten here."""
        remembered, self._lookups = self._lookups, {}
        if self._stalled:
            self._stalled = False
            return None
        return remembered

    def forget_lookups(self) -> None:
        self._lookups = {}

    def decide(self, candidates: Sequence[GateLookup], free_pages: int, running_reserve: int,
               token_budget: int, anything_running: bool, max_hold_steps: int,
               key: Callable = lambda p: p) -> GateDecision:
        """The step for these candidates (the admission window's, in queue
        order), `free_pages` in the pool, `running_reserve` pages the running
        prefills still take, `token_budget` tokens vLLM has left for them."""
        self._holds = {c.request_id: self._holds[c.request_id] for c in candidates
                       if c.request_id in self._holds}
        overdue = {rid for rid, n in self._holds.items() if n >= max_hold_steps}
        protected = protected_pages(candidates, key)
        evictable_hit_pages = len(protected)
        room = free_pages - evictable_hit_pages - running_reserve
        if room < 0:
            room = unprotect_last([c.hit_pages for c in candidates], protected, room, key)
        held, pinned = gate_step(candidates, protected, room, token_budget, anything_running,
                                 overdue, key)
        # only what this step pins is safe from its allocations (a step in
        # which the smallest request goes alone pins nothing)
        if len(pinned) == evictable_hit_pages:
            # every evictable hit page pinned (the common step): no page walk
            self._lookups = {c.request_id: (c.hit_pages, c.hit) for c in candidates}
        else:
            pinned_keys = {key(p) for p in pinned}
            self._lookups = {c.request_id: (c.hit_pages, c.hit) for c in candidates
                             if all(key(p) in pinned_keys for p in c.evictable)}
        # a hold counts toward the limit only where vLLM would have admitted
        # the request (its new pages and its unreferenced hit pages free):
        # one the pool cannot take yet is not starved by the gate, and
        # counting it would make it overdue just as it fits
        counted = [i for i in held
                   if candidates[i].need + len(candidates[i].evictable) <= free_pages]
        if counted:
            for i in counted:
                rid = candidates[i].request_id
                self._holds[rid] = self._holds.get(rid, 0) + 1
            self.stats.record_gate_step([self._holds[candidates[i].request_id] for i in counted])
        return GateDecision(pinned, held)

    def end(self, decision: Optional[GateDecision], scheduled_tokens: Optional[int]) -> None:
        """After the step: `scheduled_tokens`, None if it raised."""
        if decision is None:
            return
        self._stalled = (scheduled_tokens is not None and bool(decision.held or decision.pinned)
                         and not scheduled_tokens)


def gate_on(mode: str) -> bool:
    """Whether `ATOM_ADMISSION_GATE=mode` gates a pool whose states the
    plugin manages, as `vllm/scheduler_setup.py` decides it: `auto` is on
    at every pool size. No line in checkpoints' worth: measured on the
    scheduler bench's sample and the 84-cell small-pool sweep, the gate
    keeps the plugin at or above native everywhere but the places
    BENCHMARKS.md, "Small pools", names (gate-off is below in 11 cells)."""
    return mode != "off"
