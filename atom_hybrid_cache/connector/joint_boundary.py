"""Where a load from the store resumes: one boundary for the KV and the state.

A resume at J needs the recurrent state after exactly J tokens and the KV
of every token below J. The store holds states (`state@p`, each with the
attention page covering p - 1) and full KV pages (`kv@g,i`). So J is the
highest position such that:
- J is a hash-unit boundary above the GPU's own hit (`local`, a page
  boundary) and at most `num_tokens - 1` (a forward needs a token to
  compute);
- the store holds the state at J;
- every full KV page from `local` up to the page covering J - 1 is held
  (that page comes with the state).
The KV leg is clamped to J by construction: the load brings no KV page past
the one covering J - 1, and a state never lower than its KV. Loading KV past
the state would leave the linear layers without [P, J): silently wrong.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

# State probes per lookup: each can be a round trip to a remote store.
MAX_STATE_PROBES = 24


class JointBoundary(NamedTuple):
    """`position` J; `kv_pages` the full pages loaded from the store (page
    indices, from `local // block_size`); None position: no load, `reason`."""

    position: Optional[int]
    kv_pages: range
    reason: str


def joint_boundary(*, local: int, num_tokens: int, unit: int, block_size: int,
                   kv_pages_held: Callable[[int, int], int],
                   state_held: Callable[[int], bool],
                   max_probes: int = MAX_STATE_PROBES,
                   every_unit: bool = False) -> JointBoundary:
    """`kv_pages_held(first, last)`: how many consecutive full pages from
    page `first` (at most up to `last`) the store holds; `state_held(p)`:
    whether it holds the state at p. Positions are probed top down: every
    unit of the highest page the KV reaches (prompt-end states sit between
    page boundaries), then page boundaries only (where chunk ends put most
    others), or every unit where probes are cheap (`every_unit`: an index
    in memory rather than a remote tier)."""
    first = local // block_size
    top = num_tokens - 1
    if top <= local:
        return JointBoundary(None, range(0), "nothing beyond the GPU's hit")
    # full pages held above the GPU's hit; the state's own page covers one more
    last_full = (top - 1) // block_size
    reach_pages = kv_pages_held(first, last_full)
    cap = min(top, (first + reach_pages + 1) * block_size) // unit * unit
    probes = 0
    pos = cap
    page_floor = (cap - 1) // block_size * block_size
    while pos > local and probes < max_probes:
        probes += 1
        if state_held(pos):
            return JointBoundary(pos, range(first, (pos - 1) // block_size), "loaded")
        pos = (pos - unit if every_unit or pos > page_floor
               else (pos - 1) // block_size * block_size)
    return JointBoundary(None, range(0), "no state above the GPU's hit"
                         if probes < max_probes else "no state within the probes")
