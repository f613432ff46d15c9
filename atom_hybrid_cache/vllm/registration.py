"""Everything the plugin registers with vLLM, in one place.

Written against vLLM 0.32.0. Through vLLM's registries:
- `KVCacheSpecRegistry.register(AtomGDNSpec, AtomStateManager,
  uniform_type_base_spec=MambaSpec)` and the same for `AtomGDNInteriorSpec`
  with `AtomInteriorStateManager` (vllm/v1/kv_cache_spec_registry.py);
- `QwenGatedDeltaNetAttention.register_oot(AtomGDN)` (PluggableLayer,
  vllm/model_executor/custom_op.py);
- `KVConnectorFactory.register_connector("AtomStatsConnector", ...)`: the
  connector that carries our counters to /metrics (vllm/distributed/
  kv_transfer/kv_connector/factory.py), chosen by `--kv-transfer-config`.

The one monkeypatch (listed in `PATCHES`): vLLM has no registry for the
scheduler class, only its `--scheduler-cls` setting, so
`SchedulerConfig.get_scheduler_cls` (vllm/config/scheduler.py) is wrapped
to answer `AtomScheduler` / `AtomAsyncScheduler` where that setting is
unset and the plugin is enabled (see `default_scheduler_class`).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("atom_hybrid_cache")

# Every monkeypatch applied to vLLM: (what, the vLLM version it was written against).
PATCHES: tuple = (
    ("vllm.config.scheduler.SchedulerConfig.get_scheduler_cls: AtomScheduler "
     "(AtomAsyncScheduler with async scheduling) where --scheduler-cls is unset", "0.32.0"),
)

_done = {"manager": False, "layer": False, "connector": False, "scheduler": False}


def register_cache_manager() -> None:
    """Our state groups get AtomStateManager. Idempotent."""
    if _done["manager"]:
        return
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from .spec import AtomGDNInteriorSpec, AtomGDNSpec
    from .state_manager import AtomInteriorStateManager, AtomStateManager

    # vLLM registers its built-ins only into an empty registry: let it go
    # first, or our entry would make it skip them.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(AtomGDNSpec, AtomStateManager, uniform_type_base_spec=MambaSpec)
    KVCacheSpecRegistry.register(AtomGDNInteriorSpec, AtomInteriorStateManager,
                                 uniform_type_base_spec=MambaSpec)
    _done["manager"] = True


def register_gdn_layer() -> None:
    """Qwen3-Next / Qwen3.5 GDN layers are built as AtomGDN. Idempotent
    (vLLM asserts on a second registration of the same name)."""
    if _done["layer"]:
        return
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    from .gdn_layer import AtomGDN

    if op_registry_oot.get(QwenGatedDeltaNetAttention.__name__) is not AtomGDN:
        QwenGatedDeltaNetAttention.register_oot(AtomGDN)
    _done["layer"] = True


def register_stats_connector() -> None:
    """`--kv-transfer-config '{"kv_connector": "AtomStatsConnector", ...}'`
    resolves to our connector. Idempotent (vLLM raises on a second
    registration of a name)."""
    if _done["connector"]:
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from .metrics_connector import CONNECTOR_NAME

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "atom_hybrid_cache.vllm.metrics_connector", CONNECTOR_NAME)
    _done["connector"] = True


def default_scheduler_class() -> None:
    """With the plugin enabled and `--scheduler-cls` unset, vLLM builds our
    scheduler. Idempotent.

    Why: the scheduler places the checkpoints, orders a freed request's
    pages and counts the stats; without it the state managers behave
    exactly like vLLM's, so `VLLM_PLUGINS=atom_hybrid_cache vllm serve
    MODEL` alone would change nothing. vLLM calls `get_scheduler_cls` once,
    in the engine-core process, after loading the general plugins there.
    An explicit `--scheduler-cls` wins; one that is not ours is warned
    about. `enabled()` is read at the call, not at patch time, so an engine
    built later in the same process without the plugin named (the
    benchmarks' native runs) gets vLLM's class."""
    if _done["scheduler"]:
        return
    from vllm.config.scheduler import SchedulerConfig

    from . import plugin

    vllm_get_scheduler_cls = SchedulerConfig.get_scheduler_cls

    def get_scheduler_cls(self):
        if not plugin.enabled():
            return vllm_get_scheduler_cls(self)
        from .scheduler import AtomAsyncScheduler, AtomScheduler, AtomSchedulerMixin

        if self.scheduler_cls is None:
            cls = AtomAsyncScheduler if self.async_scheduling else AtomScheduler
            logger.info("atom_hybrid_cache: scheduler %s (vLLM's --scheduler-cls is unset)",
                        cls.__name__)
            return cls
        cls = vllm_get_scheduler_cls(self)
        if not (isinstance(cls, type) and issubclass(cls, AtomSchedulerMixin)):
            logger.warning("atom_hybrid_cache: --scheduler-cls %s is not ours: checkpoint "
                           "placement, eviction order and stats are vLLM's (unset it, or "
                           "subclass atom_hybrid_cache.vllm.scheduler.AtomScheduler)",
                           getattr(cls, "__qualname__", cls))
        return cls

    get_scheduler_cls.__wrapped__ = vllm_get_scheduler_cls
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls
    _done["scheduler"] = True


def register_all() -> None:
    register_cache_manager()
    register_gdn_layer()
    register_stats_connector()
    default_scheduler_class()
