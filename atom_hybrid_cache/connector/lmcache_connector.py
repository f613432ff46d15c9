"""Connector: `AtomLMCacheConnector`, a hybrid model's prefixes in LMCache.

    --kv-transfer-config '{"kv_connector": "AtomLMCacheConnector", "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute"}'

with LMCache configured by its own `LMCACHE_*` variables or
`LMCACHE_CONFIG_FILE`. When vLLM evicts a unit of a freed request (a state
and the KV below it), the unit goes to the store (`spill_registry`); a
request whose GPU hit is short of what the store holds loads the rest at
one boundary for its KV and its state (`joint_boundary`), asynchronously, so
a failure is reported per request and the request recomputes. Instances
sharing a remote tier resume on each other's prefixes (the keys name the
tokens, not vLLM's per-process hashes). It also carries the plugin's
counters to /metrics, as `AtomStatsConnector` does, with its own.

vLLM's hook -> this connector's part: scheduler side `get_num_new_matched_tokens`
(lookup), `update_state_after_alloc` (load plan), `build_connector_meta`
(the step's plan), `update_connector_output` (the worker's report); worker
side `register_kv_caches`, `handle_preemptions` (spills), `start_load_kv`
(loads), `get_transfer_results`, `build_connector_worker_meta`.
"""

from __future__ import annotations

import logging
from typing import Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorRole,
                                                               KVConnectorTransferResults)
from vllm.v1.kv_cache_interface import MambaSpec

from .keys import StoreLayout
from .plan import StepPlan
from .scheduler_side import ConnectorScheduler
from .stats_connector import AtomStatsConnector
from .store import PageStore, lmcache_config, lookup_config, staging_bytes
from .worker_side import ConnectorWorker

logger = logging.getLogger("atom_hybrid_cache")

CONNECTOR_NAME = "AtomLMCacheConnector"
GIB = 1 << 30


class ConnectorRefused(ValueError):
    """A setting the connector cannot work with; the message names it."""


def store_layout(vllm_config, kv_cache_config) -> tuple[StoreLayout, list, list, list]:
    """(the layout, the state group ids, the attention group ids, each
    group's layer names) of this engine's KV cache."""
    groups = kv_cache_config.kv_cache_groups
    state = [g for g, grp in enumerate(groups) if isinstance(grp.kv_cache_spec, MambaSpec)]
    kv = [g for g, grp in enumerate(groups) if g not in state]
    if not state or not kv:
        raise ConnectorRefused(f"{CONNECTOR_NAME} stores hybrid models (linear-attention state "
                               "groups beside attention groups); this model has "
                               f"{len(state)} state and {len(kv)} attention groups")

    def page(g: int) -> int:
        spec = groups[g].kv_cache_spec
        per_layer = getattr(spec, "real_page_size_bytes", spec.page_size_bytes)
        return per_layer * len(groups[g].layer_names)

    block_size = groups[kv[0]].kv_cache_spec.block_size
    model = vllm_config.model_config
    layout = StoreLayout(f"{model.model}|{model.dtype}", block_size,
                         tuple(page(g) for g in state), tuple(page(g) for g in kv))
    return layout, state, kv, [list(grp.layer_names) for grp in groups]


def check_engine(vllm_config) -> None:
    """Refuse the settings the connector cannot serve correctly."""
    transfer = vllm_config.kv_transfer_config
    policy = getattr(transfer, "kv_load_failure_policy", "fail")
    if policy != "recompute":
        raise ConnectorRefused(
            f"{CONNECTOR_NAME} needs \"kv_load_failure_policy\": \"recompute\" in "
            f"--kv-transfer-config (it is {policy!r}): a load that fails (a store that lost or "
            "corrupted an object, a remote tier that is down) then recomputes the request "
            "from its GPU hit, where 'fail' ends it with an error")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ConnectorRefused(
            f"{CONNECTOR_NAME} does not support tensor or pipeline parallelism yet "
            f"(--tensor-parallel-size {parallel.tensor_parallel_size}, "
            f"--pipeline-parallel-size {parallel.pipeline_parallel_size}); run it with 1 and 1")
    if not vllm_config.cache_config.enable_prefix_caching:
        raise ConnectorRefused(f"{CONNECTOR_NAME} needs --enable-prefix-caching")

    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    if not getattr(scheduler_cls, "atom_scheduler", False):
        raise ConnectorRefused(
            f"{CONNECTOR_NAME} needs the plugin's scheduler, which decides what is spilled "
            "(VLLM_PLUGINS=atom_hybrid_cache, and --scheduler-cls unset or one of the "
            "plugin's)")


class AtomLMCacheConnector(AtomStatsConnector):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_engine(vllm_config)
        layout, state_groups, kv_groups, group_layers = store_layout(vllm_config,
                                                                      kv_cache_config)
        config = lmcache_config()
        self._scheduler: Optional[ConnectorScheduler] = None
        self._worker: Optional[ConnectorWorker] = None
        self._plan: Optional[StepPlan] = None
        if role == KVConnectorRole.SCHEDULER:
            remote = (PageStore(layout, lookup_config(), role="lookup") if config.remote_url
                      else None)
            capacity = staging_bytes(config) + int((config.max_local_disk_size or 0) * GIB
                                                   if config.local_disk else 0)
            self._scheduler = ConnectorScheduler(layout, state_groups, kv_groups, capacity,
                                                 remote)
            self.store_counters = self._scheduler.counters
            logger.info("atom_hybrid_cache: %s: store of %s bytes (CPU %s, disk %s, remote %s); "
                        "a state object is %s bytes", CONNECTOR_NAME, f"{capacity:,}",
                        config.max_local_cpu_size, config.local_disk or "off",
                        config.remote_url or "off", f"{layout.state_object_bytes:,}")
        else:
            self._worker = ConnectorWorker(PageStore(layout, config), group_layers)

    @property
    def requires_kv_delivery(self) -> bool:
        return False   # a cache: nothing waits for it to deliver

    # -- scheduler side ----------------------------------------------------
    @property
    def spill_registry(self):
        """Where the plugin's release registers the units it frees."""
        return self._scheduler.registry

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.bind(kv_cache_manager.block_pool.hash_block_size)

    def unit_hashes(self, request) -> list:
        """For the release: the hashes of a request being freed."""
        return self._scheduler.final_hashes(request)

    def open_step(self) -> None:
        self._scheduler.open_step()

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._scheduler.lookup(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple:
        # every new attention page is zeroed in the step that allocates it,
        # before the load writes it (after that step's forward): the pages
        # past the boundary never hold another page's bytes
        return ()

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.plan_load(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> StepPlan:
        return self._scheduler.build_plan()

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update(connector_output.kv_connector_worker_meta)

    def request_finished_all_groups(self, request, block_ids):
        self._scheduler.finished(request.request_id)
        return False, None

    def reset_cache(self) -> Optional[bool]:
        if self._scheduler is not None and self._scheduler.registry is not None:
            self._scheduler.registry.reset()
        return None

    def stats_line(self) -> str:
        return self._scheduler.counters.line()

    # -- worker side -------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._plan = connector_metadata

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._plan = None

    def handle_preemptions(self, kv_connector_metadata) -> None:
        # the step's first hook: evicted pages still hold what they held
        if isinstance(kv_connector_metadata, StepPlan) and kv_connector_metadata.spills:
            self._worker.spill(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        if self._plan is not None and self._plan.loads:
            self._worker.load(self._plan)

    def get_transfer_results(self, finished_req_ids) -> KVConnectorTransferResults:
        done, failed = self._worker.finished()
        return KVConnectorTransferResults(set(), done, failed)

    def build_connector_worker_meta(self):
        return self._worker.report()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None and self._scheduler.index.remote is not None:
            self._scheduler.index.remote.close()
