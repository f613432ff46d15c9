"""benchmarks/continuation_bound.py: after the same first turns, which
policy serves the one request that follows best depends on which request
it is (BENCHMARKS.md, "Small pools", why no policy is above both natives
on every workload). In the planner's model; vLLM's scheduler gives the
same rows (tests/e2e/test_scheduler_only_replay.py)."""

from __future__ import annotations

import pytest

from benchmark_modules import load_benchmark


@pytest.fixture(scope="module")
def bound():
    return load_benchmark("continuation_bound")


# (native, native-pmu64, plugin) cached tokens of each conversation's
# continuation: four first prompts of 1,149, 730, 453 and 1,479 tokens, a
# pool of 40 pages (128 tokens; a checkpoint = 3 pages), all four in flight
ROWS = [(0, 0, 1_088), (640, 0, 0), (384, 0, 0), (1_408, 1_472, 1_472)]


def test_the_workload_is_first_turns_and_one_continuation(bound):
    convs = bound.first_turns_then([300, 500], 1)
    assert [len(c["prompts"]) for c in convs] == [1, 2]
    first, second = convs[1]["prompts"]
    assert len(second) == 500 + bound.CONTINUATION_TOKENS and second[:500] == first
    # no first prompt shares a token with another: the first round caches 0
    assert not set(convs[0]["prompts"][0]) & set(first)
    assert bound.planner_runner("native", bound.first_turns_then([300, 500], None), 40) == 0


def test_each_policy_is_beaten_at_some_continuation(bound):
    rows = bound.continuation_table(bound.LENS, bound.POOL_PAGES)
    assert [tuple(r[p] for p in bound.POLICIES) for r in rows] == ROWS
    # the plugin leads in sum; native keeps conversations 1 and 2 at its
    # page-sized unit where the other two spent the pages on prompt-end
    # copies, and loses the last one's 64 tokens to them
    assert [sum(r[p] for r in rows) for p in bound.POLICIES] == [2_432, 1_472, 2_560]
    assert {p: bound.beaten_at(rows, p) for p in bound.POLICIES} == {
        "native": [0, 3], "native-pmu64": [0, 1, 2], "plugin": [1, 2]}


def test_random_first_turns_beat_every_policy_somewhere(bound):
    tally = bound.search(6, seed=0)
    assert tally == {"cases": 24, "every_policy_beaten": 13, "native_beaten": 24,
                     "native-pmu64_beaten": 16, "plugin_beaten": 13,
                     "native_beaten_by_native-pmu64": 24, "native-pmu64_beaten_by_native": 13,
                     "native_best_in_sum": 9, "native-pmu64_best_in_sum": 9,
                     "plugin_best_in_sum": 14}
