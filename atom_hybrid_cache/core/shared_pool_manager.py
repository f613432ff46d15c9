"""The replay planner's model of the plugin inside vLLM: KV pages and state
pages in ONE pool (`page_pool.PagePool`, vLLM's free order), one file each
for its parts: the pool's shape and the plugin's policy for it
(`shared_pool_shape`), the keys and lookups (`shared_pool_index`: a hit is
the longest indexed KV prefix ending on a state of every group), what a
request holds (`shared_pool_held`), the release in units
(`shared_pool_release`), the floors and the gate (`shared_pool_window`).

What the plugin does in vLLM, and this model with it:
- a state is one page per state group (`pages_per_state`), a page of KV is
  one attention block of `page_tokens`; both come from the same pool, so a
  checkpoint costs the KV of `pages_per_state` pages; prefixes hash every
  `hash_unit` tokens (`prefix_match_unit`);
- states are kept where vLLM's align mode keeps them, at chunk ends: the
  prompt's last page boundary before its last token, the prompt's last
  hash-unit boundary (a copy page), the shared-prefix junction (where the
  KV prefix outran the states), and the positions the plugin's planner
  places (`planner.CheckpointPlanner`: the same object the vLLM adapter
  asks, over the same `policy.CheckpointPolicy`); prefill chunks end on all
  of them. `plugin=False` is vLLM's own align mode (no planned states, no
  copy page unless the hash unit is finer than the page, states then KV
  freed tail first): the same model's check against native vLLM;
- admission as vLLM's: only where the whole prompt's KV fits beside a state
  page per group (and speculation's k scratch pages, held to the release:
  `SharedPoolShape.speculative_state_pages`), taking the first chunk's
  pages; later chunks take theirs (`reserve_chunk`), and the simulator
  preempts where they do not fit: vLLM schedules a preempted request again
  as a resumed one, which the plugin's planner does not count as admitted;
- vLLM's `remove_skipped_blocks`: a prefill's state two chunk ends back is
  freed before the room for its next chunk is counted; its
  `cached_blocks_this_step`: a hit on a state another running request
  wrote this step, or re-keyed (its prompt end, in the step of its last
  prompt chunk), waits for the next step, and all behind it.

Left out (BENCHMARKS.md, "The planner against vLLM's scheduler"): the KV of
draft tokens (a page at most a running request), more than one attention group.
The interface is `manager.HybridCacheManager`'s: `replay.simulator` drives either.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..config import PlacementConfig
from .gate_steps import gate_on
from .manager import Admission
from .oracle import PrefixOracle
from .page_pool import PagePool
from .planner import CheckpointPlanner
from .priced_eviction import pages_per_token
from .shared_pool_held import HeldRequest
from .shared_pool_index import SharedPoolIndex
from .shared_pool_release import free_in_units, free_in_vllm_order
from .shared_pool_shape import SharedPoolShape, shared_pool_policy
from .shared_pool_window import SharedPoolWindow
from .stats import CacheStats


class SharedPoolManager:
    def __init__(self, shape: SharedPoolShape, placement: PlacementConfig, *,
                 floor_fractions: tuple = (), plugin: bool = True,
                 admission_gate: str = "off", admission_order: str = "arrival",
                 oracle_limit: int = 1 << 62) -> None:
        """`floor_fractions`, `admission_gate` (its ATOM_ADMISSION_GATE
        mode) and `admission_order` (ATOM_ADMISSION_ORDER's): the server's,
        as the plugin gets them; the policy drops the floors where a slot's
        share cannot afford them (`auto` gates at every size)."""
        self.shape = shape
        self.plugin = plugin
        self.block_size = shape.hash_unit     # the simulator's hash unit
        self.page = shape.page_tokens
        self.sub = shape.page_tokens // shape.hash_unit
        self.pps = shape.pages_per_state
        self.policy = shared_pool_policy(shape, placement, floor_fractions)
        # the plugin's free order, priced where its policy prices (from the
        # step whose requests in flight leave a small share, `open_step`);
        # vLLM's FIFO for native
        self.pool = PagePool(shape.num_pages, on_evict=self._on_evict,
                             price_weight=self._price_weight() if plugin else 0.0)
        self.index = SharedPoolIndex(self.pool, shape.page_tokens, shape.hash_unit, self.pps)
        self.planner = CheckpointPlanner(self.policy, hash_unit=shape.hash_unit,
                                         stats_log_interval=0) if plugin else None
        self.stats = CacheStats()
        self.oracle = PrefixOracle(oracle_limit)
        self._held: dict = {}
        # partial-hit copy-on-write sources this step still references
        self._cow_sources: list = [[] for _ in range(shape.pages_per_state + 1)]
        # states: written, read, evicted (a state is lost with any of its pages)
        self.writes = self.reads = self.evicted_states = self.dropped = 0
        self._live_states: set = set()   # first group's keys of the kept states
        self._step_states: dict = {}     # those written this step -> their writer
        # the floors, hits first and the admission gate, where the plugin runs
        # them (vllm/scheduler_setup.py: floors with the reuse-aware release)
        self.window: Optional[SharedPoolWindow] = None
        if plugin:
            floors = self.policy.floor_ledger_fractions
            gate = gate_on(admission_gate)
            if gate and not shape.step_tokens:
                raise ValueError("the admission gate's model needs the step's tokens "
                                 "(SharedPoolShape.step_tokens)")
            hits_first = admission_order == "hits-first"
            if gate or floors or hits_first:
                self.window = SharedPoolWindow(self, gate=gate, floor_fractions=floors,
                                               hits_first=hits_first)
            self.planner.gate_on = gate

    def _on_evict(self, key: int) -> None:
        # counted on the first group's page: a state is lost with any page, once
        if key in self._live_states:
            self._live_states.discard(key)
            self.evicted_states += 1

    # -- the step's admission window ------------------------------------
    def _price_weight(self) -> float:
        return pages_per_token(self.policy.eviction_price_weight, self.shape.num_pages,
                               self.shape.page_tokens)

    def open_step(self, waiting: list, running: Sequence) -> list:
        """Before a step (`waiting`, `running`: in vLLM's order): the requests
        in flight size the share (as `vllm/scheduler.py`), then the floors,
        hits first (which reorders `waiting` in place, as the adapter
        reorders vLLM's queue) and the gate's pins; the waiting requests
        the gate holds out."""
        self._step_states.clear()
        if self.plugin and self.policy.observe_in_flight(len(waiting) + len(running)):
            self.pool.set_price_weight(self._price_weight())
            if self.window is not None and self.window.floors is not None:
                self.window.floors.max_pages = self.policy.floor_max_pages(self.shape.num_pages)
        return self.window.open(waiting, running) if self.window is not None else []

    def close_step(self, scheduled_tokens: int) -> None:
        if self.planner is not None:    # (no busy step to spare: it learns at once)
            self.planner.step_scheduled(learn_now=True)
        if any(self._cow_sources):
            self.pool.free([p for group in self._cow_sources for p in group])
            self._cow_sources = [[] for _ in range(self.pps + 1)]
        if self.window is not None:
            self.window.close(scheduled_tokens)

    def step_gated(self) -> bool:
        """Whether the gate pinned or held anything this step: an admission that fails
        with nothing running then waits for the next, ungated, not over the pool."""
        return self.window is not None and self.window.gated()

    def abandon(self, req) -> None:
        """A waiting request the replay gives up on: its floors go back."""
        if self.window is not None:
            for _, pages in self.window.leave(req.request_id):
                self.pool.free(pages)

    def lookup(self, req) -> tuple[int, list, Optional[list]]:
        """vLLM's lookup: (hit tokens, the KV pages under it, each group's state page)."""
        P = self.page
        hashes = req.block_hashes
        full, reach, partial_page = self.index.kv_prefix(hashes, req.num_tokens - 1)
        hit, hit_state = self.index.state_hit(hashes, reach)
        src = (full + ([partial_page] if partial_page is not None else []))[:-(-hit // P)]
        return hit, src if hit else [], hit_state

    def held_kv_pages(self, request_id) -> int:
        """The pages of a running request's attention block table."""
        return len(self._held[request_id].kv)

    # -- admission -------------------------------------------------------
    def admit(self, req, budget: Optional[int] = None) -> Optional[Admission]:
        """Look the prompt up and take the pages of its first chunk of at
        most `budget` tokens (None: the whole prompt in one); None when they
        do not fit now."""
        P, U = self.page, self.block_size
        L = req.prompt_len
        hashes = req.block_hashes
        limit = L - self.shape.successor_room
        full, reach, partial_page = self.index.kv_prefix(hashes, limit)
        hit, hit_state = self.index.state_hit(hashes, reach)
        if hit and self._step_states.get(self.index.state_keys(hashes[hit // U - 1])[0]) in self._held:
            return None     # vLLM's MambaManager: the step's forward has not written it yet
        src = (full + ([partial_page] if partial_page is not None else []))[:-(-hit // P)]
        mid_page = hit % P != 0
        junction = reach // P * P if reach > hit else 0
        budget = L if budget is None else budget
        own = self.shape.vllm_positions(L, hit, junction)
        if not self.shape.chunk(hit, L, budget, own):
            # the step's budget left no whole page past the hit: vLLM stops
            # admitting this step (its align split gives 0 tokens, and the
            # adapter plans nothing) and takes no reference, so the next
            # step's allocations may evict the hit
            return None
        keep = self._kept_positions(req.request_id, L, hashes, hit, own,
                                    full_reach=max(hit, len(full) * P))
        first_end = hit + self.shape.chunk(hit, L, budget, keep)
        # KV pages past the hit's whole pages (a mid-page hit's page is
        # copied); a state page per group: the chunk's end column, or the
        # copy of a mid-page hit, whose column it ends in. vLLM admits only
        # where the whole prompt's KV fits (`scheduler_reserve_full_isl`),
        # and takes the first chunk's pages.
        new_kv = -(-first_end // P) - hit // P
        whole_kv = -(-L // P) - hit // P
        pool = self.pool
        evictable = len({p for p in src + (hit_state or []) if pool.ref_cnt[p] == 0})
        whole_states = self.pps * (min(max(-(-L // P) - -(-hit // P), 0) + mid_page, 1 + mid_page)
                                   + self.shape.speculative_state_pages)
        if whole_kv + whole_states > pool.num_free - evictable:
            return None
        pool.touch(src)
        if hit_state:
            pool.touch(hit_state)
            self.reads += 1
        kv = src[:hit // P] + pool.allocate(new_kv)
        held = HeldRequest(hit, keep, kv, pool.allocate(self.pps),
                           scratch=pool.allocate(self.pps * self.shape.speculative_state_pages))
        if mid_page:
            # copy-on-write: the copies run on; vLLM keeps the sources
            # referenced until its schedule() ends (the copy runs in this
            # step), then frees them group by group, the state groups
            # first, in admission order within a group (`close_step`)
            sources = hit_state + [src[-1]]
            if self.plugin and hit == (L - self.shape.successor_room) // U * U:
                # the hit is this prompt's own end: the plugin's hold on
                # its prompt-end state (vllm/anchor_holds.py) keeps the
                # state's source pages
                held.anchor = (hit, hit_state)
                sources = [None] * self.pps + [src[-1]]
            for g, page in enumerate(sources):
                if page is not None:
                    self._cow_sources[g].append(page)
        elif hit_state:
            held.retired.append((hit, hit_state))
            held.last_col = hit // P - 1
        self._held[req.request_id] = held
        if self.window is not None:
            self.window.forget_passed_over(req.request_id)
        req.hit_tokens = hit
        req.num_computed = hit
        req.blocks = kv
        cap = (L - self.shape.successor_room) // U
        reusable = max(self.oracle.reach(hashes, cap, hit // U) * U, reach // U * U)
        kv_reach = max(hit, reach // U * U)
        self.stats.record_admission(L, reusable, kv_reach, kv_reach, hit)
        if self.planner is not None:
            if req.preempted:   # counted once, as the adapter (vllm/admission.py)
                self.planner.resumed(req.request_id, L - hit)
            else:
                self.planner.admitted(req.request_id, hit)
        return Admission(hit, reusable, kv_reach, kv_reach, "state" if hit else None)

    def _kept_positions(self, rid, L: int, hashes, hit: int, own: dict,
                        full_reach: int) -> dict:
        """Position -> kind of every state this prefill keeps: the
        planner's and vLLM's `own` (`_vllm_positions`)."""
        keep = {}
        if self.planner is not None:
            # as the adapter (vllm/admission.chunk_tokens): a request that
            # waits for room keeps its plan while its hit stays
            plan = self.planner.plans.get(rid)
            if plan is None or plan.hit != hit:
                plan = self.planner.plan(rid, L, hashes, hit=hit, kv_reach=full_reach)
            keep.update(plan.kinds)
        for pos, kind in own.items():
            keep.setdefault(pos, kind)
        return keep

    # -- prefill ---------------------------------------------------------
    def next_chunk(self, req, budget: int) -> int:
        held = self._held[req.request_id]
        return self.shape.chunk(req.num_computed, req.prompt_len, budget, held.keep)

    # (replay.simulator: later chunks take pages by `reserve_chunk`, may preempt)
    allocates_by_chunk = True

    def reserve_chunk(self, req, n: int) -> bool:
        """Take the pages of the next `n` prompt tokens (after the first
        chunk, which `admit` took); False when the pool has no room."""
        if n <= 0:
            return True    # vLLM passes over a request with no tokens this step
        P = self.page
        held = self._held[req.request_id]
        start = req.num_computed
        end = start + n
        if passed := held.passed_state(start, P):
            self.pool.free(passed)
        if not self._retire_mid_page_running(held):
            return False
        new_kv = max(0, -(-end // P) - len(held.kv))
        new_column = -(-end // P) > -(-start // P)
        if new_kv + (self.pps if new_column else 0) > self.pool.num_free:
            return False
        pool = self.pool
        if new_column:
            # the running column becomes vLLM's last state column; one it
            # had not freed yet stays in the block table to the release
            held.retired.append((held.running_pos, held.running))
            held.last_col = len(held.kv) - 1
        held.kv.extend(pool.allocate(new_kv))
        if new_column:
            held.running, held.running_pos = pool.allocate(self.pps), None
        return True

    def _retire_mid_page_running(self, held: HeldRequest) -> bool:
        """vLLM's own mid-page state leaves the block table for the LRU at
        the request's next allocation, which takes fresh running pages;
        False when the pool has no room for them."""
        if not held.mid_page_running:
            return True
        if self.pool.num_free < self.pps:
            return False
        old, pos = held.running, held.running_pos
        held.running, held.running_pos = self.pool.allocate(self.pps), None
        held.mid_page_running = False
        if self.plugin:
            # the copy's source is the prompt-end state the plugin holds to
            # the release (vllm/anchor_holds.py takes it back in this step)
            if held.anchor is not None:
                self.pool.free(held.anchor[1])
            held.anchor = (pos, old)
            return True
        # a copy-on-write of the running state: the source goes back with
        # the step's other copy sources (`close_step`)
        for g, page in enumerate(old):
            self._cow_sources[g].append(page)
        return True

    def prefill_done(self, req, n: int) -> None:
        if n <= 0:
            return
        P, U = self.page, self.block_size
        held = self._held[req.request_id]
        start = req.num_computed
        end = start + n
        hashes = req.block_hashes
        pool = self.pool
        for j in range(start // P, min(end // P, len(hashes) // self.sub)):
            pool.index_page(held.kv[j], hashes[(j + 1) * self.sub - 1])
        self.oracle.learn(hashes, start // U, end // U)
        if self.planner is not None:
            self.planner.chunk_scheduled(hashes, start // U, min(end, req.prompt_len) // U)
        last = (req.prompt_len - self.shape.successor_room) // U * U
        if end >= req.prompt_len and last >= U:    # vLLM re-keys the prompt-end state
            self._step_states[self.index.state_keys(hashes[last // U - 1])[0]] = req.request_id
        if last % P and start <= last <= end:
            # vLLM's partial KV entry at the prompt's last hash-unit boundary
            # (a hit there indexes its copy-on-write page under it too)
            pool.index_page(held.kv[last // P], self.index.partial_key(hashes[last // U - 1]))
        req.num_computed = end
        if end >= req.prompt_len or end not in held.keep:
            return
        keys = self.index.state_keys(hashes[end // U - 1])
        # a mid-page state (the prompt's last hash-unit boundary) stays in
        # the running pages, which the request's next allocation copies
        # into fresh ones (`_retire_mid_page_running`)
        pages = held.running
        held.running_pos = end
        held.mid_page_running = bool(end % P)
        for p, k in zip(pages, keys):
            pool.index_page(p, k)
        self._live_states.add(keys[0])
        self._step_states[keys[0]] = req.request_id
        self.writes += 1
        self.stats.record_write(held.keep[end])

    # -- decode ----------------------------------------------------------
    def append_tokens(self, req, n: int) -> bool:
        P = self.page
        held = self._held[req.request_id]
        U = self.block_size
        prompt_end = (req.prompt_len - self.shape.successor_room) // U * U
        if not (self.plugin and held.retired and held.retired[-1][0] == prompt_end):
            # (the plugin holds the prompt-end state to the release: anchor_holds.py)
            if passed := held.passed_state(req.num_computed, self.page):
                self.pool.free(passed)
        new = req.num_tokens + n
        need = -(-new // P) - len(held.kv)
        if need > 0:
            if need > self.pool.num_free:
                return False
            held.kv.extend(self.pool.allocate(need))
        hashes = req.block_hashes
        for j in range(req.num_tokens // P, min(new // P, len(hashes) // self.sub)):
            self.pool.index_page(held.kv[j], hashes[(j + 1) * self.sub - 1])
        req.num_tokens = new
        req.num_computed = new
        return True

    # -- release ---------------------------------------------------------
    def finish(self, req) -> None:
        held = self._held.pop(req.request_id)
        if held.scratch:
            self.pool.free(held.scratch)   # (empty: to the free queue's head)
        if self.plugin:
            free_in_units(self, req, held)
        else:
            free_in_vllm_order(self.pool, held, self.pps)
        req.blocks = []

    def preempt(self, req) -> None:
        self.finish(req)
        req.rewind_to_prompt(self.block_size)

    def fates(self) -> dict:
        return dict(kept=self.writes, dropped=self.dropped, evicted=self.evicted_states,
                    orphaned=0, read=self.reads)
