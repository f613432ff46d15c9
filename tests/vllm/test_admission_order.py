"""The admission order under ATOM_ADMISSION_ORDER=hits-first (`order_waiting`):
among the first max_num_seqs waiting requests, those that resume on a cached
prefix go first (largest hit first), and a request passed over max_num_seqs
times keeps its place.

The function runs on a stand-in for the scheduler: a waiting deque, the running
list, and a prefix search that returns fixed hits. The real Scheduler runs it
in tests/vllm/test_scheduler_bench.py and the e2e replay tests."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from atom_hybrid_cache.vllm.admission_order import order_waiting  # noqa: E402


def scheduler(waiting, hits, running=0, max_num_seqs=4):
    def find_longest_cache_hit(block_hashes, max_length):
        return None, hits[block_hashes], 0
    return SimpleNamespace(
        waiting=deque(SimpleNamespace(request_id=r, num_computed_tokens=0, block_hashes=r,
                                      num_tokens=4096) for r in waiting),
        running=[object()] * running,
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        kv_cache_manager=SimpleNamespace(
            coordinator=SimpleNamespace(find_longest_cache_hit=find_longest_cache_hit),
            prefix_cache_lookup_enabled=lambda request: True),
        passed_over={})


def order(s):
    order_waiting(s, s.passed_over)
    return [r.request_id for r in s.waiting]


def test_hits_go_first_largest_first_within_the_admission_window():
    hits = {"cold1": 0, "small": 256, "large": 1024, "cold2": 0, "late": 2048}
    s = scheduler(["cold1", "small", "large", "cold2", "late"], hits)
    # "late" is fifth: outside the window of max_num_seqs = 4, it stays behind
    assert order(s) == ["large", "small", "cold1", "cold2", "late"]
    # cold2 kept its place: nothing behind it moved ahead
    assert s.passed_over == {"cold1": 1}


def test_no_reorder_without_a_free_seat_or_a_queue():
    hits = {"cold": 0, "hit": 512}
    assert order(scheduler(["cold", "hit"], hits, running=4)) == ["cold", "hit"]
    assert order(scheduler(["cold"], hits)) == ["cold"]
    s = scheduler(["hit", "cold"], hits)
    assert order(s) == ["hit", "cold"] and s.passed_over == {}


def test_a_request_passed_over_max_num_seqs_times_keeps_its_place():
    hits = {"cold": 0, "h1": 64, "h2": 128}
    s = scheduler(["cold", "h1", "h2"], hits, max_num_seqs=3)
    for step in range(3):
        assert order(s)[0] != "cold"
        # the hits were not admitted (no room): back to arrival order
        s.waiting = deque(sorted(s.waiting, key=lambda r: ["cold", "h1", "h2"].index(r.request_id)))
    assert s.passed_over == {"cold": 3}
    assert order(s) == ["cold", "h2", "h1"]
