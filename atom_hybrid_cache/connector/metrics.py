"""The plugin's counters as vLLM connector stats and Prometheus metrics.

vLLM 0.32 has one channel for a plugin's counters to reach /metrics: a KV
connector's stats (`KVConnectorStats`, carried from the engine core to the
front end, where its `KVConnectorPromMetrics` adds them up). Each step that
moved them, the connector reports how far `CacheStats`'s counters moved.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from ..core.stats import (CacheStats, add_counter_delta, counter_delta, counter_snapshot,
                          flat_counters)

# CacheStats field -> (Prometheus name, help). All are monotonic counts.
COUNTERS = {
    "admissions": ("vllm:atom_admissions", "Requests admitted (first scheduling)."),
    "prompt_tokens": ("vllm:atom_prompt_tokens", "Prompt tokens of admitted requests."),
    "reusable": ("vllm:atom_reusable_prompt_tokens",
                 "Prompt tokens an unbounded cache would have reused."),
    "kv_reach": ("vllm:atom_kv_prefix_tokens",
                   "Prompt tokens the KV pool still held a prefix of at admission."),
    "cached": ("vllm:atom_cached_prompt_tokens",
               "Prompt tokens reused: KV and a state checkpoint at one boundary."),
    "computed_prefill_tokens": ("vllm:atom_computed_prompt_tokens",
                                "Prompt tokens computed (not reused), a preempted "
                                "request's recompute included."),
    "full_reuse": ("vllm:atom_full_reuse_requests",
                   "Requests that reused all the reusable prefix."),
    "paged_match_state_miss": ("vllm:atom_state_miss_requests",
                               "Requests whose KV prefix was held but not a state at its end."),
    "checkpoint_would_fix": ("vllm:atom_checkpoint_would_fix_requests",
                             "Of the state misses, requests a checkpoint at the end of "
                             "their KV prefix would have served further."),
    "paged_miss": ("vllm:atom_kv_miss_requests",
                   "Requests whose reusable prefix the KV pool no longer held."),
    "resumed": ("vllm:atom_resumed_requests", "Requests that resumed on a cached prefix."),
    "gate_held_steps": ("vllm:atom_admission_gate_held_steps",
                        "Scheduler steps in which the admission gate held a waiting request "
                        "back."),
    "gate_holds": ("vllm:atom_admission_gate_holds",
                   "Waiting requests the admission gate held back, summed over steps."),
    "interior_writes": ("vllm:atom_checkpoints_written_inside_forward",
                        "Planned checkpoints written from inside a prefill forward "
                        "(ATOM_INTERIOR_CHECKPOINTS=on)."),
    "floor_holds": ("vllm:atom_floor_state_holds",
                    "Requests that held floor states under their prefix."),
    "partial_tails_dropped": ("vllm:atom_partial_tail_states_dropped",
                              "Prompt-end states inside a page given back uncached at "
                              "release: not worth their pages at the KV cut rate."),
}
# CacheStats dict field -> (Prometheus name, help, label): counts per kind
KIND_COUNTERS = {
    "written_by_kind": ("vllm:atom_checkpoints_written",
                        "State checkpoints written, by placement kind.", "kind"),
}

# The store connector's counters (`ConnectorCounters` field, prefixed
# "store_" in a snapshot): the same two kinds of table.
STORE_COUNTERS = {
    "spills_requested": ("vllm:atom_store_spills_requested",
                         "Store objects the scheduler asked the worker to spill."),
    "spills_stored": ("vllm:atom_store_spills_stored", "Store objects stored."),
    "loads_attempted": ("vllm:atom_store_loads_attempted", "Requests sent to load from the store."),
    "loads_completed": ("vllm:atom_store_loads_completed", "Loads from the store completed."),
    "joint_boundaries": ("vllm:atom_store_joint_boundaries",
                         "Loads planned, each at one boundary for KV and state."),
    "loaded_tokens": ("vllm:atom_store_loaded_tokens",
                      "Prompt tokens loads resumed past the GPU's own hit."),
    "bytes_spilled": ("vllm:atom_store_bytes_spilled", "Bytes stored."),
    "bytes_loaded": ("vllm:atom_store_bytes_loaded", "Bytes loaded."),
}
STORE_REASON_COUNTERS = {
    "spills_dropped": ("vllm:atom_store_spills_dropped", "Spills dropped, by reason.", "reason"),
    "loads_failed": ("vllm:atom_store_loads_failed",
                     "Loads failed (the request recomputed), by reason.", "reason"),
    "declines": ("vllm:atom_store_declines", "Lookups without a load, by reason.", "reason"),
}
STORE_PREFIX = "store_"
COUNTERS.update({STORE_PREFIX + k: v for k, v in STORE_COUNTERS.items()})
KIND_COUNTERS.update({STORE_PREFIX + k: v for k, v in STORE_REASON_COUNTERS.items()})


def stats_snapshot(stats: CacheStats, store=None) -> dict:
    """The plugin's counters now, and the store connector's (`store`, a
    `ConnectorCounters`) where there is one."""
    snap = counter_snapshot(stats, [n for n in COUNTERS if not n.startswith(STORE_PREFIX)],
                            [n for n in KIND_COUNTERS if not n.startswith(STORE_PREFIX)])
    if store is not None:
        snap.update({STORE_PREFIX + k: v for k, v in counter_snapshot(
            store, STORE_COUNTERS, STORE_REASON_COUNTERS).items()})
    return snap


@dataclasses.dataclass
class AtomCacheStats(KVConnectorStats):
    """Counter increments since the last report (the payload vLLM carries
    from the engine core to the front end)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "AtomCacheStats":
        add_counter_delta(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return flat_counters(self.data)

    def is_empty(self) -> bool:
        return not self.data


class AtomPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = metric_types[Counter]
        self._counters = {
            name: create_metric_per_engine(
                counter(name=prom, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues)
            for name, (prom, doc) in COUNTERS.items()}
        self._kind_counters = {
            name: counter(name=prom, documentation=doc, labelnames=[*labelnames, label])
            for name, (prom, doc, label) in KIND_COUNTERS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            if name in self._counters:
                self._counters[name][engine_idx].inc(value)
            elif name in self._kind_counters:
                for kind, n in value.items():
                    self._kind_counters[name].labels(*labels, kind).inc(n)


def stats_delta_since(stats: CacheStats, before: dict, store=None) -> tuple[dict, dict]:
    """(the counters now, how far they moved since `before`)."""
    now = stats_snapshot(stats, store)
    return now, counter_delta(now, before)
