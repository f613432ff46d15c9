"""Everything the plugin registers with vLLM, in one place.

All of it goes through vLLM's registries; nothing is monkeypatched.
Written against vLLM 0.32.0:
- `KVCacheSpecRegistry.register(AtomGDNSpec, AtomStateManager,
  uniform_type_base_spec=MambaSpec)` and the same for `AtomGDNInteriorSpec`
  with `AtomInteriorStateManager` (vllm/v1/kv_cache_spec_registry.py);
- `QwenGatedDeltaNetAttention.register_oot(AtomGDN)` (PluggableLayer,
  vllm/model_executor/custom_op.py);
- `KVConnectorFactory.register_connector("AtomStatsConnector", ...)`: the
  connector that carries our counters to /metrics (vllm/distributed/
  kv_transfer/kv_connector/factory.py), chosen by `--kv-transfer-config`;
- the scheduler is chosen by vLLM's own `--scheduler-cls` setting
  (`atom_hybrid_cache.vllm.scheduler.AtomScheduler`), not registered.
"""

from __future__ import annotations

PATCHES: tuple = ()  # monkeypatches applied to vLLM: none

_done = {"manager": False, "layer": False, "connector": False}


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


def register_all() -> None:
    register_cache_manager()
    register_gdn_layer()
    register_stats_connector()
