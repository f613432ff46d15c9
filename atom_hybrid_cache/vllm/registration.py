"""Set-up: everything the plugin registers with vLLM, in one place.

Written against vLLM 0.32.0. Through vLLM's registries: our state specs with
their managers (`KVCacheSpecRegistry`), our GDN and KDA layers
(`QwenGatedDeltaNetAttention.register_oot`,
`KimiGatedDeltaNetAttention.register_oot`), on CPU a Kimi-Linear model
class vLLM's CPU build can run (`ModelRegistry`), the connectors
(`KVConnectorFactory`). Monkeypatches (`PATCHES`) for choices vLLM makes
from a setting and no registry, each only where its setting is unset and
the plugin enabled: the scheduler class (`default_scheduler_class`) and the
prefix-hash unit (`default_hash_unit`); the runner's ReplaySSM page moves;
and the worker's page copies (`page_copies`: vLLM's skip attention KV on
models with several layers a KV tensor). The private vLLM names the plugin
reads are listed in `private_api`.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
from typing import Optional

from ..config import MAX_HASH_UNIT_TOKENS
from ..core.hash_unit import largest_unit_dividing
from . import private_api

logger = logging.getLogger("atom_hybrid_cache")

PLUGIN_NAME = "atom_hybrid_cache"

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
    ("vllm.v1.worker.gpu_model_runner.GPUModelRunner._get_mamba_state_copy_funcs, "
     "_get_mamba_bufs, _update_states_after_model_execute: whole-page copies and no fused "
     "speculative copy kernels where the runner's state groups are ReplaySSM pages "
     "(ATOM_ENABLE_REPLAYSSM=1 with prefix caching)", "0.32.0"),
    ("vllm.v1.worker.utils.copy_kv_cache_blocks_inplace (and the gpu_model_runner modules' "
     "bindings): every layer's whole page copied for a resume inside a page", "0.32.0"),
)


def enabled(environ=None) -> bool:
    """True when VLLM_PLUGINS names this plugin explicitly: vLLM loads every
    installed plugin when it is unset, and an installed but not enabled
    plugin must leave vLLM exactly as it is."""
    env = os.environ if environ is None else environ
    return PLUGIN_NAME in [n.strip() for n in env.get("VLLM_PLUGINS", "").split(",")]


def written_for(vllm_version: str) -> bool:
    """Whether `vllm_version` ("0.32.0", "0.32.1+cpu", ...) is the release
    line this plugin was written for."""
    return vllm_version.split("+")[0].split(".")[:2] == WRITTEN_FOR_VLLM.split(".")


@functools.cache   # each runs once per process: vLLM loads plugins in many places
def register_cache_manager() -> None:
    """Our state groups get AtomStateManager. Idempotent."""
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from .spec import AtomGDNInteriorSpec, AtomGDNSpec, AtomReplaySSMSpec
    from .state_manager import AtomInteriorStateManager, AtomStateManager

    # vLLM registers its built-ins only into an empty registry: let it go
    # first (checking no spec does that), or our entry would make it skip them.
    KVCacheSpecRegistry.check_kv_cache_spec_registry({})
    KVCacheSpecRegistry.register(AtomGDNSpec, AtomStateManager, uniform_type_base_spec=MambaSpec)
    KVCacheSpecRegistry.register(AtomGDNInteriorSpec, AtomInteriorStateManager,
                                 uniform_type_base_spec=MambaSpec)
    KVCacheSpecRegistry.register(AtomReplaySSMSpec, AtomStateManager,
                                 uniform_type_base_spec=MambaSpec)


@functools.cache
def register_gdn_layer() -> None:
    """Qwen3-Next / Qwen3.5 GDN layers are built as AtomGDN. Idempotent
    (vLLM asserts on a second registration of the same name)."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    from .gdn_layer import AtomGDN

    if op_registry_oot.get(QwenGatedDeltaNetAttention.__name__) is not AtomGDN:
        QwenGatedDeltaNetAttention.register_oot(AtomGDN)


@functools.cache
def register_kda_layer() -> None:
    """Kimi-Linear KDA layers are built as AtomKDA. Idempotent."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention

    from .kda_layer import AtomKDA

    if op_registry_oot.get(KimiGatedDeltaNetAttention.__name__) is not AtomKDA:
        KimiGatedDeltaNetAttention.register_oot(AtomKDA)


@functools.cache
def register_kimi_linear_cpu() -> None:
    """On the CPU platform only, `KimiLinearForCausalLM` resolves to the
    plugin's CPU route (`kimi_linear_cpu`): vLLM's class cannot be built
    there (a CUDA stream, Triton MLA). Idempotent."""
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from . import kimi_linear_cpu
    ModelRegistry.register_model(kimi_linear_cpu.ARCHITECTURE,
                                 f"{kimi_linear_cpu.__name__}:KimiLinearCPUForCausalLM")


@functools.cache
def register_connectors() -> None:
    """`--kv-transfer-config '{"kv_connector": NAME, ...}'` resolves to our
    connectors: `AtomStatsConnector` (counters to /metrics) and
    `AtomLMCacheConnector` (prefixes in LMCache, with the counters)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, module in (("AtomStatsConnector", "atom_hybrid_cache.connector.stats_connector"),
                         ("AtomLMCacheConnector",
                          "atom_hybrid_cache.connector.lmcache_connector")):
        try:
            KVConnectorFactory.register_connector(name, module, name)
        except ValueError:
            pass   # registered already (by an earlier load in this process)


@functools.cache
def default_scheduler_class() -> None:
    """With the plugin enabled and `--scheduler-cls` unset, vLLM builds our
    scheduler (without it the state managers behave like vLLM's). An
    explicit `--scheduler-cls` wins; one that is not ours is warned about.
    `enabled()` is read at the call, so an engine built later in the same
    process without the plugin named gets vLLM's class. Idempotent."""
    from vllm.config.scheduler import SchedulerConfig

    vllm_get_scheduler_cls = SchedulerConfig.get_scheduler_cls

    def get_scheduler_cls(self):
        if not enabled():
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


def plugin_hash_unit(kv_cache_config, vllm_config) -> Optional[int]:
    """The prefix-hash unit the plugin asks for this engine (None: vLLM's):
    with `--prefix-match-unit` unset, align mode and our state groups,
    `largest_unit_dividing` the prefix-cacheable groups' block sizes up to
    MAX_HASH_UNIT_TOKENS, where finer than vLLM's default (their GCD)."""
    from vllm.v1.kv_cache_interface import MambaSpec, iter_layer_specs

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
    unit = largest_unit_dividing(sizes, MAX_HASH_UNIT_TOKENS)
    return unit if unit < math.gcd(*sizes) else None


@functools.cache
def default_hash_unit() -> None:
    """With the plugin enabled and `--prefix-match-unit` unset, a model with
    our state groups hashes prefixes on `plugin_hash_unit`. Idempotent.

    Why: vLLM raises a hybrid model's block to a state page (400-1,600
    tokens for Qwen3.5) and hashes on it, so a prompt resumes only at a
    multiple of it. vLLM resolves the unit in the engine-core process,
    twice; the wrapper sets `cache_config.prefix_match_unit` at the first
    so both agree, and unsets it again if vLLM rejects it."""
    from vllm.v1.core import kv_cache_utils

    vllm_resolve = kv_cache_utils.resolve_kv_cache_block_sizes

    def resolve_kv_cache_block_sizes(kv_cache_config, vllm_config):
        unit = plugin_hash_unit(kv_cache_config, vllm_config) if enabled() else None
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


def check_vllm_version(vllm_version: Optional[str] = None) -> bool:
    """On a vLLM other than the one this plugin was written for, warn and
    turn the steady-step shortcuts off (they read the meaning of vLLM
    0.32's bookkeeping, which no name check sees). Returns whether the
    version matched."""
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


@functools.cache
def register_replayssm() -> None:
    """The model classes that size ReplaySSM pages, and the runner's align
    mode path for them. Both are vLLM's own behaviour in an engine that
    does not run ReplaySSM (switch off, or no speculative decoding), so
    they are registered with the plugin, whatever the switch: engines of
    one process may differ. Idempotent."""
    from vllm.model_executor.models.registry import ModelRegistry
    from . import replayssm_model
    from .replayssm_runner import patch_model_runner
    for arch in replayssm_model.PARENT_MODULES:
        ModelRegistry.register_model(
            arch, f"{replayssm_model.__name__}:{replayssm_model.PREFIX}{arch}")
    patch_model_runner()


def register_page_copies() -> None:
    """The worker's copy-on-write page copies cover every layer's page
    (`page_copies`). Correct for every vLLM model, so registered with the
    plugin, whatever the model."""
    from .page_copies import patch_block_copies
    patch_block_copies()


def register_all() -> None:
    check_vllm_version()
    private_api.check()
    register_cache_manager()
    register_gdn_layer()
    register_kda_layer()
    register_kimi_linear_cpu()
    register_connectors()
    default_scheduler_class()
    default_hash_unit()
    register_replayssm()
    register_page_copies()
