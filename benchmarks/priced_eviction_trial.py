#!/usr/bin/env python3
"""A what-if, not a feature: the small-pool sweep's planner with the
plugin's free order priced by what a resume would recompute.

This is GreedyDual-Size over a release's units, with a recency clock. A
freed page of the plugin leaves at its place in the free order plus WEIGHT
times its unit's price, counted in pages. A unit is a state and the KV
pages between it and the state below (`core/eviction.py`). Its price is
the tokens a resume at its state would recompute if the unit were gone,
down to the state below, over the unit's pages. The price is raised to
the price of the unit above, so that a prefix still leaves from the top.

- Pages without indexed content go first, as in vLLM.
- A page freed again (a pin given back, a floor) keeps the price its
  release gave it.
- WEIGHT 0 is today's LRU. `--no-clock` drops the clock: pure GreedyDual,
  where the inflation value is the key of the last page evicted.

The plugin in vLLM cannot run this, because vLLM's free queue is a FIFO.
The trial changes only the planner's model of the plugin
(`core/shared_pool_manager.py`), by wrapping two of its functions in this
process. Here, then, the planner's figure is not the plugin's. Native
policies keep vLLM's order.

Figures: BENCHMARKS.md, "Eight other groupings of the traces". The
arguments after `--` are `small_pool_sweep.py`'s:

    python benchmarks/priced_eviction_trial.py --weight 1 -- --planner \
        --json benchmarks/results/small_pool_sweep_priced_eviction_1.json
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import small_pool_sweep  # noqa: E402
from atom_hybrid_cache.core import shared_pool_manager, shared_pool_release  # noqa: E402
from atom_hybrid_cache.core.eviction import freed_units  # noqa: E402

FIRST = float("-inf")


class PricedFreeOrder:
    """The free pages of a `PagePool`, in the operations it uses on its
    OrderedDict (len, set, delete, move_to_end, popitem): the page with the
    smallest key is handed out first."""

    def __init__(self, pages, weight: float, clock: bool) -> None:
        self.weight = weight
        self.clock = clock
        self.inflation = 0.0            # pure GreedyDual: the last key evicted
        self.price: dict[int, float] = {}
        self._key: dict[int, tuple] = {}
        self._heap: list = []
        self._turn = itertools.count()
        for p in pages:
            self[p] = None

    def __len__(self) -> int:
        return len(self._key)

    def _push(self, page: int, key: tuple) -> None:
        self._key[page] = key
        heapq.heappush(self._heap, (key, page))

    def __setitem__(self, page: int, _) -> None:
        """Freed with indexed content: behind the pages freed before it,
        by its price."""
        turn = next(self._turn)
        base = turn if self.clock else self.inflation
        self._push(page, (base + self.weight * self.price.get(page, 0.0), turn))

    def move_to_end(self, page: int, last: bool = True) -> None:
        """Freed without content: handed out first (the last such first)."""
        assert not last
        self._push(page, (FIRST, -next(self._turn)))

    def __delitem__(self, page: int) -> None:
        del self._key[page]

    def popitem(self, last: bool = False):
        assert not last
        while True:
            key, page = heapq.heappop(self._heap)
            if self._key.get(page) == key:       # else a stale entry
                del self._key[page]
                self.price.pop(page, None)
                if key[0] != FIRST:
                    self.inflation = max(self.inflation, key[0])
                return page, None


def unit_prices(units) -> dict:
    """{handle: price} for a release's `FreedUnits`: the pages above every
    state cost nothing; a unit's pages cost the tokens between its state
    and the next lower one over its pages, at least the unit above's."""
    prices = {h: 0.0 for _, _, h in units.above}
    price = 0.0
    for u, unit in enumerate(units.units):
        lower = units.units[u + 1].position if u + 1 < len(units.units) else 0
        size = len(unit.states) + len(unit.kv)
        price = max(price, (unit.position - lower) / max(1, size))
        for h in unit.states:
            prices[h] = price
        for _, _, h in unit.kv:
            prices[h] = price
    return prices


def install(weight: float, clock: bool) -> None:
    """Wrap the planner's plugin pool and release in this process."""
    releasing: list = []
    manager_init = shared_pool_manager.SharedPoolManager.__init__
    manager_finish = shared_pool_manager.SharedPoolManager.finish

    def init(self, *args, **kwargs):
        manager_init(self, *args, **kwargs)
        if self.plugin:
            self.pool._free = PricedFreeOrder(list(self.pool._free), weight, clock)

    def finish(self, req):
        releasing.append(self.pool if self.plugin else None)
        try:
            return manager_finish(self, req)
        finally:
            releasing.pop()

    def priced_order(states, kv=()):
        units = freed_units(states, kv)
        pool = releasing[-1] if releasing else None
        if pool is not None:
            pool._free.price.update(unit_prices(units))
        return units.order()

    shared_pool_manager.SharedPoolManager.__init__ = init
    shared_pool_manager.SharedPoolManager.finish = finish
    shared_pool_release.freed_order = priced_order


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, sweep = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weight", type=float, required=True,
                    help="pages of extra life per token a resume would recompute per page")
    ap.add_argument("--no-clock", action="store_true", help="pure GreedyDual")
    args = ap.parse_args(ours)
    if "--planner" not in sweep:
        ap.error("the trial changes the planner only: pass -- --planner")
    install(args.weight, clock=not args.no_clock)
    return small_pool_sweep.main(sweep)


if __name__ == "__main__":
    sys.exit(main())
