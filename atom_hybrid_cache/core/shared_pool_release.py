"""The release in the planner's model of the plugin (`shared_pool_manager`),
as `vllm/release.py` runs it in vLLM: a finished request's pages go back to
the one pool in units (`eviction.freed_order`): its states, the prompt-end
state it held, its floors and the states at its hit and retain fractions
(`eviction.refreshed_positions`, spaced out: `eviction.spaced_refreshed`),
each with the KV below it, top first,
priced where the pool's free order is (`priced_eviction`).
Without the plugin, vLLM's own order: group by group, each tail first.
"""

from __future__ import annotations

from .eviction import FreedState, KVPages, freed_order, refreshed_positions, spaced_refreshed
from .priced_eviction import span_prices
from .shared_pool_held import HeldRequest


def free_in_vllm_order(pool, held: HeldRequest, pages_per_state: int) -> None:
    """vLLM's order: the state groups first (the tiny Qwen3-Next's and
    Qwen3.5's group order), then the attention group, each tail first."""
    columns = _state_columns(held)
    for g in range(pages_per_state):
        pool.free(reversed([pages[g] for _, pages in columns if pages]))
    pool.free(reversed(held.kv))


def free_in_units(manager, req, held: HeldRequest) -> None:
    """The plugin's release of `req` (`manager`: the SharedPoolManager it ran
    in, `held`: what it held there)."""
    pool, index = manager.pool, manager.index
    hashes = req.block_hashes
    columns = _state_columns(held)
    if (held.anchor is not None and held.anchor[0] % manager.page
            and not manager.planner.keeps_prompt_end(held.anchor[0])):
        # not worth its pages (core/tail_price.py): the copy and the
        # partial KV entry go back uncached, the page state below stays
        # (where vLLM still caches it: tail_price.py)
        pos, pages = held.anchor
        for p in pages:
            pool.unindex(p)
        # every key of the page, as vLLM's `evict_blocks` drops them: a
        # prompt that fills its last page has it indexed whole as well
        pool.unindex(held.kv[pos // manager.page])
        columns[-1] = (None, pages)
    states: list = []
    taken: set = set()
    for pos, pages in columns:
        states += [FreedState(p, pos, True, g) if pos is not None else FreedState(p, 0, False)
                   for g, p in enumerate(pages)]
        taken.update(pages)
    wanted = refreshed_positions(held.hit, req.num_computed,
                                 manager.policy.retain_fractions)
    if manager.window is not None:
        # floors held since the request entered the admission window go
        # back in its units (vllm/release.py); one in its own block table
        # only loses the floor's reference
        for pos, pages in manager.window.leave(req.request_id):
            for g, p in enumerate(pages):
                if p in taken:
                    pool.free([p])
                else:
                    taken.add(p)
                    states.append(FreedState(p, pos, True, g))
    found = index.highest_states_at_or_below(hashes, wanted)
    own = [pos for pos, _ in columns if pos is not None]
    for pos, pages in spaced_refreshed(found, own, held.hit,
                                       manager.policy.refresh_spacing_tokens):
        new = [(g, p) for g, p in enumerate(pages) if p not in taken]
        pool.touch([p for _, p in new])
        for g, p in new:
            taken.add(p)
            states.append(FreedState(p, pos, True, g))
    kv = KVPages(manager.page, held.kv, [pool.is_indexed(p) for p in held.kv])
    spans = [] if pool.priced else None
    order = freed_order(states, [kv], spans)
    if spans is not None:
        pool.free_order.set_prices(order, span_prices(spans))
    pool.free(order)
    manager.planner.finished(req.request_id, hashes,
                             [pos for pos, _ in columns if pos is not None],
                             req.num_computed // manager.block_size)


def _state_columns(held: HeldRequest) -> list:
    """[(position or None, pages)] of every state the request's tables and
    its prompt-end hold keep, the hold last."""
    columns = held.retired + [(held.running_pos, held.running)]
    if held.anchor is not None:
        columns.append(held.anchor)
    return columns
