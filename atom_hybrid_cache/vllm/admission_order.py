"""Admission: hits first (`ATOM_ADMISSION_ORDER=hits-first`), on vLLM's
waiting queue. The order is `core.admission_order.hits_first` (the
planner's model runs the same); this file looks the window's requests up in
vLLM's pool and reorders the queue.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Optional

from ..core.admission_order import hits_first


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

    def look_up(i: int) -> int:
        request = window[i]
        blocks, hit = coordinator.find_longest_cache_hit(request.block_hashes,
                                                         request.num_tokens - 1)[:2]
        if hits is not None:
            hits[request.request_id] = (blocks, hit)
        return hit

    order = hits_first([r.request_id for r in window],
                       [not r.num_computed_tokens and kvm.prefix_cache_lookup_enabled(r)
                        for r in window],
                       look_up, passed_over, limit)
    if order is None:
        return
    rest = list(itertools.islice(waiting, len(window), None))
    waiting.clear()
    waiting.extend([window[i] for i in order] + rest)
