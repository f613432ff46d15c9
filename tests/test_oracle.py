"""The prefix oracle: whole chains learned, a chain's reach found by
doubling and halving, equal to a walk over every hash."""

from __future__ import annotations

import random

from atom_hybrid_cache.core.oracle import PrefixOracle


def walked_reach(seen, hashes, cap, start=0) -> int:
    """The reach read hash by hash (the oracle's answer before the search)."""
    n = min(start, cap)
    while n < cap and hashes[n] in seen:
        n += 1
    return n


def chain(prefix, n, tag):
    """`prefix` continued by `n` hashes of its own (a chain's hashes name
    their parents: one continuation shares nothing past the prefix)."""
    return list(prefix) + [(tag, i) for i in range(len(prefix), len(prefix) + n)]


def test_reach_equals_the_walk_on_branching_chains():
    rng = random.Random(7)
    oracle = PrefixOracle(1 << 20)
    chains = [chain([], 300, "root")]
    for k in range(200):
        base = rng.choice(chains)
        cut = rng.randrange(len(base) + 1)
        c = chain(base[:cut], rng.randrange(0, 400), k)
        chains.append(c)
        if rng.random() < 0.6:
            start = rng.randrange(cut + 1)      # a hit below the branch
            oracle.learn(c, start, rng.choice([None, rng.randrange(len(c) + 1)]))
    checked = 0
    for c in chains:
        for cap in {len(c), len(c) // 2, 0}:
            for start in {0, cap // 3, cap}:
                if start <= walked_reach(oracle.seen, c, cap):
                    assert oracle.reach(c, cap, start) == walked_reach(oracle.seen, c, cap, start)
                    checked += 1
    assert checked > 500
    # reach probes a few hashes, not the prefix
    probes = []

    class Counted(set):
        def __contains__(self, h):
            probes.append(h)
            return set.__contains__(self, h)

    long = chain([], 4096, "long")
    oracle.learn(long, 0, 3000)
    oracle.seen = Counted(oracle.seen)
    assert oracle.reach(long, 4096) == 3000
    assert len(probes) <= 2 * 12 + 2


def test_learning_backs_down_to_the_highest_known_parent():
    oracle = PrefixOracle(1 << 20)
    c = chain([], 10, "c")
    oracle.learn(c, 0, 3)
    oracle.learn(c, 6, 8)        # 3..5 computed by a request not finished yet
    assert oracle.seen == set(c[:8])
    # a bound past which it stops: a prefix still
    small = PrefixOracle(4)
    small.learn(c, 2, 9)
    assert small.seen == set(c[:4])
    assert small.reach(c, 10) == 4

