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



def test_queued_learning_answers_as_learning_at_once():
    # the same chunks, one oracle learning each at once, the other queueing
    # them and catching up now and then: every reach equal, and what each
    # holds equal once the queue is learned
    rng = random.Random(11)
    now, later = PrefixOracle(1 << 20), PrefixOracle(1 << 20)
    chains = [chain([], 200, "root")]
    reads = 0
    for k in range(400):
        base = rng.choice(chains)
        cut = rng.randrange(len(base) + 1)
        c = chain(base[:cut], rng.randrange(1, 300), k)
        chains.append(c)
        # its prefill in chunks from a hit (sometimes above what is known:
        # a connector's load), each queued at its step's end
        pos = rng.randrange(cut + 1)
        while pos < len(c):
            stop = min(len(c), pos + rng.randrange(1, 120))
            now.learn(c, pos, stop)
            later.learn_later([(c, pos, stop)])
            pos = stop
            roll = rng.random()
            if roll < 0.2:
                later.catch_up()
            elif roll < 0.3:
                later.catch_up(keep_units=100)
                assert later.queued_units <= 100
            elif roll < 0.4:
                # a quiet step's slice: the oldest chunk may be learned in part
                before = later.queued_units
                cap = rng.randrange(1, 60)
                later.catch_up(max_units=cap)
                assert later.queued_units == max(0, before - cap)
            probe = rng.choice(chains)
            start = rng.randrange(len(probe) + 1)
            if start <= walked_reach(now.seen, probe, len(probe)):
                assert later.reach(probe, len(probe), start) == now.reach(probe, len(probe), start)
                reads += 1
        if rng.random() < 0.3:      # a release: what it generated
            g = chain(c, 5, f"out{k}")
            now.learn(g, len(c))
            later.learn(g, len(c))
    assert reads > 1000
    later.catch_up()
    assert later.seen == now.seen and later.queued == [] and later.queued_units == 0


def test_a_capped_catch_up_learns_the_oldest_chunk_in_part():
    oracle = PrefixOracle(1 << 20)
    a, b = chain([], 12, "a"), chain([], 3, "b")
    oracle.learn_later([(a, 0, 10), (b, 0, 3)])
    oracle.catch_up(max_units=4)
    assert oracle.seen == set(a[:4])
    assert oracle.queued == [[a, 4, 10], [b, 0, 3]] and oracle.queued_units == 9
    # the rest still takes the prompt's next chunk into its entry
    oracle.learn_later([(a, 10, 12)])
    assert oracle.queued == [[a, 4, 12], [b, 0, 3]] and oracle.queued_units == 11
    oracle.catch_up(max_units=7)
    assert oracle.seen == set(a[:11])
    assert oracle.queued == [[a, 11, 12], [b, 0, 3]] and oracle.queued_units == 4
    oracle.catch_up(max_units=2)
    assert oracle.seen == set(a) | {b[0]} and oracle.queued == [[b, 1, 3]]
    oracle.catch_up()
    assert oracle.seen == set(a) | set(b) and oracle.queued == []


def test_a_read_learns_only_the_queued_chunks_of_its_chain():
    oracle = PrefixOracle(1 << 20)
    shared = chain([], 4, "sys")
    a, b = chain(shared, 10, "a"), chain(shared, 10, "b")
    oracle.learn(a, 0, 4)
    # a's next chunks extend one entry; b shares a's first 4 only
    oracle.learn_later([(a, 4, 8)])
    oracle.learn_later([(a, 8, 12), (b, 4, 9)])
    assert oracle.queued == [[a, 4, 12], [b, 4, 9]] and oracle.queued_units == 13
    # b's parent (sys's last) is known and b is not a's above 4: a stays queued
    assert oracle.reach(b, 14) == 9
    assert oracle.queued == [[a, 4, 12]] and oracle.queued_units == 8
    assert oracle.reach(a, 14) == 12 and oracle.queued == []
    # an entry whose parent is not known is learned by any read (it walks down)
    c = chain(shared, 6, "c")
    oracle.learn_later([(c, 7, 9)])         # 4..6 loaded, never learned
    assert oracle.reach(a, 14) == 12
    assert oracle.queued == [] and set(c[:9]) <= oracle.seen
