"""Release: a freed request's pages go back to vLLM's shared LRU in units.

`free_in_units` collects the request's pages from every KV cache group, the
states the plugin held for it (prompt-end anchor, floors) and a few older
states of its prefix (`core.eviction.refreshed_positions`, spaced out:
`spaced_refreshed`), and frees them
in the core's order (`core.eviction.eviction_order`), priced where vLLM's
free queue is (`priced_free_queue.py`).
"""

from __future__ import annotations

from vllm.v1.kv_cache_interface import MambaSpec

from ..core.eviction import (FreedState, KVPages, freed_order, freed_units,
                             refreshed_positions, spaced_refreshed)
from ..core.priced_eviction import span_prices


def free_in_units(sched, parts, request) -> None:
    planner = parts.planner
    rid = request.request_id
    anchor = parts.anchors.release(rid)
    floors = parts.floors.release(rid) if parts.floors is not None else ()
    kvm = sched.kv_cache_manager
    pool = kvm.block_pool
    states: list[FreedState] = []
    kv: list[KVPages] = []
    held = set()
    kept = []
    primary = parts.state_groups[0]
    for g, m in enumerate(kvm.coordinator.single_type_managers):
        blocks = m.pop_blocks_for_free(rid)
        if not isinstance(m.kv_cache_spec, MambaSpec):
            kv.append(KVPages(m.block_size, blocks, _indexed(blocks)))
            continue
        # a state group's table is null but for its few states (vLLM does
        # not count the null page's references: it goes nowhere)
        for b in [b for b in blocks if not b.is_null]:
            held.add(b.block_id)
            if b.block_hash is not None:
                pos = b.block_hash_num_tokens or 0
                states.append(FreedState(b, pos, True, g))
                if g == primary:
                    kept.append(pos)
            else:
                states.append(FreedState(b, 0, False))
    if anchor is not None:
        # the prompt-end state this request held goes back with its pages
        pos, pages = anchor
        back = _held_states_back(pool, pos, pages, held, parts.state_groups)
        if planner.keeps_prompt_end(pos):
            states += back
            if pos not in kept:
                kept.append(pos)
        else:
            # inside a page and not worth its pages (core/tail_price.py):
            # the copy and the partial KV page go back uncached, reused
            # first; the page-boundary state below stays (where vLLM
            # still caches it: core/tail_price.py)
            states += [FreedState(b.handle, 0, False) for b in back]
            kv = _unindex_partial_pages(pool, pos, kv, pages)
    for pos, pages in floors:
        # held since the request entered the admission window: they go
        # back in its units, below the KV they insure
        states += _held_states_back(pool, pos, pages, held, parts.state_groups)
    # vLLM keeps the prompt-end state in a page of its own (a copy of the
    # state at the prefill's last hash boundary), not in the block table:
    # count it here when this request did not hold it
    prompt_end = parts.anchors.prompt_end(request)
    if (anchor is None and prompt_end and prompt_end not in kept
            and parts.anchors.states_at(request, prompt_end) is not None):
        kept.append(prompt_end)
    states += _refreshed_states(parts, request, held, kept)
    # the store keeps a record of each unit; without it only the order is
    # needed (the same arithmetic, no object a page)
    freed = freed_units(states, kv) if parts.store is not None else None
    spans = [] if parts.priced_queue is not None and parts.priced_queue.order.weight > 0 else None
    order = freed.order(spans) if freed is not None else freed_order(states, kv, spans)
    if spans is not None:
        parts.priced_queue.set_prices(order, span_prices(spans))
    unit = sched.hash_block_size
    planner.finished(rid, request.block_hashes, kept, request.num_computed_tokens // unit)
    if sched._request_blocks_can_be_freed(request):
        pool.free_blocks(order)
        if freed is not None:
            _watch_units(pool, parts.store, request, freed)
    else:
        # drained in reverse (see vLLM's Scheduler._drain_deferred_frees)
        sched.deferred_frees.append((sched.sched_step_seq, order[::-1]))


def _indexed(blocks) -> list:
    """Whether each of a request's KV pages is indexed. vLLM indexes a
    request's pages in order as they fill, so the indexed ones are a prefix
    of its table: found by bisection, a few reads where a long prompt frees
    hundreds of pages in the step. A table of another shape (null pages,
    e.g. out of a sliding window, which count as uncached) is read page by
    page."""
    n = len(blocks)
    if not n or blocks[0].is_null or blocks[-1].is_null:
        return [b.block_hash is not None for b in blocks]
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if blocks[mid].block_hash is not None:
            lo = mid + 1
        else:
            hi = mid
    if lo < n and blocks[-1].block_hash is not None:
        return [b.block_hash is not None for b in blocks]   # not a prefix
    return [True] * lo + [False] * (n - lo)


def _watch_units(pool, store, request, freed) -> None:
    """Register the freed units with the store connector, and have vLLM
    call it when it reuses one of their pages (`BlockPool.unpin_blocks`'s
    watcher; taking a reference and giving it back through it keeps each
    page where `free_blocks` put it in the LRU)."""
    store.spill_registry.register(store.unit_hashes(request), freed)
    watched = [h for u in freed.units for h in u.states + [b for _, _, b in u.kv]]
    pool.touch(watched)
    pool.unpin_blocks(watched, on_reuse=store.spill_registry.on_reuse)


def give_back_held(sched, parts, request) -> None:
    """Without units (`ATOM_STATE_CHECKPOINT_EVICTION=lru`, or vLLM's
    release bookkeeping missing): the references the plugin held for the
    request go back before vLLM frees its pages in vLLM's order."""
    rid = request.request_id
    pool = sched.kv_cache_manager.block_pool
    anchor = parts.anchors.release(rid) if parts.anchors is not None else None
    floors = parts.floors.release(rid) if parts.floors is not None else ()
    for _, pages in ([anchor] if anchor is not None else []) + list(floors):
        pool.free_blocks(pages)
    unit = sched.hash_block_size
    parts.planner.finished(rid, request.block_hashes, (), request.num_computed_tokens // unit)


def _unindex_partial_pages(pool, pos: int, kv: list, state_pages) -> list:
    """Take a prompt-end state at `pos` inside a page out of vLLM's index:
    its state pages and, in each KV group, the page holding the tokens up
    to it (indexed as a partial block). `kv` with those pages uncached."""
    pool.evict_blocks({b.block_id for b in state_pages})
    out = []
    for pages in kv:
        i = pos // pages.block_size - pages.first_column
        if 0 <= i < len(pages.handles) and pages.cached[i] and pos % pages.block_size:
            pool.evict_blocks({pages.handles[i].block_id})
            cached = list(pages.cached)
            cached[i] = False
            pages = KVPages(pages.block_size, pages.handles, cached, pages.first_column)
        out.append(pages)
    return out


def _held_states_back(pool, pos: int, pages, held: set, groups) -> list[FreedState]:
    """A state the plugin held a reference on (the prompt-end anchor, a
    floor; `pages` in the order of the state `groups`), given back with the
    freed request's pages, in its unit. A page still in its block table
    (`held`) only loses our reference: vLLM's goes back with the table."""
    out = []
    for b, g in zip(pages, groups):
        if b.block_id in held:
            pool.free_blocks([b])
        else:
            held.add(b.block_id)
            out.append(FreedState(b, pos, True, g))
    return out


def _refreshed_states(parts, request, held: set, kept: list) -> list[FreedState]:
    """The states other requests left on this prefix that leave with this
    request's KV in unit order (`refreshed_positions`, spaced from the
    states it keeps, `kept`: `spaced_refreshed`): taken back from where the
    LRU holds them."""
    plan = parts.planner.plans.get(request.request_id)
    hit = plan.hit if plan is not None else 0
    policy = parts.planner.policy
    wanted = refreshed_positions(hit, request.num_computed_tokens,
                                 policy.retain_fractions)
    found = parts.states.highest_at_or_below(request.block_hashes, wanted)
    pool = parts.states.pool
    out = []
    for pos, blocks in spaced_refreshed(found, kept, hit, policy.refresh_spacing_tokens):
        new = [(b, g) for b, g in zip(blocks, parts.state_groups) if b.block_id not in held]
        pool.touch([b for b, _ in new])
        for b, g in new:
            held.add(b.block_id)
            out.append(FreedState(b, pos, True, g))
    return out
