"""Admission: hits first (`ATOM_ADMISSION_ORDER=hits-first`). Among the
first `max_num_seqs` waiting requests, those that resume on a cached prefix
go first, the largest hit first: vLLM admits in arrival order, and a cold
prefill ahead of them allocates its pages from the LRU head, where their
prefixes sit. A request passed over `max_num_seqs` times keeps its place.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Optional


def order_waiting(sched, passed_over: dict, hits: Optional[dict] = None) -> None:
    """Reorder `sched.waiting` (FCFS deques only) before vLLM's `schedule()`.

    `passed_over` ({request id: times}) is the scheduler's record of how
    often each request was moved back; the scheduler forgets a request when
    it is admitted or freed. `hits`, if given, keeps each lookup ({request
    id: (pages, tokens)}) for the admission gate of the same step: nothing
    is allocated in between, so its lookups would find the same."""
    waiting = sched.waiting
    if not isinstance(waiting, deque) or len(waiting) < 2:
        return
    limit = sched.scheduler_config.max_num_seqs
    if len(sched.running) >= limit:
        return
    window = list(itertools.islice(waiting, limit))
    kvm = sched.kv_cache_manager
    coordinator = kvm.coordinator

    def rank(request) -> tuple:
        if passed_over.get(request.request_id, 0) >= limit:
            return (0, 0)
        if request.num_computed_tokens or not kvm.prefix_cache_lookup_enabled(request):
            return (1, 0)
        blocks, hit = coordinator.find_longest_cache_hit(request.block_hashes,
                                                         request.num_tokens - 1)[:2]
        if hits is not None:
            hits[request.request_id] = (blocks, hit)
        return (1, -hit) if hit else (2, 0)

    ranks = [rank(r) for r in window]
    order = sorted(range(len(window)), key=lambda i: ranks[i])
    if order == list(range(len(window))):
        return
    for pos, i in enumerate(order):
        if pos > i:  # moved back: passed over this step
            rid = window[i].request_id
            passed_over[rid] = passed_over.get(rid, 0) + 1
    rest = list(itertools.islice(waiting, len(window), None))
    waiting.clear()
    waiting.extend([window[i] for i in order] + rest)
