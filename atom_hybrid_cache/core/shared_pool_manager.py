"""The replay planner's model of the plugin inside vLLM: KV pages and state
pages in ONE pool (`page_pool.PagePool`, vLLM's free order).

What the plugin does in vLLM, and this model with it:
- a state is one page per state group (`pages_per_state`), a page of KV is
  one attention block of `page_tokens`; both come from the same pool, so a
  checkpoint costs the KV of `pages_per_state` pages;
- prefix hashes every `hash_unit` tokens (`prefix_match_unit`); a hit is the
  longest prefix whose KV pages are indexed (whole pages, then vLLM's
  partial entry at a prompt's last unit boundary) and ending on a state of
  every group;
- states are kept where vLLM's align mode keeps them, at chunk ends: the
  prompt's last page boundary before its last token, the prompt's last
  hash-unit boundary (a copy page), the shared-prefix junction (where the
  KV prefix outran the states), and the positions the plugin's planner
  places (`planner.CheckpointPlanner`: the same object the vLLM adapter
  asks, over the same `policy.CheckpointPolicy`); prefill chunks end on all
  of them;
- a finished request's pages go back in units (`eviction.freed_units`): its
  states, the prompt-end state it held, the states at its hit and retain
  fractions (`eviction.refreshed_positions`), each with the KV below it,
  top first. `plugin=False` is vLLM's own align mode (no planned states,
  no copy page unless the hash unit is finer than the page, KV then states
  freed tail first): the same model's check against native vLLM.

- admission as vLLM's: only where the whole prompt's KV fits beside a state
  page per group, taking the first chunk's pages; later chunks take theirs
  (`reserve_chunk`), and the simulator preempts where they do not fit.

- the floor states and the admission gate, where the plugin runs them
  (`shared_pool_window.py`: the adapter's decisions, from the same core
  code), and vLLM's `remove_skipped_blocks` (a prefill's state two chunk
  ends back is freed before the room for its next chunk is counted).

Left out (see BENCHMARKS.md, "The planner against vLLM's scheduler"):
hits-first admission order, `cached_blocks_this_step`, speculative
decoding, more than one attention group.

The interface is `manager.HybridCacheManager`'s, so `replay.simulator`
drives either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..config import PlacementConfig
from .eviction import (FreedState, KVPages, freed_order, highest_states_at_or_below,
                       refreshed_positions)
from .gate_steps import gate_on
from .kinds import CheckpointKind
from .manager import Admission
from .oracle import PrefixOracle
from .page_pool import PagePool
from .planner import CheckpointPlanner
from .shared_pool_window import SharedPoolWindow
from .policy import CheckpointPolicy
from .stats import CacheStats

# Index keys: a KV page under the hash of its last unit; vLLM's partial KV
# entry and each state group's page under the same hash with a salt.
_PARTIAL_SALT = 0x5A17_0000_0000_0001
_STATE_SALT = 0x3C3C_0000_0000_0000
# How far below each refreshed position the release looks, in pages
# (vllm/state_search.SEARCH_PAGES).
SEARCH_PAGES = 64


@dataclass(frozen=True)
class SharedPoolShape:
    """vLLM's pool as the plugin sees it: `num_pages` is num_gpu_blocks (the
    null page included); one attention group."""

    num_pages: int
    page_tokens: int
    hash_unit: int
    pages_per_state: int
    max_num_seqs: int
    successor_room: int = 1
    # vLLM's max_num_batched_tokens (0: at least a page): a chunk that
    # cannot end on a page boundary runs sub-page only where a page is
    # larger than a whole step, not where this step's budget is short
    step_tokens: int = 0

    def __post_init__(self) -> None:
        if self.page_tokens % self.hash_unit:
            raise ValueError(f"page of {self.page_tokens} tokens is not a multiple of the "
                             f"hash unit {self.hash_unit}")


def shared_pool_policy(shape: SharedPoolShape, placement: PlacementConfig,
                       floor_fractions: tuple = (), warn=lambda msg: None) -> CheckpointPolicy:
    """The plugin's policy for this pool, sized as `vllm/scheduler_setup.py`
    sizes it from vLLM's groups (one attention group)."""
    pool_tokens = (shape.num_pages - 1) * shape.page_tokens
    return CheckpointPolicy(
        placement, block_size=shape.page_tokens,
        kv_share_tokens=pool_tokens // shape.max_num_seqs, pool_kv_tokens=pool_tokens,
        checkpoint_kv_tokens=shape.pages_per_state * shape.page_tokens,
        floor_fractions=floor_fractions, warn=warn, budget_warn=warn)


@dataclass
class _Held:
    """What one admitted request holds in the pool. A state group's block
    table holds the running state and the states of the last chunk ends
    (`retired`: [(position or None when not kept, pages)]); vLLM frees a
    state two chunks after the one that wrote it."""

    hit: int
    keep: dict                     # position -> kind of the states it keeps
    kv: list                       # KV pages, in column order
    running: list                  # the running state's pages
    running_pos: Optional[int] = None   # the kept position they hold, if any
    retired: list = field(default_factory=list)
    anchor: Optional[tuple] = None  # (position, pages): the prompt-end copy it holds
    # the block-table column of retired[-1] while vLLM still frees it
    # (its `last_state_block_idx`); None once freed or overwritten
    last_col: Optional[int] = None
    # the running pages hold a mid-page state (`running_pos`)
    mid_page_running: bool = False


class SharedPoolManager:
    def __init__(self, shape: SharedPoolShape, placement: PlacementConfig, *,
                 floor_fractions: tuple = (), plugin: bool = True,
                 admission_gate: str = "off", oracle_limit: int = 1 << 62) -> None:
        """`floor_fractions` and `admission_gate` (its ATOM_ADMISSION_GATE
        mode): the server's, as the plugin gets them; the policy drops the
        floors where a slot's share cannot afford them (`auto` gates at
        every size)."""
        self.shape = shape
        self.plugin = plugin
        self.block_size = shape.hash_unit     # the simulator's hash unit
        self.page = shape.page_tokens
        self.sub = shape.page_tokens // shape.hash_unit
        self.pps = shape.pages_per_state
        self.pool = PagePool(shape.num_pages, on_evict=self._on_evict)
        self.policy = shared_pool_policy(shape, placement, floor_fractions)
        self.planner = CheckpointPlanner(self.policy, hash_unit=shape.hash_unit,
                                         stats_log_interval=0) if plugin else None
        self.stats = CacheStats()
        self.oracle = PrefixOracle(oracle_limit)
        self._held: dict = {}
        # partial-hit copy-on-write sources this step still references
        self._cow_sources: list = [[] for _ in range(shape.pages_per_state + 1)]
        self._state_salts = [_STATE_SALT + g for g in range(self.pps)]
        # states: written, read, evicted (a state is lost with any of its pages)
        self.writes = 0
        self.reads = 0
        self.evicted_states = 0
        self.dropped = 0
        self._live_states: set = set()   # first group's keys of the kept states
        # the floors and the admission gate, where the plugin runs them
        # (vllm/scheduler_setup.py: floors with the reuse-aware release)
        self.window: Optional[SharedPoolWindow] = None
        if plugin:
            floors = self.policy.floor_fractions if self.policy.reuse_aware else ()
            gate = gate_on(admission_gate)
            if gate and not shape.step_tokens:
                raise ValueError("the admission gate's model needs the step's tokens "
                                 "(SharedPoolShape.step_tokens)")
            if gate or floors:
                self.window = SharedPoolWindow(self, gate=gate, floor_fractions=floors)
            self.planner.gate_on = gate

    # -- keys ------------------------------------------------------------
    def _state_keys(self, h: int) -> list:
        return [h ^ s for s in self._state_salts]

    def _on_evict(self, key: int) -> None:
        # counted on the first group's page: a state is lost with any page,
        # once
        if key in self._live_states:
            self._live_states.discard(key)
            self.evicted_states += 1

    def _state_at(self, hashes: Sequence, pos: int) -> Optional[list]:
        """Every group's page of the state after `pos` tokens, or None."""
        i = pos // self.block_size - 1
        if i < 0 or i >= len(hashes):
            return None
        lookup = self.pool.lookup
        pages = []
        for k in self._state_keys(hashes[i]):
            p = lookup(k)
            if p is None:
                return None
            pages.append(p)
        return pages

    # -- the step's admission window ------------------------------------
    def open_step(self, waiting: Sequence, running: Sequence) -> list:
        """Before a step (`waiting`, `running`: the requests, in vLLM's
        order): the floors and the gate's pins; the waiting requests the
        gate holds out of this step."""
        return self.window.open(waiting, running) if self.window is not None else []

    def close_step(self, scheduled_tokens: int) -> None:
        if any(self._cow_sources):
            self.pool.free([p for group in self._cow_sources for p in group])
            self._cow_sources = [[] for _ in range(self.pps + 1)]
        if self.window is not None:
            self.window.close(scheduled_tokens)

    def step_gated(self) -> bool:
        """Whether the gate pinned or held anything this step: an admission
        that fails with nothing running then waits for the next step, which
        runs ungated (a stalled gate), instead of being over the pool."""
        return self.window is not None and self.window.gated()

    def abandon(self, req) -> None:
        """A waiting request the replay gives up on (larger than the pool):
        the floors it holds go back."""
        if self.window is not None:
            for _, pages in self.window.release_floors(req.request_id):
                self.pool.free(pages)

    def lookup(self, req) -> tuple[int, list, Optional[list]]:
        """vLLM's prefix lookup of a waiting request: (hit tokens, the KV
        pages under the hit, every state group's page at it)."""
        P = self.page
        hashes = req.block_hashes
        full, reach, partial_page = self._kv_prefix(hashes, req.num_tokens - 1)
        hit, hit_state = self._state_hit(hashes, reach)
        src = (full + ([partial_page] if partial_page is not None else []))[:-(-hit // P)]
        return hit, src if hit else [], hit_state

    def held_kv_pages(self, request_id) -> int:
        """The pages of a running request's attention block table."""
        return len(self._held[request_id].kv)

    # -- admission -------------------------------------------------------
    def _kv_prefix(self, hashes: Sequence, limit: int) -> tuple[list, int, Optional[int]]:
        """(full KV pages from the start, tokens the KV reaches, the page of
        vLLM's partial entry if the reach ends on one) within `limit` tokens."""
        P, U, sub = self.page, self.block_size, self.sub
        lookup = self.pool.lookup
        pages = []
        while (len(pages) + 1) * P <= limit and (len(pages) + 1) * sub <= len(hashes):
            p = lookup(hashes[(len(pages) + 1) * sub - 1])
            if p is None:
                break
            pages.append(p)
        reach = len(pages) * P
        first = len(pages) * sub
        for f in range(min(first + sub - 1, limit // U, len(hashes)) - 1, first - 1, -1):
            p = lookup(hashes[f] ^ _PARTIAL_SALT)
            if p is not None:
                return pages, (f + 1) * U, p
        return pages, reach, None

    def _state_hit(self, hashes: Sequence, reach: int) -> tuple[int, Optional[list]]:
        """The highest hash-unit boundary at or below `reach` with a state."""
        U = self.block_size
        for pos in range(reach // U * U, 0, -U):
            pages = self._state_at(hashes, pos)
            if pages is not None:
                return pos, pages
        return 0, None

    def admit(self, req, budget: Optional[int] = None) -> Optional[Admission]:
        """Look the prompt up and take the pages of its first chunk of at
        most `budget` tokens (None: the whole prompt in one); None when they
        do not fit now."""
        P, U = self.page, self.block_size
        L = req.prompt_len
        hashes = req.block_hashes
        limit = L - self.shape.successor_room
        full, reach, partial_page = self._kv_prefix(hashes, limit)
        hit, hit_state = self._state_hit(hashes, reach)
        src = (full + ([partial_page] if partial_page is not None else []))[:-(-hit // P)]
        mid_page = hit % P != 0
        junction = reach // P * P if reach > hit else 0
        budget = L if budget is None else budget
        own = self._vllm_positions(L, hit, junction)
        if not self._chunk(hit, L, budget, own):
            # the step's budget left no whole page past the hit: vLLM stops
            # admitting this step (its align split gives 0 tokens, and the
            # adapter plans nothing) and takes no reference, so the next
            # step's allocations may evict the hit
            return None
        keep = self._kept_positions(req.request_id, L, hashes, hit, own,
                                    full_reach=max(hit, len(full) * P))
        first_end = hit + self._chunk(hit, L, budget, keep)
        # KV pages past the hit's whole pages (a mid-page hit's page is
        # copied); a state page per group: the chunk's end column, or the
        # copy of a mid-page hit, whose column it ends in. vLLM admits only
        # where the whole prompt's KV fits (`scheduler_reserve_full_isl`),
        # and takes the first chunk's pages.
        new_kv = -(-first_end // P) - hit // P
        whole_kv = -(-L // P) - hit // P
        pool = self.pool
        evictable = len({p for p in src + (hit_state or []) if pool.ref_cnt[p] == 0})
        whole_states = self.pps * min(max(-(-L // P) - -(-hit // P), 0) + mid_page, 1 + mid_page)
        if whole_kv + whole_states > pool.num_free - evictable:
            return None
        pool.touch(src)
        if hit_state:
            pool.touch(hit_state)
            self.reads += 1
        kv = src[:hit // P] + pool.allocate(new_kv)
        held = _Held(hit, keep, kv, pool.allocate(self.pps))
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
        req.hit_tokens = hit
        req.num_computed = hit
        req.blocks = kv
        cap = (L - self.shape.successor_room) // U
        reusable = max(self.oracle.reach(hashes, cap, hit // U) * U, reach // U * U)
        kv_reach = max(hit, reach // U * U)
        self.stats.record_admission(L, reusable, kv_reach, kv_reach, hit)
        if self.planner is not None:
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

    def _vllm_positions(self, L: int, hit: int, junction: int) -> dict:
        """Position -> kind of the states vLLM's own split keeps past
        `hit`: the last page boundary and hash-unit boundary before the
        prompt's last token, and the junction."""
        P, U = self.page, self.block_size
        end = L - self.shape.successor_room
        return {pos: kind for pos, kind in ((junction, CheckpointKind.JUNCTION),
                                            (end // U * U, CheckpointKind.ANCHOR),
                                            (end // P * P, CheckpointKind.ANCHOR))
                if pos > hit}

    # -- prefill ---------------------------------------------------------
    def _chunk(self, start: int, L: int, budget: int, keep: dict) -> int:
        """vLLM's align-mode split (`_mamba_block_aligned_split`): whole
        pages unless it ends the prompt, stopping at the next page boundary
        and at every kept position (the plugin's among them, as its
        `chunk_stop` cuts them)."""
        P = self.page
        end = min(L, start + budget)
        if end < L:
            aligned = end // P * P
            if aligned > start or not self.shape.step_tokens or P <= self.shape.step_tokens:
                end = aligned
        stops = [p for p in keep if start < p < end]
        if start % P and (start // P + 1) * P < end:
            stops.append((start // P + 1) * P)
        return max(0, (min(stops) if stops else end) - start)

    def next_chunk(self, req, budget: int) -> int:
        return self._chunk(req.num_computed, req.prompt_len, budget,
                           self._held[req.request_id].keep)

    # read by replay.simulator: prefill chunks after the first take their
    # pages through `reserve_chunk`, and may preempt for them
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
        self._free_passed_state(held, start)
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

    def _retire_mid_page_running(self, held: _Held) -> bool:
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

    def _free_passed_state(self, held: _Held, computed: int) -> None:
        """vLLM's `remove_skipped_blocks`, which every allocation of a running
        request runs before it counts the free pages (so a request short of
        room has already given it back): the last state column leaves the
        block table once the computed tokens are past the column after it."""
        if held.last_col is not None and held.last_col < -(-computed // self.page) - 1:
            self.pool.free(held.retired.pop()[1])
            held.last_col = None

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
        learn = self.oracle.learn_one
        for i in range(start // U, min(end // U, len(hashes))):
            learn(hashes[i])
        last = (req.prompt_len - self.shape.successor_room) // U * U
        if last % P and start <= last <= end:
            # vLLM's partial KV entry at the prompt's last hash-unit boundary
            # (a hit there indexes its copy-on-write page under it too)
            pool.index_page(held.kv[last // P], hashes[last // U - 1] ^ _PARTIAL_SALT)
        req.num_computed = end
        if end >= req.prompt_len or end not in held.keep:
            return
        keys = self._state_keys(hashes[end // U - 1])
        # a mid-page state (the prompt's last hash-unit boundary) stays in
        # the running pages, which the request's next allocation copies
        # into fresh ones (`_retire_mid_page_running`)
        pages = held.running
        held.running_pos = end
        held.mid_page_running = bool(end % P)
        for p, k in zip(pages, keys):
            pool.index_page(p, k)
        self._live_states.add(keys[0])
        self.writes += 1
        self.stats.record_write(held.keep[end])

    # -- decode ----------------------------------------------------------
    def append_tokens(self, req, n: int) -> bool:
        P = self.page
        held = self._held[req.request_id]
        U = self.block_size
        prompt_end = (req.prompt_len - self.shape.successor_room) // U * U
        if not (self.plugin and held.retired and held.retired[-1][0] == prompt_end):
            # (the plugin holds the prompt-end state to the release:
            # vllm/anchor_holds.py)
            self._free_passed_state(held, req.num_computed)
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
        pool = self.pool
        hashes = req.block_hashes
        columns = held.retired + [(held.running_pos, held.running)]
        if held.anchor is not None:
            columns.append(held.anchor)
        if not self.plugin:
            # vLLM's order: group by group, each tail first; the state groups
            # come first (the tiny Qwen3-Next's and Qwen3.5's group order)
            for g in range(self.pps):
                pool.free(reversed([pages[g] for _, pages in columns if pages]))
            pool.free(reversed(held.kv))
            req.blocks = []
            return
        if (held.anchor is not None and held.anchor[0] % self.page
                and not self.planner.keeps_prompt_end(held.anchor[0])):
            # not worth its pages (core/tail_price.py): the copy and the
            # partial KV entry go back uncached, the page state below stays
            pos, pages = held.anchor
            for p in pages:
                pool.unindex(p)
            pool.unindex(held.kv[pos // self.page],
                         hashes[pos // self.block_size - 1] ^ _PARTIAL_SALT)
            columns[-1] = (None, pages)
        states: list = []
        taken: set = set()
        for pos, pages in columns:
            states += [FreedState(p, pos, True, g) if pos is not None else FreedState(p, 0, False)
                       for g, p in enumerate(pages)]
            taken.update(pages)
        wanted = refreshed_positions(held.hit, req.num_computed,
                                     self.policy.placement.retain_fractions)
        if self.window is not None:
            # floors held since the request entered the admission window go
            # back in its units (vllm/release.py); one in its own block
            # table only loses the floor's reference
            for pos, pages in self.window.release_floors(req.request_id):
                for g, p in enumerate(pages):
                    if p in taken:
                        pool.free([p])
                    else:
                        taken.add(p)
                        states.append(FreedState(p, pos, True, g))
        for pos, pages in self.highest_states_at_or_below(hashes, wanted):
            new = [(g, p) for g, p in enumerate(pages) if p not in taken]
            pool.touch([p for _, p in new])
            for g, p in new:
                taken.add(p)
                states.append(FreedState(p, pos, True, g))
        kv = KVPages(self.page, held.kv, [pool.is_indexed(p) for p in held.kv])
        pool.free(freed_order(states, [kv]))
        self.planner.finished(req.request_id, hashes[:req.num_computed // self.block_size],
                              [pos for pos, _ in columns if pos is not None])
        req.blocks = []

    def highest_states_at_or_below(self, hashes: Sequence, tops,
                                   max_pages: int = SEARCH_PAGES) -> list:
        """vllm/state_search.StateSearch.highest_at_or_below over this pool."""
        return highest_states_at_or_below(tops, self.block_size, self.page, max_pages,
                                          lambda pos: self._state_at(hashes, pos))

    def preempt(self, req) -> None:
        self.finish(req)
        req.rewind_to_prompt(self.block_size)

    # -- diagnostics -----------------------------------------------------
    def fates(self) -> dict:
        return dict(kept=self.writes, dropped=self.dropped, evicted=self.evicted_states,
                    orphaned=0, read=self.reads)
