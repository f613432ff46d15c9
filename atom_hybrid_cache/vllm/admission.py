"""Admission: before each step the requests in flight size a request
slot's share of the pool (`size_share`); a request's checkpoints are
planned when vLLM first sizes its prefill chunk (`chunk_tokens`, from
`_mamba_block_aligned_split`), each chunk ends on the next planned
checkpoint, and the step's admissions are
counted once vLLM has scheduled them (`after_schedule`). The plan itself is
the core's (`CheckpointPlanner.plan`).
"""

from __future__ import annotations

from .priced_free_queue import queue_at_weight


def size_share(sched, parts) -> None:
    """Before vLLM's step: the requests in flight (running and waiting, as
    the planner counts them) size a request slot's share of the pool
    (`core.slot_share`): the floors' pool share follows it, and where it
    just fell under the line and the policy now prices, vLLM's free queue
    turns priced (a pool that never falls under keeps vLLM's own queue, and
    its speed)."""
    policy = parts.planner.policy
    if not policy.observe_in_flight(len(sched.running) + len(sched.waiting)):
        return
    if parts.floors is not None:
        parts.floors.resize(policy)
    if parts.units_on_release:
        parts.priced_queue = queue_at_weight(sched.kv_cache_manager.block_pool, policy,
                                             parts.priced_queue)


def kv_prefix_tokens(pool, kv_groups, request, hash_unit: int, hit: int = 0) -> int:
    """How far the KV groups `kv_groups` ([(group id, block size)]) alone
    hold `request`'s prompt in `pool`, in whole blocks of each, the shortest
    group's answer; the walk starts at `hit`, which every group serves."""
    hashes = request.block_hashes
    limit = request.num_tokens - 1
    best = None
    for g, step in kv_groups:
        n = hit // step * step
        while n + step <= limit:
            i = (n + step) // hash_unit - 1
            if i >= len(hashes) or pool.get_cached_block(hashes[i], [g]) is None:
                break
            n += step
        best = n if best is None else min(best, n)
    return best or 0


def chunk_tokens(sched, parts, request, n: int, start: int, local_hit: int) -> int:
    """How many of the `n` tokens vLLM would schedule for `request` from
    `start` this prefill chunk computes: up to the next planned checkpoint
    (without interior extraction a linear layer stores a state only at a
    chunk's end). A request not started yet (new or preempted) is planned
    from this admission's hit first; one waiting for room is asked again
    every step, and replanned only when its hit moved. `local_hit`: the
    tokens its GPU prefix cache serves."""
    planner = parts.planner
    rid = request.request_id
    plan = planner.plans.get(rid)
    # (a request a KV connector loaded starts past 0, and unplanned)
    if request.num_computed_tokens == 0 or plan is None:
        if plan is None or plan.hit != start:
            reach = kv_prefix_tokens(sched.kv_cache_manager.block_pool, parts.kv_groups,
                                     request, sched.hash_block_size, local_hit)
            planner.plan(rid, request.num_prompt_tokens, request.block_hashes, hit=start,
                         kv_reach=max(start, reach))
    parts.step_prefills[rid] = request
    end = planner.chunk_stop(rid, start, start + n)
    if end >= request.num_prompt_tokens and parts.anchors is not None:
        parts.anchors.pending.add(rid)
    return end - start


def after_schedule(sched, parts, out) -> None:
    """Count the step's admissions (what each reused), teach the oracle
    the prefill chunks' hashes, count the states its forwards write from
    inside, and hold the prompt-end states of the
    prompts now scheduled to their end."""
    planner = parts.planner
    for new in out.scheduled_new_reqs:
        # vLLM's model runner V2 lists a resumed (preempted) request here
        # too, V1 with the cached ones: admitted once either way, as the
        # replay counts it
        if sched.requests[new.req_id].num_preemptions:
            _count_resumed(sched, planner, out, new.req_id)
        else:
            planner.admitted(new.req_id, new.num_computed_tokens)
        parts.passed_over.pop(new.req_id, None)
    for rid in out.scheduled_cached_reqs.resumed_req_ids:
        _count_resumed(sched, planner, out, rid)
        parts.passed_over.pop(rid, None)
    if parts.step_prefills:
        # (only prefills size a chunk: a decode step walks nothing here)
        unit = sched.hash_block_size
        scheduled = out.num_scheduled_tokens
        for rid, request in parts.step_prefills.items():
            n = scheduled.get(rid)
            if not n:
                continue
            end = request.num_computed_tokens
            planner.chunk_scheduled(request.block_hashes, (end - n) // unit,
                                    min(end, request.num_prompt_tokens) // unit)
            if planner.interior_readable:
                planner.forward_scheduled(rid, end - n, end)
        parts.step_prefills.clear()
        planner.step_scheduled()
    if parts.anchors is not None and parts.anchors.pending:
        parts.anchors.hold_pending(sched.requests)


def _count_resumed(sched, planner, out, rid: str) -> None:
    """What a resumed request computes again (vLLM has counted this step's
    tokens as computed already)."""
    request = sched.requests[rid]
    hit = request.num_computed_tokens - out.num_scheduled_tokens[rid]
    planner.resumed(rid, request.num_tokens - hit)
