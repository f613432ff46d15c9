"""The stats connector's payload and its Prometheus counters (no server:
the serve test in tests/e2e checks them on /metrics)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from atom_hybrid_cache.core.stats import CacheStats, counter_delta  # noqa: E402
from atom_hybrid_cache.connector.metrics import (AtomCacheStats, AtomPromMetrics,  # noqa: E402
                                                 stats_snapshot)
from atom_hybrid_cache.connector.stats_connector import AtomStatsConnector  # noqa: E402


class _Reporter:
    """The scheduler-side half of AtomStatsConnector without a VllmConfig."""

    get_kv_connector_stats = AtomStatsConnector.get_kv_connector_stats
    report_atom_stats = AtomStatsConnector.report_atom_stats

    def __init__(self):
        self._stats = None
        self._reported = {}
        self.store_counters = None


def test_each_report_carries_what_moved_since_the_last_one():
    stats = CacheStats()
    conn = _Reporter()
    assert conn.get_kv_connector_stats() is None          # no scheduler attached
    conn.report_atom_stats(stats)
    assert conn.get_kv_connector_stats() is None          # nothing moved
    stats.record_admission(1200, 1100, 1100, 1100, 576)
    stats.record_write("anchor")
    stats.record_write("anchor")
    first = conn.get_kv_connector_stats()
    assert first.data == {"admissions": 1, "prompt_tokens": 1200, "reusable": 1100,
                          "kv_reach": 1100, "cached": 576, "paged_match_state_miss": 1,
                          "checkpoint_would_fix": 1, "resumed": 1, "written_by_kind": {"anchor": 2}}
    assert conn.get_kv_connector_stats() is None
    stats.record_admission(600, 0, 0, 0, 0)
    stats.record_write("backoff")
    assert conn.get_kv_connector_stats().data == {
        "admissions": 1, "prompt_tokens": 600, "written_by_kind": {"backoff": 1}}


def test_the_admission_gates_holds_are_counters():
    stats = CacheStats()
    conn = _Reporter()
    conn.report_atom_stats(stats)
    stats.record_gate_step([1, 1])
    stats.record_gate_step([2])
    # the longest hold is no counter: the log line carries it
    assert conn.get_kv_connector_stats().data == {"gate_held_steps": 2, "gate_holds": 3}
    assert stats.gate_longest_hold == 2
    registry = CollectorRegistry()
    types = {t: functools.partial(t, registry=registry) for t in (Counter, Gauge, Histogram)}
    prom = AtomPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
                           {0: ["tiny", "0"]})
    prom.observe({"gate_held_steps": 2, "gate_holds": 3}, 0)
    assert registry.get_sample_value("vllm:atom_admission_gate_held_steps_total",
                                     {"model_name": "tiny", "engine": "0"}) == 2
    assert registry.get_sample_value("vllm:atom_admission_gate_holds_total",
                                     {"model_name": "tiny", "engine": "0"}) == 3


def test_delta_lists_only_counters_that_moved():
    before = stats_snapshot(CacheStats())
    s = CacheStats()
    s.record_admission(600, 0, 0, 0, 0)
    s.record_write("backoff")
    assert counter_delta(stats_snapshot(s), before) == {
        "admissions": 1, "prompt_tokens": 600, "written_by_kind": {"backoff": 1}}


def test_aggregate_sums_and_reduce_flattens_kinds():
    a = AtomCacheStats(data={"admissions": 1, "written_by_kind": {"anchor": 1}})
    a.aggregate(AtomCacheStats(data={"admissions": 2, "cached": 64,
                                     "written_by_kind": {"anchor": 1, "rung": 3}}))
    assert a.reduce() == {"admissions": 3, "cached": 64, "written_by_kind[anchor]": 2,
                          "written_by_kind[rung]": 3}
    assert not a.is_empty()
    a.reset()
    assert a.is_empty()


def test_prometheus_counters_add_the_increments_per_engine():
    registry = CollectorRegistry()
    types = {t: functools.partial(t, registry=registry) for t in (Counter, Gauge, Histogram)}
    prom = AtomPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
                           {0: ["tiny", "0"], 1: ["tiny", "1"]})
    prom.observe({"admissions": 2, "cached": 576, "written_by_kind": {"anchor": 1}}, 0)
    prom.observe({"admissions": 1, "written_by_kind": {"anchor": 2, "rung": 1}}, 0)
    prom.observe({"admissions": 5}, 1)

    def value(name, **labels):
        return registry.get_sample_value(name, labels)

    assert value("vllm:atom_admissions_total", model_name="tiny", engine="0") == 3
    assert value("vllm:atom_admissions_total", model_name="tiny", engine="1") == 5
    assert value("vllm:atom_cached_prompt_tokens_total", model_name="tiny", engine="0") == 576
    assert value("vllm:atom_checkpoints_written_total", model_name="tiny", engine="0",
                 kind="anchor") == 3
    assert value("vllm:atom_checkpoints_written_total", model_name="tiny", engine="0",
                 kind="rung") == 1
