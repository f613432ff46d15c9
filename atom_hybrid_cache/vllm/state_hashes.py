"""The block hashes under which vLLM's prefix index holds a state of the
first state group, kept up to date as the index changes (the keys of the
group's mirror of the index, `prefix_index_watch.py`).

Why: the plugin's state walks (a release's refreshed states, the floors, a
lookup whose states are gone) ask position after position whether the
index holds a state there, and a long prompt's walk asks hundreds to
thousands of them, nearly all empty. Asked of vLLM's index, each question
builds the key (the hash and the group's id), hashes it and misses in a dict
of every group's pages; asked of these hashes, it is one membership of a
hash whose own hash Python has already computed, among the states alone,
and a walk can run over the prefix in C (`first_at_or_below`). The pool's
one watcher of the index keeps them through each insert and pop, and
rebuilds them after a reset. A candidate found here is still confirmed in
vLLM's pool.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import compress, count
from typing import Container, KeysView, Optional, Sequence

from . import prefix_index_watch


class StateHashes:
    def __init__(self, pool, group_id: int) -> None:
        # the hashes are the keys of the group's mirror of the index, which
        # the pool's one watcher keeps from now on
        self.watch = prefix_index_watch.of_pool(pool)
        self.group_id = group_id
        self.watch.mirror(group_id)
        self.watch.positions(group_id)

    def current(self) -> Optional[KeysView]:
        """The hashes whose key of this group the index holds now, or None
        where they cannot be kept (callers then ask vLLM's index)."""
        entries = self.watch.mirror(self.group_id)
        return None if entries is None else entries.keys()

    def positions(self) -> Optional[prefix_index_watch.KeyPositions]:
        """Their token positions (`first_at_or_below`'s `positions`)."""
        return self.watch.kept_positions(self.group_id)


def kept_of_pool(pool, group_id: int) -> tuple:
    """(the kept hashes of `group_id`'s states in `pool`, their token
    positions), each None where none are kept; taken from the pool's
    watcher once a generation (a lookup asks for them every time)."""
    watch = prefix_index_watch.existing(pool)
    if watch is None:
        return None, None
    watch.current()   # rewrapped after a reset: a new generation
    taken = watch.taken.get(group_id)
    if taken is not None and taken[0] == watch.generation:
        return taken[1:]
    entries = watch.kept_mirror(group_id)
    if entries is None:
        return None, None   # (not kept: a later ask may find them kept)
    kept = (entries.keys(), watch.kept_positions(group_id))
    watch.taken[group_id] = (watch.generation, *kept)
    return kept


def first_at_or_below(hashes: Container, block_hashes: Sequence, first: int, last: int,
                      step: int = 1, positions=None, unit: int = 0) -> int:
    """How many of the indices first, first - step, ... down to `last` (>= 0)
    come before the first whose hash of `block_hashes` is in `hashes`; the
    number of those indices if none is.

    With `positions` (the hashes' `KeyPositions`, complete) and `unit` (the
    tokens a hash of `block_hashes` adds: index i hashes (i + 1) * unit
    tokens), only the indices where some kept hash sits are read, a few in
    a long prefix. Without, it runs in C over a slice of the list (every
    `step`-th hash, downwards: a copy of the few asked, where an iterator
    from the list's end would step over every hash above them)."""
    n = len(block_hashes)
    total = (first - last) // step + 1 if first >= last else 0
    if positions is not None and unit > 0 and positions.complete():
        return _first_at_kept_positions(hashes, block_hashes, first, last, step,
                                        positions.order, unit, total)
    # indices past the list (a top above its last full unit) hold nothing
    skip = min(total, max(0, -(-(first - n + 1) // step)))
    if skip == total:
        return total
    top = first - skip * step
    asked = block_hashes[top:last - 1 if last else None:-step]
    found = next(compress(count(), map(hashes.__contains__, asked)), None)
    return total if found is None else skip + found


def _first_at_kept_positions(hashes, block_hashes, first: int, last: int, step: int,
                             order: list, unit: int, total: int) -> int:
    """`first_at_or_below` over the kept positions (`order`, ascending): a
    hash of `block_hashes` is kept only where its prefix length is one of
    them, so the indices at no kept position are not read. Why: each read is
    of a long-ago request's hash object, a cache miss; a state lookup of a
    250k-token prompt whose states are gone read ~5,000 of them."""
    n = len(block_hashes)
    top = min(first, n - 1)
    if top < last:
        return total
    lo = bisect_left(order, (last + 1) * unit)
    for k in range(bisect_right(order, (top + 1) * unit) - 1, lo - 1, -1):
        pos = order[k]
        i = pos // unit - 1
        if pos % unit or (first - i) % step:
            continue
        if block_hashes[i] in hashes:
            return (first - i) // step
    return total
