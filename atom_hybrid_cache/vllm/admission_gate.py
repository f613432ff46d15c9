"""Admission: a waiting prefill that would evict the prefixes the other
waiting requests are about to read waits (`ATOM_ADMISSION_GATE`, `auto` by
default: on where the pool holds at least 100 checkpoints' worth).

Why: when a round of resends does not fit the pool, the head of vLLM's LRU
holds the cached prefixes of the requests still waiting; vLLM's first
admissions evict them, each is recomputed and evicts the next. Before each
`schedule()` the gate pins the cached pages of the prefix hits in vLLM's
admission window through the step, and holds what does not fit beside them
and the running requests' reserve (`core.admission.decide`). A gated step
that scheduled nothing is followed by one without the gate, and a request
held `MAX_HOLD_STEPS` times goes through like any other.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from vllm.v1.kv_cache_interface import MambaSpec

from ..config import ADMISSION_GATE_MAX_HOLD_STEPS as MAX_HOLD_STEPS
from ..core.admission import (STATE_PAGES_TO_FINISH, GateCandidate, PageGroup, decide,
                              pages_to_admit, prefill_pages)
from ..core.stats import CacheStats


@dataclass
class GateStep:
    """One step's decision: `pinned`, referenced through `schedule()` and
    given back in this order after it; `held`, kept out of the queue."""

    pinned: list = field(default_factory=list)
    held: list = field(default_factory=list)


@dataclass
class _Candidate:
    request: object
    hit_blocks: tuple
    hit: int
    need: int
    evictable: list = field(default_factory=list)   # hit pages nobody references


class AdmissionGate:
    def __init__(self, stats: CacheStats | None = None) -> None:
        """`stats`: where the holds are counted (the planner's)."""
        self._stalled = False   # the last gated step scheduled nothing
        self.stats = stats if stats is not None else CacheStats()
        # request id -> steps held, for the requests that can still be held
        self._holds: dict[str, int] = {}
        # request id -> (pages, tokens): the last step's lookups whose pages
        # it pinned; only a step's allocations evict, so they still stand
        # (one may have grown since: the gate then holds what could go).
        self._lookups: dict = {}

    def forget_lookups(self) -> None:
        """The cache was reset: no remembered hit stands."""
        self._lookups = {}

    @property
    def held_steps(self) -> int:
        return self.stats.gate_held_steps

    @property
    def longest_hold(self) -> int:
        return self.stats.gate_longest_hold

    def open(self, sched, hits: dict | None = None) -> GateStep | None:
        """Decide the step; pins the protected pages and takes the held
        requests out of `sched.waiting`. None: vLLM's admission this step.
        `hits`: {request id: (pages, tokens)} already looked up this step."""
        remembered, self._lookups = self._lookups, {}
        if self._stalled:
            self._stalled = False
            return None
        waiting = sched.waiting
        if not isinstance(waiting, deque) or not waiting:
            return None
        limit = sched.scheduler_config.max_num_seqs - len(sched.running)
        if limit <= 0:
            return None
        kvm = sched.kv_cache_manager
        managers = kvm.coordinator.single_type_managers
        candidates, protected = _look_up(kvm, itertools.islice(waiting, limit),
                                         {**remembered, **(hits or {})})
        if not candidates:
            return None
        self._holds = {c.request.request_id: self._holds[c.request.request_id]
                       for c in candidates if c.request.request_id in self._holds}
        overdue = {rid for rid, n in self._holds.items() if n >= MAX_HOLD_STEPS}
        room = (kvm.block_pool.get_num_free_blocks() - len(protected)
                - _running_reserve(managers, sched.running))
        if room < 0:
            room = _unprotect_last(candidates, protected, room)
        step = _decide(sched, candidates, protected, room, overdue)
        kvm.block_pool.touch(step.pinned)
        # only what this step pins is safe from its allocations (a step in
        # which the smallest request goes alone pins nothing)
        pinned = {b.block_id for b in step.pinned}
        self._lookups = {c.request.request_id: (c.hit_blocks, c.hit) for c in candidates
                         if all(b.block_id in pinned for b in c.evictable)}
        if step.held:
            for r in step.held:
                self._holds[r.request_id] = self._holds.get(r.request_id, 0) + 1
            self.stats.record_gate_step([self._holds[r.request_id] for r in step.held])
            held_ids = {id(r) for r in step.held}
            kept = [r for r in waiting if id(r) not in held_ids]
            waiting.clear()
            waiting.extend(kept)
        return step

    def close(self, sched, step: GateStep | None, out=None) -> None:
        """After `schedule()` (`out`: its SchedulerOutput, None if it
        raised): the held requests back in their places, the pins given
        back."""
        if step is None:
            return
        if step.held:
            # they were taken from the front of the queue: they go back there
            rest = list(sched.waiting)
            sched.waiting.clear()
            sched.waiting.extend(step.held + rest)
        sched.kv_cache_manager.block_pool.free_blocks(step.pinned)
        self._stalled = (out is not None and bool(step.held or step.pinned)
                         and not out.total_num_scheduled_tokens)


def _page_groups(managers) -> list[PageGroup]:
    return [PageGroup(isinstance(m.kv_cache_spec, MambaSpec), m.block_size) for m in managers]


def _running_reserve(managers, running) -> int:
    """Pages the running requests still take to finish their prefill."""
    groups = _page_groups(managers)
    return sum(prefill_pages(groups, r.num_prompt_tokens,
                             lambda g: len(managers[g].req_to_blocks.get(r.request_id, ())),
                             STATE_PAGES_TO_FINISH)
               for r in running)


def _look_up(kvm, window, hits: dict) -> tuple[list, dict]:
    """The window's requests that start on a prefix lookup, and {block id:
    block} of their hit pages that are evictable now, in window order,
    each prefix bottom up. `hits`: lookups that still stand (made this
    step, or remembered from the last)."""
    groups = _page_groups(kvm.coordinator.single_type_managers)
    candidates, protected = [], {}
    for request in window:
        if request.num_computed_tokens or not kvm.prefix_cache_lookup_enabled(request):
            continue
        found = hits.get(request.request_id)
        if found is None:
            found = kvm.coordinator.find_longest_cache_hit(request.block_hashes,
                                                           request.num_tokens - 1)[:2]
        blocks, hit = found
        evictable = [b for group in blocks for b in group if not b.is_null and b.ref_cnt == 0]
        candidates.append(_Candidate(request, blocks, hit,
                                     pages_to_admit(groups, request.num_tokens, hit), evictable))
        for b in evictable:
            protected.setdefault(b.block_id, b)
    return candidates, protected


def _unprotect_last(candidates, protected: dict, room: int) -> int:
    """What runs must finish: the last candidates' prefixes lose their
    protection first, until the running requests' reserve fits."""
    for c in reversed(candidates):
        for group in c.hit_blocks:
            for b in group:
                if room < 0 and protected.pop(b.block_id, None) is not None:
                    room += 1
    return room


def _decide(sched, candidates, protected: dict, room: int,
            overdue: frozenset | set = frozenset()) -> GateStep:
    """`overdue`: ids of requests held too long to be held again."""
    budget = sched.scheduler_config.max_num_batched_tokens - sum(
        max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in sched.running)
    held, alone = decide([GateCandidate(c.need, c.request.num_tokens - c.hit,
                                        c.request.request_id in overdue) for c in candidates],
                         room, budget, bool(sched.running))
    held_requests = [candidates[i].request for i in held]
    if alone:
        # the lone request evicts what it must: nothing is pinned
        return GateStep([], held_requests)
    # given back in reverse: the last request's top pages end up nearest
    # the LRU head, as vLLM frees a request's pages tail first
    return GateStep(list(protected.values())[::-1], held_requests)
