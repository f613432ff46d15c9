"""Admission: a waiting prefill that would evict the prefixes the other
waiting requests are about to read waits (`ATOM_ADMISSION_GATE`, `auto` by
default: on where the plugin manages the states).

Why: when a round of resends does not fit the pool, the head of vLLM's LRU
holds the cached prefixes of the requests still waiting; vLLM's first
admissions evict them, each is recomputed and evicts the next. Before each
`schedule()` the gate pins the cached pages of the prefix hits in vLLM's
admission window through the step, and holds what does not fit beside them
and the running requests' reserve. A gated step that scheduled nothing is
followed by one without the gate, and a request held `MAX_HOLD_STEPS` times
goes through like any other. What to hold and pin is decided in
`core.gate_steps`, which the planner's model of the plugin runs too; this
adapter looks the requests up in vLLM's pool and pins and holds.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from dataclasses import dataclass, field

from vllm.v1.kv_cache_interface import MambaSpec

from ..config import ADMISSION_GATE_MAX_HOLD_STEPS as MAX_HOLD_STEPS
from ..core.admission import PageGroup, pages_to_admit, pages_to_finish
from ..core.gate_steps import GateDecision, GateSteps
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

    # what the core's decision reads (core.gate_steps.GateLookup's fields)
    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def hit_pages(self) -> tuple:
        return self.hit_blocks

    @property
    def tokens(self) -> int:
        return self.request.num_tokens - self.hit


# a block's id, the key of the gate's page sets (attrgetter: called for
# every hit page of the window in each gated step)
_block_id = operator.attrgetter("block_id")


class AdmissionGate:
    def __init__(self, stats: CacheStats | None = None) -> None:
        """`stats`: where the holds are counted (the planner's)."""
        # the decisions and what they remember from step to step
        self.steps = GateSteps(stats)
        # (vLLM's managers, their page groups)
        self._groups = None

    @property
    def stats(self) -> CacheStats:
        return self.steps.stats

    # (read by the tests and the reset)
    @property
    def _stalled(self) -> bool:
        return self.steps._stalled

    @property
    def _lookups(self) -> dict:
        return self.steps._lookups

    @_lookups.setter
    def _lookups(self, value: dict) -> None:
        self.steps._lookups = value

    def forget_lookups(self) -> None:
        """The cache was reset: no remembered hit stands."""
        self.steps.forget_lookups()

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
        remembered = self.steps.begin()
        if remembered is None:
            return None
        waiting = sched.waiting
        if not isinstance(waiting, deque) or not waiting:
            return None
        limit = sched.scheduler_config.max_num_seqs - len(sched.running)
        if limit <= 0:
            return None
        kvm = sched.kv_cache_manager
        managers = kvm.coordinator.single_type_managers
        if self._groups is None or self._groups[0] is not managers:
            # (the groups are vLLM's for the server's life: read once)
            self._groups = (managers, _page_groups(managers))
        groups = self._groups[1]
        candidates = _look_up(kvm, groups, itertools.islice(waiting, limit),
                              {**remembered, **(hits or {})})
        if not candidates:
            return None
        decision = self.steps.decide(
            candidates, kvm.block_pool.get_num_free_blocks(),
            _running_reserve(managers, groups, sched.running), _token_budget(sched),
            bool(sched.running), MAX_HOLD_STEPS, key=_block_id)
        kvm.block_pool.touch(decision.pinned)
        step = GateStep(decision.pinned, [candidates[i].request for i in decision.held])
        if step.held:
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
        self.steps.end(GateDecision(step.pinned, step.held),
                       None if out is None else out.total_num_scheduled_tokens)


def _page_groups(managers) -> list[PageGroup]:
    return [PageGroup(True, m.block_size, m.kv_cache_spec.num_speculative_blocks)
            if isinstance(m.kv_cache_spec, MambaSpec) else PageGroup(False, m.block_size)
            for m in managers]


def _running_reserve(managers, groups: list[PageGroup], running) -> int:
    """Pages the running requests still take to finish their prefill
    (`groups`: the managers' page groups)."""
    return sum(pages_to_finish(groups, r.num_prompt_tokens, r.num_computed_tokens,
                               lambda g: len(managers[g].req_to_blocks.get(r.request_id, ())))
               for r in running)


def _token_budget(sched) -> int:
    """The step's tokens left after the running prefills' remainders."""
    return sched.scheduler_config.max_num_batched_tokens - sum(
        max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in sched.running)


def _look_up(kvm, groups: list[PageGroup], window, hits: dict) -> list:
    """The window's requests that start on a prefix lookup, with their hit
    pages that are evictable now. `groups`: the page group of each KV cache
    group; `hits`: lookups that still stand (made this step, or remembered
    from the last)."""
    candidates = []
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
    return candidates

