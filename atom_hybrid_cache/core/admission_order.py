"""Hits first (`ATOM_ADMISSION_ORDER=hits-first`): the order in which the
first `max_num_seqs` waiting requests are offered to admission.

vLLM admits in arrival order, and a cold prefill ahead of a resume
allocates its pages from the free queue's head, where the resume's prefix
may sit. Hits first moves the requests that resume on a cached prefix ahead,
the largest hit first (ties keep arrival order); a request passed over
`max_num_seqs` times keeps its place, so a cold prompt is not starved.

The one policy for the vLLM adapter (`vllm/admission_order.py`, which looks
the requests up in vLLM's pool and reorders its queue) and the planner's
model (`shared_pool_window.py`, in the model's pool).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

# rank classes: a request passed over too often; a hit (largest first) and,
# as a hit of 0 behind them, one that cannot be looked up (its prefix
# already computed, or caching off for it); a cold one
_KEEPS_PLACE, _RESUMES, _COLD = 0, 1, 2


def hits_first(request_ids: Sequence, can_look_up: Sequence[bool],
               look_up: Callable[[int], int], passed_over: dict,
               limit: int) -> Optional[list[int]]:
    """The window's new order, as indices into `request_ids` (the first
    `limit` waiting requests, in queue order), or None where it stays.

    `can_look_up[i]`: whether request i starts on a prefix lookup;
    `look_up(i)`: its hit in tokens (asked once each, only where it can
    and has not been passed over `limit` times); `passed_over`: {request
    id: times moved back}, raised here for each request that loses ground
    (the caller forgets a request once it is admitted or freed)."""
    ranks = []
    for i, rid in enumerate(request_ids):
        if passed_over.get(rid, 0) >= limit:
            ranks.append((_KEEPS_PLACE, 0))
        elif not can_look_up[i]:
            ranks.append((_RESUMES, 0))
        else:
            hit = look_up(i)
            ranks.append((_RESUMES, -hit) if hit else (_COLD, 0))
    order = sorted(range(len(ranks)), key=ranks.__getitem__)
    if order == list(range(len(ranks))):
        return None
    for pos, i in enumerate(order):
        if pos > i:
            passed_over[request_ids[i]] = passed_over.get(request_ids[i], 0) + 1
    return order
