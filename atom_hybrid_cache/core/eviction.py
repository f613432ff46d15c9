"""The order a freed request's pages go back to the shared LRU.

A state checkpoint is worth something only with every KV page below it, so a
state and the KV pages between it and the next lower state are one unit,
and units leave from the top: a cut under pressure shortens a conversation
to its next lower checkpoint instead of taking its states first and leaving
KV nobody can resume on (vLLM's own order frees the state groups before the
attention group). Pages are opaque handles here: the vLLM adapter passes
its block objects, already classified.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from typing import Callable, Iterable, NamedTuple, Optional, Sequence


class FreedState(NamedTuple):
    """A state page a freed request gives back: the state after `position`
    tokens when `cached` (indexed), else a running page with no position;
    `group`: its state group (-1: not known)."""

    handle: object
    position: int
    cached: bool
    group: int = -1


class KVPages(NamedTuple):
    """One KV group's pages of a freed request, in column order: page i
    holds tokens [(first_column + i) * block_size, + block_size), and
    `cached[i]` says whether it is indexed. One object per group, not per
    page: a long prompt frees hundreds of pages at once."""

    block_size: int
    handles: Sequence
    cached: Sequence[bool]
    first_column: int = 0


class Unit(NamedTuple):
    """A state and the KV pages between it and the next lower state: what a
    resume at `position` needs beyond the units below. `states` are the
    state pages' handles (`state_groups`: their groups); `kv` lists (KV
    group index, the page's end in tokens, handle), top page first."""

    position: int
    states: list
    kv: list
    state_groups: list = []


class FreedUnits(NamedTuple):
    """A freed request's pages by unit: `uncached` (reused before anything
    is evicted), `above` (KV above every state: no resume can read it) and
    the `units`, top first."""

    uncached: list
    above: list
    units: list

    def order(self, spans: Optional[list] = None) -> list:
        """The handles, first evicted first; `spans` (a list), if given,
        gets (start, stop, position) of each unit's slice of them, top
        first, position None for the pages above every state."""
        out = self.uncached + [h for _, _, h in self.above]
        if spans is not None:
            spans.append((len(self.uncached), len(out), None))
        for unit in self.units:
            start = len(out)
            out += unit.states + [h for _, _, h in unit.kv]
            if spans is not None:
                spans.append((start, len(out), unit.position))
        return out


def _kv_ranges(tops: Sequence[int], pages: KVPages) -> list:
    """[(u, lo, hi)]: one KV group's pages lo..hi-1 (indices into
    `pages.handles`) belong to unit slot u, top slot first: slot 0 holds the
    pages above every state, slot u + 1 those of the state at `tops[u]`
    (tops highest first). Page i is tops[u]'s when
    ceil(tops[u+1] / size) <= first_column + i < ceil(tops[u] / size)."""
    size, n, c0 = pages.block_size, len(pages.handles), pages.first_column
    bounds = [min(n, max(0, -(-pos // size) - c0)) for pos in tops] + [0]
    out = []
    hi = n
    for u, lo in enumerate(bounds):
        if lo < hi:
            out.append((u, lo, hi))
            hi = lo
    return out


def freed_units(states: Sequence[FreedState], kv: Sequence[KVPages] = ()) -> FreedUnits:
    """A KV page belongs to the lowest state above its first token; within a
    unit the pages of several groups go by their end, top first."""
    tops = sorted({b.position for b in states if b.cached}, reverse=True)
    uncached = []
    # pages[0]: KV pages above every state; pages[u + 1]: tops[u]'s pages
    pages: list = [[] for _ in range(len(tops) + 1)]
    for g, run in enumerate(kv):
        size, handles, cached, c0 = run
        uncached += [h for h, c in zip(handles, cached) if not c]
        for u, lo, hi in _kv_ranges(tops, run):
            # from the top page down
            pages[u] += [(g, (c0 + i + 1) * size, handles[i])
                         for i in range(hi - 1, lo - 1, -1) if cached[i]]
    if len(kv) > 1:
        pages = [sorted(unit, key=lambda e: -e[1]) for unit in pages]
    at: dict = {}
    groups: dict = {}
    for b in states:
        if b.cached:
            at.setdefault(b.position, []).append(b.handle)
            groups.setdefault(b.position, []).append(b.group)
        else:
            uncached.append(b.handle)
    return FreedUnits(uncached, pages[0], [Unit(pos, at[pos], pages[u + 1], groups[pos])
                                           for u, pos in enumerate(tops)])


def freed_order(states: Sequence[FreedState], kv: Sequence[KVPages] = (),
                spans: Optional[list] = None) -> list:
    """`freed_units(states, kv).order()` without the units: what a release
    that keeps no record of them frees. With one KV group (the models this
    serves) no object is made per page: a long prompt frees hundreds of
    pages in the scheduler's step, and every tracked object made there
    brings Python's collector nearer, whose passes in a step cost
    milliseconds (BENCHMARKS.md, "The slowest steps"). `spans`: as
    `FreedUnits.order`'s."""
    if len(kv) != 1:
        return freed_units(states, kv).order(spans)
    tops = sorted({b.position for b in states if b.cached}, reverse=True)
    run = kv[0]
    handles, cached = run.handles, run.cached
    # vLLM indexes a request's pages in order as they fill: the indexed ones
    # are the first `k` (then slices, not a test a page, make the order)
    k = cached.index(False) if False in cached else len(cached)
    prefix = not any(cached[k:])
    out = handles[k:] if prefix else [h for h, c in zip(handles, cached) if not c]
    out += [b.handle for b in states if not b.cached]
    pages: list = [()] * (len(tops) + 1)
    for u, lo, hi in _kv_ranges(tops, run):
        if prefix:
            pages[u] = handles[lo:min(hi, k)][::-1]
        else:
            pages[u] = [handles[i] for i in range(hi - 1, lo - 1, -1) if cached[i]]
    at: dict = {}
    for b in states:
        if b.cached:
            at.setdefault(b.position, []).append(b.handle)
    start = len(out)
    out += pages[0]
    if spans is not None:
        spans.append((start, len(out), None))
    for u, pos in enumerate(tops):
        start = len(out)
        out += at[pos]
        out += pages[u + 1]
        if spans is not None:
            spans.append((start, len(out), pos))
    return out


def eviction_order(states: Sequence[FreedState], kv: Sequence[KVPages] = (),
                   reuse_aware: bool = True) -> list:
    """The handles, first evicted first. Uncached pages go first (they are
    reused before anything is evicted anyway); then units from the top.
    Without `reuse_aware`, vLLM's order: KV, then states."""
    if not reuse_aware:
        return [h for run in kv for h in run.handles] + [b.handle for b in states]
    return freed_units(states, kv).order()


def refreshed_positions(hit: int, end: int, retain_fractions: Sequence[float]) -> list[int]:
    """Where a release looks for older states of the prefix to take back
    into its units: the state it resumed from (`hit`) and, for each retain
    fraction, the highest state at or below that fraction of `end` (the
    tokens it computed). Older anchors beyond those are history and stay
    where their own request left them in the LRU."""
    wanted = [hit] if hit else []
    return wanted + [int(end * f) for f in retain_fractions]


def spaced_refreshed(found: Sequence[tuple], kept_positions: Iterable[int], hit: int,
                     min_gap: int) -> list:
    """Of `found` ([(position, pages)], highest first: the states a release
    found at its refreshed positions), those it takes back, highest first.

    A refreshed state is insurance: it is read only where the states above
    it are gone. The highest one is the fallback right under the top: the
    pool takes a prefix's top unit first, and a state a few tokens under it
    turns that cut into a few tokens' recompute; it and the hit's are always
    taken back. Each other one, lowest first, only where it stands at least
    `min_gap` tokens (a checkpoint's KV: what its pages hold) from the
    prompt's start and from every state the release keeps: its own
    (`kept_positions`), the hit, those taken back below it. Closer, it
    saves fewer tokens than its pages' KV would have held, and a prompt
    whose turns end a few dozen tokens apart would keep a state every few
    dozen tokens. `min_gap` 0: all of `found`."""
    if not min_gap or len(found) < 2:
        return list(found)
    top = found[0][0]
    kept = sorted({0, hit, *kept_positions})
    out = []
    for pos, pages in reversed(found):
        i = bisect_left(kept, pos)
        if (i < len(kept) and kept[i] == pos) or pos in (top, hit):
            out.append((pos, pages))
            continue
        if pos - kept[i - 1] >= min_gap and (i == len(kept) or kept[i] - pos >= min_gap):
            out.append((pos, pages))
            insort(kept, pos)
    return out[::-1]


# How far below each top (in state pages) a walk of
# `highest_states_at_or_below` looks by default: the release's refreshed
# states, in the adapter (vllm/state_search.py) and the planner's model.
SEARCH_PAGES = 64


def highest_states_at_or_below(tops, hash_unit: int, page: int, max_pages: int,
                               state_at: Callable[[int], Optional[list]],
                               first_candidate: Optional[Callable[[range, int], int]] = None,
                               kept_positions: Optional[Sequence[int]] = None) -> list:
    """[(position, pages)] of the highest state at or below each of `tops`
    (`state_at(pos)`: the state's pages there, or None), each position once,
    highest first. A walk looks at every hash unit of the page below its top
    (prompt-end states sit between pages), then at page boundaries only
    (where chunk ends put most other states), at most `max_pages` pages down.
    The release (vllm/state_search.py) and the planner's model both walk so.

    `first_candidate(positions, start)`: a caller's cheap filter, the index
    in `positions` (a descending range) at or after `start` of the first
    position that may hold a state, `len(positions)` if none; it must pass
    every position where `state_at` finds one. Without it every position
    is asked. (A long prompt's release asks ~300 positions, nearly all
    empty: a filter that runs in C over the range skips them at a quarter
    of the cost of asking each.)

    `kept_positions`: ascending, every position where any prefix's state
    may be (a superset of where `state_at` finds one): the walks then ask
    only those on their path, found by bisection, in place of the ranges
    (the same answer: a release's five tops among a few dozen kept
    positions, not two filtered ranges a top)."""
    if kept_positions is not None:
        return _highest_at_kept(tops, hash_unit, page, max_pages, state_at, kept_positions)
    found = {}
    # positions a higher top's walk found empty: the walks below cross the
    # same page boundaries (a release asks for five tops in a few pages)
    empty = set()
    units_in_page = -(-page // hash_unit)

    def walk(positions: range) -> bool:
        """Whether the walk of one top ends in `positions` (a state found,
        or one a higher top found)."""
        j = 0
        while True:
            if first_candidate is not None:
                j = first_candidate(positions, j)
            if j >= len(positions):
                return False
            pos = positions[j]
            if pos in found:
                return True
            if pos not in empty:
                pages = state_at(pos)
                if pages is not None:
                    found[pos] = pages
                    return True
                empty.add(pos)
            j += 1

    for top in sorted({t // hash_unit * hash_unit for t in tops if t >= hash_unit},
                      reverse=True):
        lowest = max(top - max_pages * page, 1)
        # every unit down to the first at or below one page under the top,
        # then the page boundaries under that one
        last_unit = top - units_in_page * hash_unit
        if not walk(range(top, max(last_unit - hash_unit, lowest - 1), -hash_unit)):
            walk(range((last_unit - 1) // page * page, lowest - 1, -page))
    return sorted(found.items(), reverse=True)


def _highest_at_kept(tops, hash_unit: int, page: int, max_pages: int,
                     state_at: Callable[[int], Optional[list]],
                     kept_positions: Sequence[int]) -> list:
    """`highest_states_at_or_below` asking only the kept positions on each
    top's path: a position p (a multiple of the hash unit) in
    [lowest, top] is on it where p >= last_unit (the units of the page
    below the top) or p is a page boundary (the rest), highest first."""
    found = {}
    empty = set()
    units_in_page = -(-page // hash_unit)
    for top in sorted({t // hash_unit * hash_unit for t in tops if t >= hash_unit},
                      reverse=True):
        lowest = max(top - max_pages * page, 1)
        last_unit = top - units_in_page * hash_unit
        for k in range(bisect_right(kept_positions, top) - 1,
                       bisect_left(kept_positions, lowest) - 1, -1):
            pos = kept_positions[k]
            if pos % hash_unit or (pos < last_unit and pos % page):
                continue
            if pos in found:
                break
            if pos in empty:
                continue
            pages = state_at(pos)
            if pages is not None:
                found[pos] = pages
                break
            empty.add(pos)
    return sorted(found.items(), reverse=True)
