"""The replay planner's hybrid block manager: admission and lifecycle of
requests over its own KV pool and state slot pool.

A request may resume at a prefix boundary only where BOTH the KV blocks and
a state checkpoint exist: the recurrent state is a fold over every token, so
a KV hit without a state at the same boundary is worthless (resuming from
anywhere else gives wrong output, silently). Where checkpoints go is the
pool's `CheckpointPolicy`, the object the vLLM adapter's planner asks too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from .replay_pool_config import ReplayPoolConfig
from .hashing import ROOT_PARENT
from .kinds import GUESS_KINDS, PROTECTED_KINDS, CheckpointKind
from .kv_pool import KVBlockPool
from .oracle import PrefixOracle
from .placement import CheckpointTargets, chunk_end, is_rung, ladder_positions, resume_cap_blocks
from .policy import CheckpointPolicy
from .slot_share import SlotShare
from .state_pool import CheckpointInfo, StateSlotPool
from .stats import CacheStats, format_stats_lines

logger = logging.getLogger("atom_hybrid_cache")


@dataclass
class Request:
    """One request as the core sees it.

    `block_hashes[i]` / `block_tokens[i]` describe full block i of the
    sequence; the owner appends entries as decode fills blocks."""

    request_id: object
    prompt_len: int
    block_hashes: list
    block_tokens: list
    num_computed: int = 0
    num_tokens: int = 0  # prompt + decoded so far
    blocks: list = field(default_factory=list)
    working_slots: list = field(default_factory=list)
    targets: CheckpointTargets = field(default_factory=CheckpointTargets)
    hit_tokens: int = 0
    resumed_from: Optional[int] = None  # hash of the checkpoint read
    anchor_hash: Optional[int] = None
    admitted: bool = False
    # rewound by a preemption: vLLM schedules it again as a resumed request
    preempted: bool = False

    def __post_init__(self) -> None:
        if self.num_tokens == 0:
            self.num_tokens = self.prompt_len

    def rewind_to_prompt(self, block_size: int) -> None:
        """Back to an unscheduled prompt (after a preemption): decoded
        tokens and the blocks they filled are forgotten."""
        self.preempted = True
        self.num_computed = 0
        self.num_tokens = self.prompt_len
        n_prompt_blocks = self.prompt_len // block_size
        del self.block_hashes[n_prompt_blocks:]
        del self.block_tokens[n_prompt_blocks:]
        self.targets = CheckpointTargets()


@dataclass
class Admission:
    hit_tokens: int
    reusable: int
    kv_reach: int
    wanted: int
    resume_kind: Optional[str]


class HybridCacheManager:
    """The hybrid block manager: KV blocks, state slots, checkpoint policy."""

    def __init__(self, cfg: ReplayPoolConfig, *, warn: Callable[[str], None] = logger.warning,
                 log: Callable[[str], None] = logger.info,
                 oracle_limit: Optional[int] = None) -> None:
        self.cfg = cfg
        self.block_size = cfg.block_size
        p = cfg.placement
        pool_tokens = (cfg.num_kv_blocks - 1) * cfg.block_size
        self.policy = CheckpointPolicy(
            p, block_size=cfg.block_size,
            # separate pools: every slot is counted in flight from the start
            share=SlotShare(pool_tokens, cfg.checkpoint_kv_tokens, cfg.max_num_seqs,
                            cfg.max_num_seqs),
            successor_room=cfg.successor_room, warn=warn)
        self.interval = self.policy.interval
        self.checkpointing = self.policy.checkpointing
        self.kv = KVBlockPool(cfg.num_kv_blocks, on_drop=self._on_kv_drop)
        protected_cap = cfg.max_num_seqs * p.protected_per_seq if p.eviction == "reuse-aware" else 0
        self.state = StateSlotPool(cfg.num_state_slots, protected_cap)
        self.stats = CacheStats(strict=cfg.strict_stats)
        self._log = log
        # every block hash ever indexed, for `reusable`
        self.oracle = PrefixOracle(oracle_limit if oracle_limit is not None
                                   else 16 * cfg.num_kv_blocks)
        self.running: dict[object, Request] = {}
        self._protected_kinds = frozenset(
            PROTECTED_KINDS if p.protected_kinds is None else p.protected_kinds)

    # -- admission -----------------------------------------------------
    def admit(self, req: Request) -> Optional[Admission]:
        """Match the prefix, take slots and blocks for the whole prompt, and
        plan checkpoints. None when the pools cannot hold the request now."""
        B = self.block_size
        L = req.prompt_len
        n_prompt_blocks = -(-L // B)
        cap = resume_cap_blocks(L, B, self.cfg.successor_room)
        hashes = req.block_hashes
        hit_blocks = self.kv.prefix_blocks(hashes, req.block_tokens, cap, ROOT_PARENT)
        kv_reach = len(hit_blocks)
        # KV blocks already in the pool are taken as they are even above the
        # usable hit: their content is exact, only the state must be rebuilt.
        reclaimable_free = sum(1 for b in hit_blocks if self.kv.ref_cnt[b] == 0)
        need_new = n_prompt_blocks - kv_reach
        if need_new > self.kv.num_free - reclaimable_free:
            return None
        slots = self.state.take_working(req.request_id, 1 + self.cfg.num_spec)
        if slots is None:
            return None
        # Only now: taking working slots may have evicted a checkpoint.
        usable = self._usable_blocks(hashes, kv_reach)
        self.kv.acquire(hit_blocks)
        req.blocks = hit_blocks + self.kv.allocate(need_new)
        req.working_slots = slots
        req.admitted = True

        # Past the oracle's bound `reusable` may under-count; the KV index
        # itself is proof that at least `kv_reach` blocks were reusable.
        reusable = max(self.oracle.reach(hashes, cap), kv_reach)
        resume_kind = None
        if usable:
            h = hashes[usable - 1]
            info = self.state.info(h)
            if info is None:
                if not self.cfg.kv_only_ceiling:
                    raise AssertionError(f"request {req.request_id}: resume at block {usable} without a checkpoint")
                resume_kind = "block"  # the ceiling's free state at every block
            else:
                resume_kind = info.kind
                self.state.read(h)
                req.resumed_from = h
            self.stats.record_resume_kind(resume_kind)
        hit = usable * B
        req.hit_tokens = hit
        req.num_computed = hit
        self.stats.record_admission(L, reusable * B, kv_reach * B, kv_reach * B, hit)
        self.stats.computed_prefill_tokens += L - hit
        if self.checkpointing and not self.cfg.kv_only_ceiling:
            req.targets = self.policy.plan(L, hit=usable * B, kv_reach=kv_reach * B,
                                           reusable=reusable * B)
        self.running[req.request_id] = req
        if self.cfg.stats_log_interval and self.stats.admissions % self.cfg.stats_log_interval == 0:
            for line in self.stats_lines():
                self._log(line)
        return Admission(hit, reusable * B, kv_reach * B, kv_reach * B, resume_kind)

    def _usable_blocks(self, hashes: Sequence[int], limit: int) -> int:
        """Longest prefix <= limit blocks ending at a state checkpoint.
        With one state class the fixpoint over classes is a single pass."""
        if self.cfg.kv_only_ceiling:
            return limit
        if not self.checkpointing:
            return 0
        index = self.state.index
        for j in range(limit, 0, -1):
            if hashes[j - 1] in index:
                return j
        return 0

    # -- prefill -------------------------------------------------------
    def next_chunk(self, req: Request, budget: int) -> int:
        """Tokens the next prefill forward of this request computes."""
        end, cut_kind = chunk_end(req.num_computed, budget, req.prompt_len, req.targets,
                                  self.cfg.interior_states_readable)
        if cut_kind is not None:
            self.stats.record_cut(cut_kind)
        return end - req.num_computed

    def prefill_done(self, req: Request, n: int) -> None:
        """A forward computed n more prompt tokens: index the blocks it
        filled and keep the checkpoints it passed."""
        B = self.block_size
        start = req.num_computed
        end = start + n
        if end > req.prompt_len:
            raise ValueError(f"request {req.request_id}: prefill past the prompt ({end} > {req.prompt_len})")
        self._commit_blocks(req, start // B, end // B)
        req.num_computed = end
        for pos, kind in req.targets.pop_through(end):
            if pos != end and not self.cfg.interior_states_readable:
                # Cannot happen with chunk cuts on: the chunk ended earlier.
                raise AssertionError(f"checkpoint at {pos} skipped by a chunk ending at {end}")
            self._keep(req, pos, kind)

    def _commit_blocks(self, req: Request, first: int, last: int) -> None:
        kv = self.kv
        hashes = req.block_hashes
        tokens = req.block_tokens
        for i in range(first, last):
            kv.commit(req.blocks[i], hashes[i], hashes[i - 1] if i else ROOT_PARENT, tokens[i])
        self.oracle.learn(hashes, first, last)

    def _keep(self, req: Request, pos: int, kind: CheckpointKind) -> None:
        h = req.block_hashes[pos // self.block_size - 1]
        if h not in self.kv.hash_to_block:
            # Its KV block is a duplicate of indexed content elsewhere or was
            # never indexed; a checkpoint nobody can reach is not kept.
            return
        reuse_aware = self.cfg.placement.eviction == "reuse-aware"
        protect = reuse_aware and kind in self._protected_kinds
        at_head = reuse_aware and kind in GUESS_KINDS
        had = self.state.has(h)
        slot = self.state.store(h, CheckpointInfo(pos, kind, req.request_id),
                                at_head=at_head, protect=protect)
        if slot is None or had:
            return
        self.stats.record_write(kind)
        if kind == CheckpointKind.ANCHOR:
            req.anchor_hash = h
            if reuse_aware and req.resumed_from is not None and req.resumed_from != h:
                # This conversation moved on: its previous anchor is history.
                self.state.unprotect(req.resumed_from)

    # -- decode --------------------------------------------------------
    def append_tokens(self, req: Request, n: int) -> bool:
        """Grow a request by n decoded tokens. The caller has appended the
        hashes/tokens of every block these tokens fill. False when the KV
        pool has no room (the caller preempts someone)."""
        B = self.block_size
        old = req.num_tokens
        new = old + n
        need = -(-new // B) - len(req.blocks)
        if need > 0:
            if need > self.kv.num_free:
                return False
            req.blocks.extend(self.kv.allocate(need))
        self._commit_blocks(req, old // B, new // B)
        req.num_tokens = new
        req.num_computed = new
        if self.interval > 0 and self.checkpointing:
            for pos in ladder_positions(old, new, self.interval):
                if pos % B == 0 and is_rung(pos, self.interval):
                    self._keep(req, pos, CheckpointKind.DECODE)
        return True

    # -- release -------------------------------------------------------
    def finish(self, req: Request) -> None:
        """Free a request: blocks tail first, so a cut under pressure
        shortens its prefix instead of beheading it."""
        self.running.pop(req.request_id, None)
        self.kv.release(reversed(req.blocks))
        req.blocks = []
        self.state.release_working(req.working_slots)
        req.working_slots = []
        req.admitted = False

    def preempt(self, req: Request) -> None:
        """Give everything back; the request will be admitted again from
        scratch (it then hits whatever it left in the cache)."""
        self.finish(req)
        req.rewind_to_prompt(self.block_size)

    # -- diagnostics ---------------------------------------------------
    def _on_kv_drop(self, h: int) -> None:
        self.state.invalidate(h)

    def pool_pressure(self) -> tuple[dict, dict]:
        kv, st = self.kv, self.state
        return (dict(used=kv.num_used, reusable_free=kv.num_cached_free, vacant=kv.num_vacant,
                     indexed=kv.num_indexed, total=kv.num_blocks - 1),
                dict(used=st.num_working, reusable_free=st.num_checkpoints, vacant=st.num_vacant,
                     indexed=st.num_checkpoints, total=st.num_slots))

    def stats_lines(self) -> list[str]:
        kv, st = self.pool_pressure()
        return format_stats_lines(self.stats, self.state.fates.as_dict(),
                                  self.state.num_slots, kv, st)
