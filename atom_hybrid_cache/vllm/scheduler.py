"""vLLM's scheduler with our checkpoint placement and eviction order.

With the plugin enabled, vLLM builds it when `--scheduler-cls` is unset
(`AtomAsyncScheduler` when async scheduling is on; see
`registration.default_scheduler_class`); `--scheduler-cls
atom_hybrid_cache.vllm.scheduler.AtomScheduler` names it explicitly, and
also selects it where the plugin is not enabled (the admission gate for an
attention-only model). It overrides three scheduler steps, and the prefix
cache reset (see `reset_prefix_cache`), and nothing else:

- `_mamba_block_aligned_split`: where the GDN layers cannot write states
  from inside a forward (see `AtomGDNSpec.interior_checkpoints`), a forward
  stores a state only at its chunk's end, so a prefill chunk also ends on
  the next checkpoint our planner placed (vLLM's own stops stay); where they
  can, chunks are not cut;
- `_free_request_blocks`: a freed request's pages go back to the shared LRU
  in our order (see `CheckpointPlanner.eviction_order`), and the earlier
  checkpoints of the prefix it resumed on are refreshed with it;
- `schedule`: counts each admission for the stats lines; first the
  waiting requests vLLM could admit take their floor states (see
  `FloorStates`; they go back with the request's pages); with
  `ATOM_ADMISSION_ORDER=hits-first` it then puts the waiting requests that
  can resume on a cached prefix ahead of those that cannot (see
  `admission_order.order_waiting`); with the admission gate (a server's
  default, `ATOM_ADMISSION_GATE=auto`, where the pool is not tiny; or `on`)
  it holds those whose prefill would evict the prefixes of the others (see
  `AdmissionGate`).

Without `AtomStateManager` groups (plugin not enabled, a model without GDN
layers, prefix caching off) it is vLLM's scheduler unchanged, except for the
admission gate where `ATOM_ADMISSION_GATE=on` asks for it.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Optional

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import MambaSpec

from ..config import ADDITIONAL_CONFIG_KEY, PREFIX_MATCH_UNIT_TOKENS, engine_config, server_config
from ..core.placement import MIN_POOL_CHECKPOINTS, pool_under_minimum
from .admission_gate import AdmissionGate
from .admission_order import order_waiting
from .floor_states import FloorStates
from .metrics_connector import CONNECTOR_NAME, AtomStatsConnector
from .planner import CheckpointPlanner, FreedState, KVPages
from .state_manager import AtomStateManager
from .state_search import StateSearch

logger = logging.getLogger("atom_hybrid_cache")


def kv_prefix_tokens(pool, kv_groups, request, hash_unit: int, hit: int = 0) -> int:
    """How far the KV groups `kv_groups` ([(group id, block size)]) alone
    hold `request`'s prompt in `pool`, in whole blocks of each, the shortest
    group's answer; the walk starts at `hit`, which every group serves."""
    hashes = request.block_hashes
    limit = request.num_tokens - 1
    best = None
    for g, step in kv_groups:
        n = hit // step * step
        while n + step <= limit:
            i = (n + step) // hash_unit - 1
            if i >= len(hashes) or pool.get_cached_block(hashes[i], [g]) is None:
                break
            n += step
        best = n if best is None else min(best, n)
    return best or 0


class AtomSchedulerMixin:
    _atom: Optional[CheckpointPlanner] = None
    _atom_gate: Optional[AdmissionGate] = None
    _atom_floors: Optional[FloorStates] = None

    def _atom_setup(self) -> None:
        self._atom = None
        self._atom_gate = None
        self._atom_floors = None
        # the server's defaults, then the exported ATOM_* variables, then this
        # engine's --additional-config
        extra = self.vllm_config.additional_config
        env_cfg = engine_config(extra, server_config())
        if isinstance(extra, dict) and extra.get(ADDITIONAL_CONFIG_KEY):
            logger.info("atom_hybrid_cache: settings from --additional-config: %s",
                        extra[ADDITIONAL_CONFIG_KEY])
        managers = self.kv_cache_manager.coordinator.single_type_managers
        state_groups = [g for g, m in enumerate(managers) if isinstance(m, AtomStateManager)]
        if not state_groups:
            if any(isinstance(m.kv_cache_spec, MambaSpec) for m in managers):
                logger.warning("atom_hybrid_cache: AtomScheduler runs, but no state group uses "
                               "AtomStateManager (is VLLM_PLUGINS=atom_hybrid_cache set?): "
                               "vLLM's own hybrid caching is in charge")
            self._atom_gate = self._atom_admission_gate(env_cfg.admission_gate)
            if self._atom_gate is not None:
                logger.info("atom_hybrid_cache scheduler: admission gate on (no state groups)")
            return
        first = managers[state_groups[0]]
        if not self.cache_config.enable_prefix_caching or first.mamba_cache_mode != "align":
            self._atom_gate = self._atom_admission_gate(env_cfg.admission_gate)
            return
        block_size = first.block_size
        num_blocks = self.kv_cache_manager.block_pool.num_gpu_blocks
        max_seqs = self.scheduler_config.max_num_seqs
        kv_groups = [(g, m.block_size) for g, m in enumerate(managers)
                     if not isinstance(m.kv_cache_spec, MambaSpec)]
        # every group's page has the same bytes: a checkpoint takes one page
        # per state group, a block of tokens one page per attention group
        pages_per_block = max(1, len(kv_groups))
        pool_tokens = (num_blocks - 1) * block_size
        planner = CheckpointPlanner(
            env_cfg.placement, block_size=block_size, hash_block_size=self.hash_block_size,
            kv_share_tokens=pool_tokens // max_seqs,
            stats_log_interval=env_cfg.stats_log_interval,
            interior_readable=bool(getattr(first.kv_cache_spec, "interior_checkpoints", False)),
            checkpoint_kv_tokens=len(state_groups) * block_size // pages_per_block,
            pool_kv_tokens=pool_tokens // pages_per_block)
        for g in state_groups:
            managers[g].attach(planner)
        self._atom = planner
        self._atom_gate = self._atom_admission_gate(env_cfg.admission_gate, planner)
        planner.gate_on = self._atom_gate is not None
        connector = getattr(self, "connector", None)
        if isinstance(connector, AtomStatsConnector):
            connector.report(planner.stats)
            logger.info("atom_hybrid_cache: counters exported as vllm:atom_* metrics "
                        "through %s", CONNECTOR_NAME)
        self._atom_hits_first = env_cfg.admission_order == "hits-first"
        self._atom_passed_over: dict = {}
        # rid -> (prompt end, pages): the prompt-end state each live request
        # holds; the requests whose last prefill chunk is being scheduled
        # (see _hold_prompt_end_states)
        self._atom_anchors: dict = {}
        self._atom_anchor_pending: set = set()
        self._atom_state_groups = state_groups
        self._atom_states = StateSearch(self.kv_cache_manager.block_pool, state_groups,
                                        self.hash_block_size, block_size)
        # [(group id, block size)] of the attention groups
        self._atom_kv_groups = kv_groups
        if planner.placement.floor_fractions and planner.reuse_aware:
            self._atom_floors = FloorStates(self.kv_cache_manager.block_pool, self._atom_states,
                                            planner.placement.floor_fractions, num_blocks)
        logger.info("atom_hybrid_cache scheduler: %d state groups, %d KV groups, state block %d "
                    "tokens, hash unit %d, pool %d blocks; checkpoints %s; admission order %s; "
                    "admission gate %s; placement %s",
                    len(state_groups), len(self._atom_kv_groups), block_size,
                    self.hash_block_size, num_blocks,
                    "written inside prefill forwards" if planner.interior_readable
                    else "at prefill chunk ends (chunks cut onto them)",
                    env_cfg.admission_order, "on" if self._atom_gate else "off",
                    planner.placement)
        if self.hash_block_size > PREFIX_MATCH_UNIT_TOKENS:
            logger.warning("atom_hybrid_cache: prefix hits land on %d-token boundaries; leave "
                           "--prefix-match-unit unset (the plugin then picks %d or a divisor "
                           "of it) for finer hits", self.hash_block_size, PREFIX_MATCH_UNIT_TOKENS)

    def _atom_admission_gate(self, mode: str,
                             planner: Optional[CheckpointPlanner] = None) -> Optional[AdmissionGate]:
        """The admission gate `ATOM_ADMISSION_GATE=mode` asks for, or None.
        `on` needs no state groups (it also serves attention-only models);
        `auto` needs the planner, for the pool's size in checkpoints. The
        holds are counted with the planner's stats, so its log lines and
        the metrics report them."""
        if mode == "off":
            return None
        if not (self.cache_config.enable_prefix_caching and isinstance(self.waiting, deque)):
            if mode == "on":
                logger.warning("atom_hybrid_cache: ATOM_ADMISSION_GATE=on needs prefix caching "
                               "and vLLM's fcfs scheduling policy; the gate stays open")
            return None
        if mode == "auto":
            if planner is None:
                return None
            if pool_under_minimum(planner.pool_kv_tokens, planner.checkpoint_kv_tokens):
                logger.warning("atom_hybrid_cache: admission gate off (auto): the KV pool (%s "
                               "tokens) holds %d checkpoints' worth, under %d",
                               f"{planner.pool_kv_tokens:,}",
                               planner.pool_kv_tokens // planner.checkpoint_kv_tokens,
                               MIN_POOL_CHECKPOINTS)
                return None
        return AdmissionGate(planner.stats if planner is not None else None)

    # -- admission and chunking ------------------------------------------
    def _kv_prefix_tokens(self, request, hit: int = 0) -> int:
        """How far the KV groups alone could serve this prompt: the
        `compressed` length of the stats and the demand rung. Every group
        serves the `hit` already, so the walk starts there."""
        return kv_prefix_tokens(self.kv_cache_manager.block_pool, self._atom_kv_groups,
                                request, self.hash_block_size, hit)

    def _mamba_block_aligned_split(self, request, num_new_tokens: int,
                                   num_new_local_computed_tokens: int = 0,
                                   num_external_computed_tokens: int = 0) -> int:
        n = super()._mamba_block_aligned_split(request, num_new_tokens,
                                               num_new_local_computed_tokens,
                                               num_external_computed_tokens)
        planner = self._atom
        start = (request.num_computed_tokens + num_new_local_computed_tokens
                 + num_external_computed_tokens)
        # decode steps (most calls) have nothing planned
        if planner is None or n <= 0 or start >= request.num_prompt_tokens:
            return n
        rid = request.request_id
        if request.num_computed_tokens == 0:
            # Not started (new or preempted): plan from this admission's hit
            # (a request waiting for room is asked again every step).
            plan = planner.plans.get(rid)
            if plan is None or plan.hit != start:
                planner.plan(rid, request.num_prompt_tokens, request.block_hashes, hit=start,
                             compressed=max(start, self._kv_prefix_tokens(
                                 request, num_new_local_computed_tokens)))
        end = planner.chunk_stop(rid, start, start + n)
        if end >= request.num_prompt_tokens and planner.reuse_aware:
            self._atom_anchor_pending.add(rid)
        return end - start

    def schedule(self, *args, **kwargs):
        gate = self._atom_gate
        hits = {} if gate is not None else None
        if self._atom_floors is not None:
            # before the gate counts the free pages: a floor is not free
            self._atom_floors.hold_window(self)
        if self._atom is not None and self._atom_hits_first:
            order_waiting(self, self._atom_passed_over, hits)
        gated = gate.open(self, hits) if gate is not None else None
        out = None
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            if gated is not None:
                gate.close(self, gated, out)
        planner = self._atom
        if planner is not None:
            for new in out.scheduled_new_reqs:
                planner.admitted(new.req_id, new.num_computed_tokens)
                self._atom_passed_over.pop(new.req_id, None)
            if self._atom_anchor_pending:
                self._hold_prompt_end_states()
        return out

    def _hold_prompt_end_states(self) -> None:
        """A request whose prefill was scheduled to its end takes a
        reference on its prompt-end state, the anchor its next turn resumes
        on, and keeps it until its release (see _free_request_blocks).

        Why: vLLM keeps that state in a page of its own and gives the page
        back to the LRU two steps later, while the request still decodes.
        Under pressure it was evicted there, before the request's release,
        and the next turn could resume only where an older state survived.
        On 60 traces at c8 / 80 GiB that was 0 for runs of consecutive turns
        of long conversations: each turn computed from 0 and lost its own
        anchor the same way."""
        pending = self._atom_anchor_pending
        pool = self.kv_cache_manager.block_pool
        for rid in list(pending):
            request = self.requests.get(rid)
            if request is not None and request.num_computed_tokens < request.num_prompt_tokens:
                continue   # not admitted this step: asked again when it is
            pending.discard(rid)
            if request is None or rid in self._atom_anchors:
                continue
            # vLLM indexed it when it scheduled the chunk; a prompt under one
            # hash unit has none
            end = self._prompt_end(request)
            pages = self._states_at(request, end) if end else None
            if pages is not None:
                pool.touch(pages)
                self._atom_anchors[rid] = (end, pages)

    def _prompt_end(self, request) -> int:
        """Where vLLM keeps a prompt's end state: its last hash boundary
        before the prompt's last token."""
        H = self.hash_block_size
        return (request.num_prompt_tokens - 1) // H * H

    def reset_prefix_cache(self, *args, **kwargs) -> bool:
        """vLLM's reset needs every page free; the floors of waiting requests
        are references no preemption gives back, so they go first (those
        of running requests go with their preemption, or keep the reset
        failing as the requests themselves do)."""
        if self._atom_floors is not None:
            self._atom_floors.release_all_but({r.request_id for r in self.running})
        if self._atom_gate is not None:
            self._atom_gate.forget_lookups()
        return super().reset_prefix_cache(*args, **kwargs)

    # -- release ---------------------------------------------------------
    def _free_request_blocks(self, request) -> None:
        planner = self._atom
        if planner is None:
            return super()._free_request_blocks(request)
        rid = request.request_id
        self._atom_passed_over.pop(rid, None)
        self._atom_anchor_pending.discard(rid)
        anchor = self._atom_anchors.pop(rid, None)
        floors = self._atom_floors.release(rid) if self._atom_floors is not None else ()
        H = self.hash_block_size
        prefix = request.block_hashes[:request.num_computed_tokens // H]
        if not planner.reuse_aware:
            planner.finished(rid, prefix, ())
            return super()._free_request_blocks(request)
        kvm = self.kv_cache_manager
        pool = kvm.block_pool
        managers = kvm.coordinator.single_type_managers
        states: list[FreedState] = []
        kv: list[KVPages] = []
        nulls = []
        held = set()
        kept = []
        primary = self._atom_state_groups[0]
        for g, m in enumerate(managers):
            blocks = m.pop_blocks_for_free(rid)
            if not isinstance(m.kv_cache_spec, MambaSpec):
                # (null pages, e.g. out of a sliding window, count as uncached)
                kv.append(KVPages(m.block_size, blocks, [b.block_hash is not None for b in blocks]))
                continue
            for b in blocks:
                if b.is_null:
                    nulls.append(b)   # vLLM passes them too; free_blocks skips them
                    continue
                held.add(b.block_id)
                if b.block_hash is not None:
                    pos = b.block_hash_num_tokens or 0
                    states.append(FreedState(b, pos, True))
                    if g == primary:
                        kept.append(pos)
                else:
                    states.append(FreedState(b, 0, False))
        if anchor is not None:
            # the prompt-end state this request held goes back with its pages
            pos, pages = anchor
            states += self._held_states_back(pos, pages, held)
            if pos not in kept:
                kept.append(pos)
        for pos, pages in floors:
            # held since the request entered the admission window: they go
            # back in its units, below the KV they insure
            states += self._held_states_back(pos, pages, held)
        states += self._refreshed_states(request, held)
        # vLLM keeps the prompt-end state in a page of its own (a copy of
        # the state at the prefill's last hash boundary), not in the block
        # table: count it here when this request did not hold it
        prompt_end = self._prompt_end(request)
        if (anchor is None and prompt_end and prompt_end not in kept
                and self._states_at(request, prompt_end) is not None):
            kept.append(prompt_end)
        order = nulls + planner.eviction_order(states, kv)
        planner.finished(rid, prefix, kept)
        if self._request_blocks_can_be_freed(request):
            pool.free_blocks(order)
        else:
            # drained in reverse (see Scheduler._drain_deferred_frees)
            self.deferred_frees.append((self.sched_step_seq, order[::-1]))

    def _held_states_back(self, pos: int, pages, held: set) -> list[FreedState]:
        """A state we held a reference on (the prompt-end anchor, a floor),
        given back with the freed request's pages, in its unit. A page still
        in its block table (`held`) only loses our reference: vLLM's goes
        back with the table."""
        out = []
        for b in pages:
            if b.block_id in held:
                self.kv_cache_manager.block_pool.free_blocks([b])
            else:
                held.add(b.block_id)
                out.append(FreedState(b, pos, True))
        return out

    def _refreshed_states(self, request, held: set) -> list[FreedState]:
        """A few states other requests left on this prefix, taken back so
        they leave with this request's KV in unit order: the one it resumed
        from and the highest at or below each retain fraction of its
        length (`PlacementConfig.retain_fractions`). Older anchors beyond
        those are history and stay where their own request left them in
        the LRU."""
        plan = self._atom.plans.get(request.request_id)
        end = request.num_computed_tokens
        wanted = [plan.hit] if plan is not None and plan.hit else []
        wanted += [int(end * f) for f in self._atom.placement.retain_fractions]
        pool = self.kv_cache_manager.block_pool
        out = []
        for pos, blocks in self._atom_states.highest_at_or_below(request.block_hashes, wanted):
            new = [b for b in blocks if b.block_id not in held]
            pool.touch(new)
            for b in new:
                held.add(b.block_id)
                out.append(FreedState(b, pos, True))
        return out

    def _states_at(self, request, pos: int):
        """Every state group's page of the state after `pos` tokens of this
        request's prefix, or None (see `StateSearch.states_at`)."""
        return self._atom_states.states_at(request.block_hashes, pos)


class AtomScheduler(AtomSchedulerMixin, Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._atom_setup()


class AtomAsyncScheduler(AtomSchedulerMixin, AsyncScheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._atom_setup()
