"""Set-up of `AtomScheduler`: the plugin's parts, built once from vLLM's
configuration and KV cache groups. The pool is vLLM's one block pool (a
checkpoint takes a page per state group, a block of tokens a page per
attention group); from it come the core's `CheckpointPolicy` and
`CheckpointPlanner`, whose `CheckpointPlans` the state managers are handed.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from vllm.v1.kv_cache_interface import MambaSpec

from ..config import ADDITIONAL_CONFIG_KEY, MAX_HASH_UNIT_TOKENS, load_settings, server_defaults
from ..core.gate_steps import gate_on
from ..core.planner import CheckpointPlanner
from ..core.policy import CheckpointPolicy
from ..core.slot_share import SlotShare
from ..core.tail_price import describe_price
from . import private_api
from .admission_gate import AdmissionGate
from .anchor_holds import PromptEndAnchors
from .finished_token_lists import FinishedTokenLists
from .priced_free_queue import PricedFreeBlockQueue, queue_at_weight
from .floor_states import FloorStates
from .state_manager import AtomStateManager
from .state_search import StateSearch

logger = logging.getLogger("atom_hybrid_cache")


@dataclass
class SchedulerParts:
    """What the plugin adds to one scheduler; None where it is off."""

    planner: Optional[CheckpointPlanner] = None
    gate: Optional[AdmissionGate] = None
    floors: Optional[FloorStates] = None
    anchors: Optional[PromptEndAnchors] = None
    states: Optional[StateSearch] = None
    # ATOM_ADMISSION_ORDER=hits-first, and {request id: times passed over}
    hits_first: bool = False
    passed_over: dict = field(default_factory=dict)
    # {request id: request} of the prefills vLLM sized a chunk for this
    # step (`admission.chunk_tokens`; those it scheduled are counted after)
    step_prefills: dict = field(default_factory=dict)
    # group ids of our state groups; [(group id, block size)] of the
    # attention groups
    state_groups: list = field(default_factory=list)
    kv_groups: list = field(default_factory=list)
    # a freed request's pages leave in units (reuse-aware eviction, and
    # vLLM's release bookkeeping found)
    units_on_release: bool = False
    # the store connector (AtomLMCacheConnector), which the release tells
    # what it frees, or None
    store: object = None
    # ReplaySSM pages in align mode: a verify window ends at the next
    # multiple of this many tokens (0: windows as vLLM schedules them)
    verify_window_page_tokens: int = 0
    # released requests' token lists, freed a slice a step
    finished_lists: Optional[FinishedTokenLists] = None
    # vLLM's free queue, priced (ATOM_EVICTION_PRICE_WEIGHT > 0), or None
    priced_queue: Optional[PricedFreeBlockQueue] = None


def build_parts(sched) -> SchedulerParts:
    """The parts for `sched` (an AtomScheduler after vLLM's constructor):
    the server's defaults, then the exported ATOM_* variables, then this
    engine's --additional-config."""
    extra = sched.vllm_config.additional_config
    settings = load_settings(extra, server_defaults())
    if isinstance(extra, dict) and extra.get(ADDITIONAL_CONFIG_KEY):
        logger.info("atom_hybrid_cache: settings from --additional-config: %s",
                    extra[ADDITIONAL_CONFIG_KEY])
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    state_groups = [g for g, m in enumerate(managers) if isinstance(m, AtomStateManager)]
    if not state_groups:
        if any(isinstance(m.kv_cache_spec, MambaSpec) for m in managers):
            logger.warning("atom_hybrid_cache: AtomScheduler runs, but no state group uses "
                           "AtomStateManager (is VLLM_PLUGINS=atom_hybrid_cache set?): "
                           "vLLM's own hybrid caching is in charge")
        parts = SchedulerParts(gate=_admission_gate(sched, settings.server.admission_gate))
        if parts.gate is not None:
            logger.info("atom_hybrid_cache scheduler: admission gate on (no state groups)")
        return parts
    first = managers[state_groups[0]]
    if not sched.cache_config.enable_prefix_caching or first.mamba_cache_mode != "align":
        return SchedulerParts(gate=_admission_gate(sched, settings.server.admission_gate))
    # a ReplaySSM page is the state of the block it ends only if no verify
    # window crosses that end (vllm/replayssm_runner.py)
    window_page = first.block_size if getattr(first.kv_cache_spec, "replayssm", False) else 0

    pool = sched.kv_cache_manager.block_pool
    block_size = first.block_size
    num_blocks = pool.num_gpu_blocks
    kv_groups = [(g, m.block_size) for g, m in enumerate(managers)
                 if not isinstance(m.kv_cache_spec, MambaSpec)]
    pages_per_block = max(1, len(kv_groups))
    pool_tokens = (num_blocks - 1) * block_size
    # the share follows the requests in flight (`schedule` tells it each step)
    share = SlotShare(pool_tokens // pages_per_block,
                      len(state_groups) * block_size // pages_per_block,
                      sched.scheduler_config.max_num_seqs)
    policy = CheckpointPolicy(
        settings.placement, block_size=block_size, share=share,
        floor_fractions=settings.server.floor_fractions, warn=logger.warning,
        budget_warn=lambda msg: logger.warning(f"atom_hybrid_cache: {msg}"))
    planner = CheckpointPlanner(
        policy, hash_unit=sched.hash_block_size, stats_log_interval=settings.stats_log_interval,
        interior_readable=bool(getattr(first.kv_cache_spec, "interior_checkpoints", False)),
        pool_state=lambda: _pool_state(pool))
    for g in state_groups:
        managers[g].attach(planner.plans)
    states = StateSearch(pool, state_groups, sched.hash_block_size, block_size)
    parts = SchedulerParts(
        planner=planner, states=states, state_groups=state_groups, kv_groups=kv_groups,
        hits_first=settings.server.admission_order == "hits-first",
        gate=_admission_gate(sched, settings.server.admission_gate, policy, planner.stats),
        units_on_release=policy.reuse_aware and private_api.feature_on(
            private_api.EVICTION_ORDER),
        verify_window_page_tokens=window_page, finished_lists=FinishedTokenLists())
    planner.gate_on = parts.gate is not None
    # (or from the step whose requests in flight price it: admission.size_share)
    if parts.units_on_release:
        parts.priced_queue = queue_at_weight(pool, policy, None)
    if policy.reuse_aware:
        parts.anchors = PromptEndAnchors(pool, states, sched.hash_block_size)
        if policy.floor_ledger_fractions:
            parts.floors = FloorStates(pool, states, policy, num_blocks, planner.stats)
    connector = getattr(sched, "connector", None)
    # the plugin's connectors take the planner's counters (checked by the
    # hook, not the class: the adapter does not import the connector)
    if callable(getattr(connector, "report_atom_stats", None)):
        connector.report_atom_stats(planner.stats)
        logger.info("atom_hybrid_cache: counters exported as vllm:atom_* metrics through %s",
                    type(connector).__name__)
    if getattr(connector, "spill_registry", None) is not None:
        if not parts.units_on_release:
            raise ValueError("the store connector needs the plugin's release in units "
                             "(ATOM_STATE_CHECKPOINT_EVICTION=reuse-aware)")
        parts.store = connector
        planner.extra_lines.append(connector.stats_line)
    logger.info("atom_hybrid_cache scheduler: %d state groups, %d KV groups, state block %d "
                "tokens, hash unit %d, pool %d blocks; checkpoints %s; admission order %s; "
                "admission gate %s; placement %s; floor states %s",
                len(state_groups), len(kv_groups), block_size, sched.hash_block_size,
                num_blocks, "written inside prefill forwards" if planner.interior_readable
                else "at prefill chunk ends (chunks cut onto them)",
                settings.server.admission_order, "on" if parts.gate else "off",
                policy.configured, policy.configured_floor_fractions or "off")
    if policy.reuse_aware:
        logger.info("atom_hybrid_cache: %s", policy.describe_share())
    price = describe_price(policy.checkpoint_kv_tokens, block_size, sched.hash_block_size)
    if price and policy.reuse_aware:
        logger.info("atom_hybrid_cache: %s", price)
    if sched.hash_block_size > MAX_HASH_UNIT_TOKENS:
        logger.warning("atom_hybrid_cache: prefix hits land on %d-token boundaries; leave "
                       "--prefix-match-unit unset (the plugin then picks %d or a divisor "
                       "of it) for finer hits", sched.hash_block_size, MAX_HASH_UNIT_TOKENS)
    return parts


def _admission_gate(sched, mode: str, policy: Optional[CheckpointPolicy] = None,
                    stats=None) -> Optional[AdmissionGate]:
    """The admission gate `ATOM_ADMISSION_GATE=mode` asks for, or None.
    `on` needs no state groups (it also serves attention-only models);
    `auto` gates where the plugin manages the states (`policy`). Its holds
    are counted in `stats` (the planner's: its log lines, the metrics)."""
    if not gate_on(mode):
        return None
    if not (sched.cache_config.enable_prefix_caching and isinstance(sched.waiting, deque)):
        if mode == "on":
            logger.warning("atom_hybrid_cache: ATOM_ADMISSION_GATE=on needs prefix caching "
                           "and vLLM's fcfs scheduling policy; the gate stays open")
        return None
    if mode == "auto" and policy is None:
        return None     # auto gates the pools whose states the plugin manages
    return AdmissionGate(stats)


def _pool_state(pool) -> dict:
    """The shared pool's pages for the stats lines (the null page excluded)."""
    total = pool.num_gpu_blocks - 1
    free = pool.get_num_free_blocks()
    return dict(pages=total, used=total - free, free=free)
