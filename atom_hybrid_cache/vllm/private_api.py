"""Every private vLLM name the plugin reads or overrides, in one list.

vLLM 0.32 has no public hook for some of what the plugin does. Each name
serves one feature; `check()` looks each up at start-up, and a missing one
turns its feature off with a warning naming it (not an AttributeError
mid-serve, or an override vLLM no longer calls). Names vLLM's constructors
set (`on_instances`) are checked on the built object (`instance_has`).
`tests/vllm/test_private_api.py` fails when the source reads or overrides
a private vLLM name this list lacks.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from typing import Callable, Optional

logger = logging.getLogger("atom_hybrid_cache")

# The features that read private names, and what is lost without them.
CHECKPOINT_PLACEMENT = "checkpoint placement (prefill chunks end on planned checkpoints)"
EVICTION_ORDER = "eviction order (a freed request's pages leave in units)"
STEADY_SHORTCUTS = "steady-step shortcuts of the state managers"
FAST_PREFIX_LOOKUP = "one-lookup state search in the prefix index"
PREFILL_STATS_SCAN = ("the finished prefill's cached-token estimate in C (vLLM's "
                      "estimate_cached_tokens runs instead)")
CPU_GDN_FORWARD = ("the plugin's CPU GDN and KDA forwards (interior checkpoints, float32 "
                   "models, KDA on CPU; vLLM's forward runs instead)")
REPLAYSSM_ALIGN = ("ReplaySSM with prefix caching (align mode page moves; without it "
                   "vLLM's fused speculative copies run)")
STEP_TAIL_FREES = ("freeing a finished request's prompt-plus-output list a slice a step "
                   "(it is freed in the step that releases the request)")
# (LMCache's, not vLLM's: the store connector's close reads two of them)
STORE_REMOTE_DRAIN = ("waiting for the LMCache remote tier's queued puts at close "
                      "(the last spills may be lost)")


@dataclass(frozen=True)
class PrivateName:
    """`owner`: "module" or "module:Class" in vLLM; `name` is read (or, for
    a method, overridden) by the feature."""

    owner: str
    name: str
    feature: str
    on_instances: bool = False


_SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
_MAMBA_MANAGER = "vllm.v1.core.single_type_kv_cache_manager:MambaManager"
_CPU_GDN = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
_TORCH_UTILS = "vllm.utils.torch_utils"
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"

PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName(_SCHEDULER, "_mamba_block_aligned_split", CHECKPOINT_PLACEMENT),
    PrivateName(_SCHEDULER, "_free_request_blocks", EVICTION_ORDER),
    PrivateName(_SCHEDULER, "_request_blocks_can_be_freed", EVICTION_ORDER),
    PrivateName("vllm.v1.request:Request", "_all_token_ids", STEP_TAIL_FREES,
                on_instances=True),
    PrivateName(_MAMBA_MANAGER, "_partial_hit_reqs", STEADY_SHORTCUTS, on_instances=True),
    PrivateName(_MAMBA_MANAGER, "_allocated_block_reqs", STEADY_SHORTCUTS, on_instances=True),
    PrivateName(_MAMBA_MANAGER, "_num_retired_blocks", STEADY_SHORTCUTS, on_instances=True),
    PrivateName("vllm.v1.core.block_pool:BlockHashToBlockMap", "_cache", FAST_PREFIX_LOOKUP,
                on_instances=True),
    PrivateName("vllm.v1.core.kv_cache_utils:KVCacheBlock", "_block_hash_num_tokens",
                PREFILL_STATS_SCAN),
    PrivateName(_TORCH_UTILS, "_encode_layer_name", CPU_GDN_FORWARD),
    PrivateName(_TORCH_UTILS, "_resolve_layer_name", CPU_GDN_FORWARD),
    PrivateName("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:"
                "QwenGatedDeltaNetAttention", "_output_projection", CPU_GDN_FORWARD),
    PrivateName(_CPU_GDN, "_ssm_state_view", CPU_GDN_FORWARD),
    PrivateName(_CPU_GDN, "_conv_buffer_view", CPU_GDN_FORWARD),
    PrivateName(_CPU_GDN, "_unpacked_conv_weight", CPU_GDN_FORWARD),
    # a private module: its fused gating op for the bf16 interior recompute
    PrivateName("vllm", "_custom_ops", CPU_GDN_FORWARD),
    PrivateName(_RUNNER, "_get_mamba_state_copy_funcs", REPLAYSSM_ALIGN),
    PrivateName(_RUNNER, "_get_mamba_bufs", REPLAYSSM_ALIGN),
    PrivateName(_RUNNER, "_update_states_after_model_execute", REPLAYSSM_ALIGN),
    PrivateName(_RUNNER, "_mamba_state_copy_funcs", REPLAYSSM_ALIGN, on_instances=True),
    PrivateName(_RUNNER, "_mamba_bufs", REPLAYSSM_ALIGN, on_instances=True),
    PrivateName(_RUNNER, "_make_buffer", REPLAYSSM_ALIGN),
    PrivateName("lmcache.v1.storage_backend.job_executor.pq_executor:AsyncPQExecutor",
                "_queue", STORE_REMOTE_DRAIN, on_instances=True),
    PrivateName("lmcache.v1.storage_backend.connector.instrumented_connector:"
                "InstrumentedRemoteConnector", "_connector", STORE_REMOTE_DRAIN,
                on_instances=True),
)


def _owner(path: str):
    module, _, cls = path.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError:
        return None
    return getattr(obj, cls, None) if cls else obj


def _present(entry: PrivateName) -> bool:
    owner = _owner(entry.owner)
    if owner is None:
        return False
    if entry.owner == "vllm" and not hasattr(owner, entry.name):
        # a submodule is an attribute only once imported
        return _owner(f"vllm.{entry.name}") is not None
    return hasattr(owner, entry.name)


def missing() -> list[PrivateName]:
    """The names (not set in constructors) this vLLM lacks."""
    return [e for e in PRIVATE_NAMES if not e.on_instances and not _present(e)]


_features_off: Optional[frozenset] = None


def check(warn: Callable[[str], None] = logger.warning) -> frozenset:
    """Look every name up (once); warn for each missing one, naming it and
    the feature it turns off. Returns the features off."""
    global _features_off
    if _features_off is None:
        gone = missing()
        for e in gone:
            warn(f"atom_hybrid_cache: vLLM has no {e.owner.replace(':', '.')}.{e.name}: "
                 f"{e.feature} is off")
        _features_off = frozenset(e.feature for e in gone)
    return _features_off


def feature_on(feature: str) -> bool:
    return feature not in check()


def instance_has(obj, feature: str, warn: Callable[[str], None] = logger.warning) -> bool:
    """Whether `obj` (built by vLLM) has every constructor-set name
    `feature` reads, and the feature is on; warns naming a missing one."""
    for e in PRIVATE_NAMES:
        if (e.feature == feature and e.on_instances and _is_instance_of(obj, e.owner)
                and not hasattr(obj, e.name)):
            warn(f"atom_hybrid_cache: vLLM's {e.owner.replace(':', '.')} has no {e.name}: "
                 f"{feature} is off")
            return False
    return feature_on(feature)


def _is_instance_of(obj, owner: str) -> bool:
    cls = _owner(owner)
    return isinstance(cls, type) and isinstance(obj, cls)


def index_key_suffix(block_pool, group_id: int) -> Optional[bytes]:
    """The bytes vLLM appends to a block hash to key it in `group_id`'s
    prefix index (`prefix_index`), or None where the index or its keys are
    not what this reads: callers then take vLLM's own lookup path."""
    return None if prefix_index(block_pool) is None else _key_suffix(group_id)


@functools.lru_cache(maxsize=None)
def _key_suffix(group_id: int) -> Optional[bytes]:
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
    probe = b"\x5a" * 32
    suffix = make_block_hash_with_group_id(probe, group_id)[len(probe):]
    if make_block_hash_with_group_id(b"\x01" * 8, group_id) != b"\x01" * 8 + suffix:
        return None
    return suffix


def prefix_index(block_pool) -> Optional[dict]:
    """The plain dict behind vLLM's prefix index (block hash with group id
    -> block or blocks), or None where it is not one (said once): callers
    then take vLLM's own lookup path."""
    global _warned_index
    index = getattr(block_pool.cached_block_hash_to_block, "_cache", None)
    if isinstance(index, dict):
        return index
    if not _warned_index:
        _warned_index = True
        logger.warning("atom_hybrid_cache: vLLM's prefix index has no plain dict _cache: "
                       "%s is off", FAST_PREFIX_LOOKUP)
    return None


_warned_index = False
