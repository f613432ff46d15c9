"""Connector: `AtomStatsConnector` moves no KV and carries the plugin's
counters to vLLM's /metrics (`metrics`). It declares `SupportsHMA`, without
which vLLM turns the hybrid KV cache manager off. Select it with

    --kv-transfer-config '{"kv_connector": "AtomStatsConnector", "kv_role": "kv_both"}'
"""

from __future__ import annotations

from typing import Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from ..core.stats import CacheStats
from .metrics import AtomCacheStats, AtomPromMetrics, stats_delta_since, stats_snapshot

CONNECTOR_NAME = "AtomStatsConnector"


class AtomStatsConnector(KVConnectorBase_V1, SupportsHMA):
    """A KV connector that moves no KV and reports our cache counters."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._stats: Optional[CacheStats] = None
        self._reported: dict = {}
        # the store connector's counters (None here: this one moves nothing)
        self.store_counters = None

    def report_atom_stats(self, stats: CacheStats) -> None:
        """Called by AtomScheduler with the planner's counters."""
        self._stats = stats
        self._reported = stats_snapshot(stats, self.store_counters)

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
        now, delta = stats_delta_since(self._stats, self._reported, self.store_counters)
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
