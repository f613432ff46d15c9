"""Our counters on vLLM's /metrics, through the one channel vLLM 0.32 has for
them: a KV connector's stats.

vLLM builds its scheduler stats in the engine core and exports them from the
front end; what a plugin may add to that path is a KV connector's
`KVConnectorStats` (engine core) and its `KVConnectorPromMetrics` (front
end); see docs/vllm_032_notes.md section 5. `AtomStatsConnector` is such a
connector that moves no KV: on the scheduler side it reports, once per step
that changed them, how far each of `core.stats.CacheStats`'s counters moved;
in the front end it adds them to Prometheus counters. Select it with

    --kv-transfer-config '{"kv_connector": "AtomStatsConnector", "kv_role": "kv_both"}'

It declares `SupportsHMA`: without it vLLM would switch the hybrid KV cache
manager off, and hybrid GDN models cannot run without that.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from ..core.stats import CacheStats

CONNECTOR_NAME = "AtomStatsConnector"

# CacheStats field -> (Prometheus name, help). All are monotonic counts.
COUNTERS = {
    "admissions": ("vllm:atom_admissions", "Requests admitted (first scheduling)."),
    "prompt_tokens": ("vllm:atom_prompt_tokens", "Prompt tokens of admitted requests."),
    "reusable": ("vllm:atom_reusable_prompt_tokens",
                 "Prompt tokens an unbounded cache would have reused."),
    "compressed": ("vllm:atom_kv_prefix_tokens",
                   "Prompt tokens the KV pool still held a prefix of at admission."),
    "cached": ("vllm:atom_cached_prompt_tokens",
               "Prompt tokens reused: KV and a state checkpoint at one boundary."),
    "computed_prefill_tokens": ("vllm:atom_computed_prompt_tokens",
                                "Prompt tokens computed (not reused)."),
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
}
# CacheStats dict field -> (Prometheus name, help, label): counts per kind
KIND_COUNTERS = {
    "written_by_kind": ("vllm:atom_checkpoints_written",
                        "State checkpoints written, by placement kind.", "kind"),
}


def stats_snapshot(stats: CacheStats) -> dict:
    snap: dict[str, Any] = {name: getattr(stats, name) for name in COUNTERS}
    for name in KIND_COUNTERS:
        snap[name] = dict(getattr(stats, name))
    return snap


def stats_delta(now: dict, before: dict) -> dict:
    """How far each counter moved; only the ones that did."""
    out: dict[str, Any] = {}
    for name in COUNTERS:
        d = now[name] - before.get(name, 0)
        if d:
            out[name] = d
    for name in KIND_COUNTERS:
        old = before.get(name, {})
        kinds = {k: v - old.get(k, 0) for k, v in now[name].items() if v != old.get(k, 0)}
        if kinds:
            out[name] = kinds
    return out


@dataclasses.dataclass
class AtomCacheStats(KVConnectorStats):
    """Counter increments since the last report (the payload vLLM carries
    from the engine core to the front end)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "AtomCacheStats":
        for name, value in other.data.items():
            if isinstance(value, dict):
                mine = self.data.setdefault(name, {})
                for k, v in value.items():
                    mine[k] = mine.get(k, 0) + v
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name, value in sorted(self.data.items()):
            if isinstance(value, dict):
                out.update({f"{name}[{k}]": v for k, v in sorted(value.items())})
            else:
                out[name] = value
        return out

    def is_empty(self) -> bool:
        return not self.data


class AtomPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=prom, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues)
            for name, (prom, doc) in COUNTERS.items()}
        self._kind_counters = {
            name: self._counter_cls(name=prom, documentation=doc, labelnames=[*labelnames, label])
            for name, (prom, doc, label) in KIND_COUNTERS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            if name in self._counters:
                self._counters[name][engine_idx].inc(value)
            elif name in self._kind_counters:
                for kind, n in value.items():
                    self._kind_counters[name].labels(*labels, kind).inc(n)


class AtomStatsConnector(KVConnectorBase_V1, SupportsHMA):
    """A KV connector that moves no KV and reports our cache counters."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._stats: Optional[CacheStats] = None
        self._reported: dict = {}

    def report(self, stats: CacheStats) -> None:
        """Called by AtomScheduler with the planner's counters."""
        self._stats = stats
        self._reported = stats_snapshot(stats)

    # -- scheduler side: nothing to load, nothing held back -------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    def get_kv_connector_stats(self) -> Optional[AtomCacheStats]:
        if self._stats is None:
            return None
        now = stats_snapshot(self._stats)
        delta = stats_delta(now, self._reported)
        if not delta:
            return None
        self._reported = now
        return AtomCacheStats(data=delta)

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict] = None) -> AtomCacheStats:
        return AtomCacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return AtomPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side: no transfers ----------------------------------------
    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
