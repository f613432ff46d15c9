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

Two monkeypatches (listed in `PATCHES`), for two choices vLLM makes from a
setting and no registry; each acts only where its setting is unset and the
plugin is enabled:
- `SchedulerConfig.get_scheduler_cls` (vllm/config/scheduler.py) answers
  `AtomScheduler` / `AtomAsyncScheduler` (see `default_scheduler_class`);
- `resolve_kv_cache_block_sizes` (vllm/v1/core/kv_cache_utils.py, and its
  binding in vllm/v1/engine/core.py) hashes prefixes on units of at most
  64 tokens instead of the state-page-sized block (see
  `default_prefix_match_unit`).
"""

from __future__ import annotations

import logging
import math
from typing import Optional

logger = logging.getLogger("atom_hybrid_cache")

# The vLLM release the plugin is written and tested against (major.minor):
# its scheduler and managers subclass vLLM's and read some of their internals.
WRITTEN_FOR_VLLM = "0.32"

# Every monkeypatch applied to vLLM: (what, the vLLM version it was written against).
PATCHES: tuple = (
    ("vllm.config.scheduler.SchedulerConfig.get_scheduler_cls: AtomScheduler "
     "(AtomAsyncScheduler with async scheduling) where --scheduler-cls is unset", "0.32.0"),
    ("vllm.v1.core.kv_cache_utils.resolve_kv_cache_block_sizes (and vllm.v1.engine.core's "
     "binding): prefix hashes on the largest divisor of the block up to 64 tokens "
     "on models with our state groups where --prefix-match-unit is unset", "0.32.0"),
)


def written_for(vllm_version: str) -> bool:
    """Whether `vllm_version` ("0.32.0", "0.32.1+cpu", ...) is the release
    line this plugin was written for."""
    return vllm_version.split("+")[0].split(".")[:2] == WRITTEN_FOR_VLLM.split(".")


_done = {"manager": False, "layer": False, "connector": False, "scheduler": False,
         "unit": False}


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


def plugin_prefix_match_unit(kv_cache_config, vllm_config) -> Optional[int]:
    """The prefix-hash unit the plugin asks of vLLM for this engine, or None
    to leave vLLM's choice: where `--prefix-match-unit` is unset, prefix
    caching runs in align mode, and a KV cache group holds our state pages,
    `largest_unit_dividing` every prefix-cacheable group's block size, up
    to PREFIX_MATCH_UNIT_TOKENS, when that is finer than vLLM's default
    (the GCD of those block sizes)."""
    from vllm.v1.kv_cache_interface import MambaSpec, iter_layer_specs

    from ..config import PREFIX_MATCH_UNIT_TOKENS
    from .spec import AtomGDNSpec

    cache = vllm_config.cache_config
    groups = kv_cache_config.kv_cache_groups
    if (cache.prefix_match_unit is not None or not cache.enable_prefix_caching
            or len(groups) < 2 or vllm_config.parallel_config.decode_context_parallel_size != 1):
        return None
    layer_specs = [s for g in groups for s in iter_layer_specs(g.kv_cache_spec)]
    if not any(isinstance(s, AtomGDNSpec) for s in layer_specs):
        return None
    if any(isinstance(s, MambaSpec) and s.mamba_cache_mode != "align" for s in layer_specs):
        return None
    specs = [g.kv_cache_spec for g in groups]
    sizes = [s.block_size for s in specs if s.prefix_cacheable] or [s.block_size for s in specs]
    unit = largest_unit_dividing(sizes, PREFIX_MATCH_UNIT_TOKENS)
    return unit if unit < math.gcd(*sizes) else None


def largest_unit_dividing(block_sizes, limit: int) -> int:
    """The largest number of tokens, at most `limit`, that divides every
    block size: 64 for 128- or 448-token blocks, 50 for 400.

    vLLM needs every block size divisible by the unit, and each unit
    boundary is a hash the scheduler computes, stores and walks: the
    largest divisor keeps resumes within `limit` tokens of any boundary
    with the fewest hashes. (gcd(64, 400) = 16 hashed about 3x as often
    for the same hits: BENCHMARKS.md, "With vLLM's default block size".)"""
    g = math.gcd(*block_sizes)
    return max(d for d in range(1, min(limit, g) + 1) if g % d == 0)


def default_prefix_match_unit() -> None:
    """With the plugin enabled and `--prefix-match-unit` unset, a model with
    our state groups hashes prefixes every 64 tokens, or, where 64 does
    not divide the block, every `largest_unit_dividing` it up to 64 tokens
    (50 for a 400-token block). Idempotent.

    Why: vLLM raises a hybrid model's block to a state page (400-1,600
    tokens for Qwen3.5) and hashes on that block, so a prompt resumes only
    at a multiple of it, and a prompt shorter than one block never hits.
    vLLM resolves the unit once the workers have reported their KV cache
    specs, in the engine-core process (`EngineCore._initialize_kv_caches`,
    then again in `EngineCore.__init__`; the workers and the scheduler get
    its answer). The wrapper sets `cache_config.prefix_match_unit` there,
    so both calls agree, and leaves it unset again if vLLM rejects it.
    `enabled()` is read at the call, as in `default_scheduler_class`."""
    if _done["unit"]:
        return
    import sys

    from vllm.v1.core import kv_cache_utils

    from . import plugin

    vllm_resolve = kv_cache_utils.resolve_kv_cache_block_sizes

    def resolve_kv_cache_block_sizes(kv_cache_config, vllm_config):
        unit = plugin_prefix_match_unit(kv_cache_config, vllm_config) if plugin.enabled() else None
        if unit is None:
            return vllm_resolve(kv_cache_config, vllm_config)
        cache = vllm_config.cache_config
        cache.prefix_match_unit = unit
        try:
            out = vllm_resolve(kv_cache_config, vllm_config)
        except ValueError as e:
            cache.prefix_match_unit = None
            logger.warning("atom_hybrid_cache: vLLM rejects a %d-token prefix-hash unit here "
                           "(%s); its default stands", unit, e)
            return vllm_resolve(kv_cache_config, vllm_config)
        logger.info("atom_hybrid_cache: prefix hashes every %d tokens (vLLM's "
                    "--prefix-match-unit is unset; blocks are %d tokens)", unit, out[0])
        return out

    resolve_kv_cache_block_sizes.__wrapped__ = vllm_resolve
    kv_cache_utils.resolve_kv_cache_block_sizes = resolve_kv_cache_block_sizes
    # vllm.v1.engine.core binds the name at its import: rebind it there if
    # it is loaded already (in the engine-core process it is: vLLM loads
    # plugins from EngineCore.__init__); a later import binds ours.
    core = sys.modules.get("vllm.v1.engine.core")
    if core is not None and getattr(core, "resolve_kv_cache_block_sizes", None) is vllm_resolve:
        core.resolve_kv_cache_block_sizes = resolve_kv_cache_block_sizes
    _done["unit"] = True


def check_vllm_version(vllm_version: Optional[str] = None) -> bool:
    """On a vLLM other than the one this plugin was written for, warn and
    turn the state managers' steady-step shortcuts off (they answer some of
    vLLM's per-step calls themselves, from vLLM 0.32's bookkeeping; without
    them vLLM's own methods run). Returns whether the version matched."""
    if vllm_version is None:
        import vllm
        vllm_version = vllm.__version__
    if written_for(vllm_version):
        return True
    from .state_manager import AtomStateManager
    AtomStateManager.steady_shortcuts = False
    logger.warning("atom_hybrid_cache was written for vLLM %s.x and this is vLLM %s: the "
                   "scheduler and state managers subclass vLLM's and may not fit it; the "
                   "steady-step shortcuts are off. Pin vllm==%s.* for the tested setup",
                   WRITTEN_FOR_VLLM, vllm_version, WRITTEN_FOR_VLLM)
    return False


def register_all() -> None:
    check_vllm_version()
    register_cache_manager()
    register_gdn_layer()
    register_stats_connector()
    default_scheduler_class()
    default_prefix_match_unit()
