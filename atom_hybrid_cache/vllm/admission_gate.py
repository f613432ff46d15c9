"""Admission that does not evict what the waiting requests are about to read
(a vLLM server's default, `ATOM_ADMISSION_GATE=auto`: on where the KV pool
holds at least `core.placement.MIN_POOL_CHECKPOINTS` checkpoints' worth;
`on` forces it, also for attention-only models).

Why: vLLM admits a waiting request whenever its pages can be found, free or
evicted from the head of the shared LRU. When a round of resends does not
fit the pool, that head holds the cached prefixes of the requests still
waiting in the same queue: the first admissions evict them, each evicted
prefix is recomputed when its request is admitted, and its new pages evict
the next. The pages a waiting request reads are needed within steps; the
pages of the requests that just finished are needed a turn later. The gate
makes evictions fall on the latter.

Before each `schedule()`, over the requests vLLM could admit this step (the
first `max_num_seqs - running` waiting ones):

- every cached page of their prefix hits is protected: referenced through
  `schedule()`, so no allocation of this step can evict it, and given back
  after it, at the LRU tail (what waits is read next);
- the room is the evictable pages outside those, less what the running
  requests still need to finish their prefill;
- in queue order, a request whose prefill fits the room goes through and
  takes its pages from the room; one that does not is held out of the
  queue for this step, until the running requests finish and free theirs;
- with nothing running and nothing fitting, the request needing the fewest
  pages goes alone and evicts what it must, so the queue always moves.

A gated step that scheduled nothing (a running request needed more than
was reserved, say) is followed by one step without the gate, and a request
held in `MAX_HOLD_STEPS` steps is not held again: under steady traffic
something always runs, and a large prefill could otherwise wait for ever.

Measured (BENCHMARKS.md, "The admission gate" and "The admission gate by
default", 0.83x the live working set): on the plan's 14 traces at full
length the plugin keeps 0.954 of the oracle against 0.941 with vLLM's
admission, and the attention-only control run with the same gate 0.983
against 0.940.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from vllm.v1.kv_cache_interface import MambaSpec

from ..config import ADMISSION_GATE_MAX_HOLD_STEPS as MAX_HOLD_STEPS
from ..core.stats import CacheStats

# Pages of each state group an admitted prefill takes: the state it writes
# and the prompt-end copy vLLM keeps. A running prefill already has the
# first and still takes the second.
STATE_PAGES_PER_ADMISSION = 2
STATE_PAGES_TO_FINISH = 1


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
    # its hit pages nobody references (the ones the gate can protect)
    evictable: list = field(default_factory=list)


class AdmissionGate:
    def __init__(self, stats: CacheStats | None = None) -> None:
        """`stats`: where the holds are counted (the planner's, so they reach
        its log lines and the metrics)."""
        # the previous gated step scheduled nothing: the next one runs ungated
        self._stalled = False
        self.stats = stats if stats is not None else CacheStats()
        # request id -> steps held, for the requests that can still be held
        self._holds: dict[str, int] = {}
        # request id -> (pages, tokens): the last gated step's lookups of the
        # requests whose evictable hit pages it pinned through the step.
        # Pages are evicted only by a step's allocations, so those hits still
        # stand at the next step (a request that waits behind a long prefill
        # is otherwise looked up again in every step of it). One may have
        # grown since, where another request cached more of a shared prefix;
        # the gate then sees a larger need than vLLM's own lookup will, and
        # may hold what could go. What a request reuses is vLLM's lookup.
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


def _pages_for_prefill(managers, tokens: int, held, state_pages: int) -> int:
    """Pages a prefill to `tokens` still takes: in each attention group those
    beyond the `held(manager)` it has, in each state group `state_pages`."""
    return sum(state_pages if isinstance(m.kv_cache_spec, MambaSpec)
               else max(0, -(-tokens // m.block_size) - held(m)) for m in managers)


def _pages_to_admit(managers, request, hit: int) -> int:
    """Pages the whole prefill of `request` takes beyond its hit."""
    return _pages_for_prefill(managers, request.num_tokens, lambda m: hit // m.block_size,
                              STATE_PAGES_PER_ADMISSION)


def _running_reserve(managers, running) -> int:
    """Pages the running requests still take to finish their prefill."""
    return sum(_pages_for_prefill(managers, r.num_prompt_tokens,
                                  lambda m: len(m.req_to_blocks.get(r.request_id, ())),
                                  STATE_PAGES_TO_FINISH)
               for r in running)


def _look_up(kvm, window, hits: dict) -> tuple[list, dict]:
    """The window's requests that start on a prefix lookup, and {block id:
    block} of their hit pages that are evictable now, in window order,
    each prefix bottom up. `hits`: lookups that still stand (made this
    step, or remembered from the last)."""
    managers = kvm.coordinator.single_type_managers
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
                                     _pages_to_admit(managers, request, hit), evictable))
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
    if not sched.running and all(c.need > room for c in candidates):
        # nothing runs and nothing fits: the smallest goes alone and
        # evicts what it must (the first overdue one, if any)
        late = [c for c in candidates if c.request.request_id in overdue]
        first = late[0] if late else min(candidates, key=lambda c: c.need)
        return GateStep([], [c.request for c in candidates if c is not first])
    budget = sched.scheduler_config.max_num_batched_tokens - sum(
        max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in sched.running)
    held = []
    for c in candidates:
        if budget <= 0:
            break   # vLLM does not reach it this step
        if c.need > room and c.request.request_id not in overdue:
            held.append(c.request)
            continue
        room -= c.need
        budget -= c.request.num_tokens - c.hit
    # given back in reverse: the last request's top pages end up nearest
    # the LRU head, as vLLM frees a request's pages tail first
    return GateStep(list(protected.values())[::-1], held)
