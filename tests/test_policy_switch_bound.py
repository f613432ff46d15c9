"""benchmarks/policy_switch_bound.py: the switch replayed on each policy's
own figures (BENCHMARKS.md, "The knee", switching policies as a run goes)."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from benchmark_modules import load_benchmark


@pytest.fixture(scope="module")
def bound():
    return load_benchmark("policy_switch_bound")


def _hits(**per_policy):
    return {p: OrderedDict((f"r{i}", t) for i, t in enumerate(v)) for p, v in per_policy.items()}


def test_the_live_policy_serves_and_the_leader_takes_over(bound):
    hits = _hits(a=[0, 0, 10, 10], b=[5, 5, 0, 0])
    # a serves r0 (0) and falls 5 behind: b serves r1 (5) and r2 (0);
    # the totals tie at 10, so b stays and serves r3 (0); a leads after it
    assert bound.switched_total(hits, ["a", "b"]) == 5
    # where the lead must pass 5 tokens, a serves r0 and r1 (10 behind), b
    # the rest (0 each)
    assert bound.switched_total(hits, ["a", "b"], margin=5) == 0
    assert bound.switched_total(hits, ["a", "b"], margin=10) == 20
    # b first: it serves all four (a never leads it by more than 0 before r3)
    assert bound.switched_total(hits, ["b", "a"]) == 10


def test_one_way_stays_after_its_first_switch(bound):
    hits = _hits(a=[0, 9, 9, 9], b=[1, 0, 0, 0])
    # a loses r0 by 1: b serves from r1 on, and takes a back after r1
    assert bound.switched_total(hits, ["a", "b"]) == 0 + 0 + 9 + 9
    assert bound.switched_total(hits, ["a", "b"], one_way=True) == 0


def test_first_hits_sum_to_the_sweeps_figures_and_a_switch_does_not_beat_both(bound, sweep):
    """Subset 2 at 200 checkpoints' worth, 1.0x of the published grid (12
    tokens an id, 4 in flight, 600 pages): native-pmu64 1,357,824, the
    plugin 1,357,696 (two 64-token prompt ends lost, nothing gained). The
    plugin live: native-pmu64 serves from the plugin's first loss on, 64
    under native-pmu64; native-pmu64 live: the plugin never leads it."""
    shapes = {2: sweep.Shapes(sweep.subsets(128000, 3, 8)[2], None)}
    cell = dict(subset=2, tokens_per_id=12, in_flight=4, pool_pages=600, cached={})
    hits = bound.cell_hits(cell, shapes, ("native-pmu64", "plugin"))
    assert {p: sum(h.values()) for p, h in hits.items()} == cell["cached"] == {
        "native-pmu64": 1357824, "plugin": 1357696}
    assert len(hits["plugin"]) == len(hits["native-pmu64"]) == 112
    assert bound.switched_total(hits, ["plugin", "native-pmu64"]) == 1357760
    assert bound.switched_total(hits, ["native-pmu64", "plugin"]) == 1357824
