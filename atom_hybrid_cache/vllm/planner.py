"""The checkpoint policy inside vLLM's scheduler, in vLLM-free terms.

`AtomScheduler` asks it, for every request it admits, where the request
must leave state checkpoints (chunk stops) and, when a request is freed, in
which order its pages go back to the shared LRU. The managers of the state
groups ask it which positions to keep. Positions are token counts; the
policy itself is the core's `plan_checkpoints`, shared with the replay
planner.

No vLLM import here: the scheduler passes plain numbers and block objects
it has already classified.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple, Sequence

from ..config import PlacementConfig
from ..core.placement import (CheckpointTargets, chunk_end, placement_for_pool,
                              plan_checkpoints, snap_interval)
from ..core.stats import CacheStats, format_gate_line, format_stats_lines

logger = logging.getLogger("atom_hybrid_cache")

# Past this many distinct prefix hashes the oracle ("what an unbounded cache
# would reuse") stops learning: it then under-counts, never over-counts.
SEEN_HASH_LIMIT = 1 << 22


@dataclass
class RequestPlan:
    prompt_len: int
    hit: int
    compressed: int
    reusable: int
    targets: CheckpointTargets
    # every planned position -> kind, kept after the stop is passed: the
    # stats name the kind written
    kinds: dict = field(default_factory=dict)
    # the same positions, for the state managers' retention: they add them
    # to vLLM's replay boundaries while one is still ahead of the computed
    # tokens (`AtomStateManager.cache_blocks`; blocks up to it were hashed
    # by earlier calls, so later ones need nothing)
    retained: tuple = ()
    admitted: bool = False
    retained_max: int = 0


class FreedState(NamedTuple):
    """A state page a freed request gives back: the state after `position`
    tokens when `cached` (indexed), else a running page with no position.
    `handle` is the vLLM block object."""

    handle: object
    position: int
    cached: bool


class KVPages(NamedTuple):
    """One KV group's pages of a freed request, in column order: page i
    holds tokens [(first_column + i) * block_size, + block_size), and
    `cached[i]` says whether it is indexed. One object per group, not per
    page: a long prompt frees hundreds of pages at once."""

    block_size: int
    handles: Sequence
    cached: Sequence[bool]
    first_column: int = 0


class CheckpointPlanner:
    def __init__(self, placement: PlacementConfig, *, block_size: int, hash_block_size: int,
                 kv_share_tokens: int, stats_log_interval: int,
                 interior_readable: bool = False, checkpoint_kv_tokens: int = 0,
                 pool_kv_tokens: int = 0,
                 log: Callable[[str], None] = logger.info,
                 warn: Callable[[str], None] = logger.warning) -> None:
        placement = placement_for_pool(placement, pool_kv_tokens, checkpoint_kv_tokens,
                                       lambda msg: warn(f"atom_hybrid_cache: {msg}"))
        self.placement = placement
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        self.kv_share_tokens = kv_share_tokens
        self.checkpoint_kv_tokens = checkpoint_kv_tokens
        self.pool_kv_tokens = pool_kv_tokens
        self.interval = snap_interval(placement.interval_tokens, block_size, warn)
        self.checkpointing = self.interval != 0
        self.reuse_aware = placement.eviction == "reuse-aware"
        self.stats = CacheStats()
        # the scheduler runs the admission gate: its line joins the stats lines
        self.gate_on = False
        self.stats_log_interval = stats_log_interval
        # One switch for both gates: with it, chunks are not cut and the
        # state managers give the forward a page at every planned position
        # inside its span instead (written by the GDN layer).
        self.interior_readable = interior_readable
        self._log = log
        self.plans: dict[str, RequestPlan] = {}
        self._seen: set = set()

    # -- admission -----------------------------------------------------
    def plan(self, request_id: str, prompt_len: int, block_hashes: Sequence, *,
             hit: int, compressed: int) -> RequestPlan:
        """(Re)plan a request that has not started: `hit` is where it resumes,
        `compressed` how far its KV prefix alone reaches."""
        B = self.block_size
        reusable = max(self._oracle_tokens(block_hashes, prompt_len, hit), compressed)
        if self.checkpointing:
            targets = plan_checkpoints(
                prompt_len, B, hit=hit, compressed=compressed // B * B,
                reusable=reusable // B * B, kv_share_tokens=self.kv_share_tokens,
                placement=self.placement, successor_room=1, interval=self.interval,
                checkpoint_kv_tokens=self.checkpoint_kv_tokens)
        else:
            targets = CheckpointTargets()
        # vLLM keeps the prompt-end state itself (at hash granularity, finer
        # than ours); a stop of our own there would only be coarser.
        for pos, kind in list(targets.kinds.items()):
            if kind == "anchor" or pos % B:
                targets.positions.remove(pos)
                del targets.kinds[pos]
        plan = RequestPlan(prompt_len, hit, compressed, reusable, targets, dict(targets.kinds),
                           tuple(targets.kinds), retained_max=max(targets.kinds, default=0))
        self.plans[request_id] = plan
        return plan

    def chunk_stop(self, request_id: str, start: int, end: int) -> int:
        """Where a prefill chunk [start, end) must end so that every planned
        checkpoint in it is a chunk end: without interior extraction a GDN
        forward stores a state only there."""
        plan = self.plans.get(request_id)
        if plan is None:
            return end
        return chunk_end(start, end - start, end, plan.targets, self.interior_readable)[0]

    def interior_positions(self, request_id: str, start: int, end: int) -> list:
        """Planned positions strictly inside a forward over [start, end): the
        ones its GDN layers must write from inside it (the state at `end`
        is the forward's own). Empty unless interior extraction is on."""
        plan = self.plans.get(request_id)
        if plan is None or not self.interior_readable:
            return []
        return [p for p in plan.retained if start < p < end]

    def admitted(self, request_id: str, num_cached_tokens: int) -> None:
        """The request was scheduled for the first time with this hit."""
        plan = self.plans.get(request_id)
        if plan is None or plan.admitted:
            return
        plan.admitted = True
        hit = min(num_cached_tokens, plan.compressed)
        s = self.stats
        s.record_admission(plan.prompt_len, plan.reusable, plan.compressed, plan.compressed, hit)
        s.computed_prefill_tokens += plan.prompt_len - num_cached_tokens
        if self.stats_log_interval and s.admissions % self.stats_log_interval == 0:
            for line in self.stats_lines():
                self._log(line)

    def _oracle_tokens(self, block_hashes: Sequence, prompt_len: int, hit: int = 0) -> int:
        """How far an unbounded cache would serve this prompt; at least
        `hit`, which the real one serves (the walk starts there: a long
        prompt has thousands of hashes below it)."""
        H = self.hash_block_size
        cap = min(len(block_hashes), (prompt_len - 1) // H)
        seen = self._seen
        n = min(hit // H, cap)
        while n < cap and block_hashes[n] in seen:
            n += 1
        return n * H

    # -- release -------------------------------------------------------
    def finished(self, request_id: str, block_hashes: Iterable, kept_states: Iterable[int]) -> None:
        """A request gave its pages back; `kept_states` are the positions of
        the states it wrote that are still indexed (one state group's)."""
        plan = self.plans.pop(request_id, None)
        seen = self._seen
        room = SEEN_HASH_LIMIT - len(seen)
        if room > 0:
            # the hashes below its hit went in when the request that
            # computed them finished
            skip = plan.hit // self.hash_block_size if plan is not None else 0
            seen.update(itertools.islice(block_hashes, skip, skip + room))
        if plan is None:
            return
        prompt_end_block = (plan.prompt_len - 1) // self.block_size * self.block_size
        for pos in kept_states:
            if pos <= plan.hit:
                continue
            kind = plan.kinds.get(pos)
            if kind is None:
                # vLLM's own: the prompt's end, or a shared-prefix junction
                kind = "anchor" if pos >= prompt_end_block else "junction"
            self.stats.record_write(kind)

    def eviction_order(self, states: Sequence[FreedState], kv: Sequence[KVPages] = ()) -> list:
        """The order a freed request's pages go back to the LRU, first
        evicted first.

        A state checkpoint is worth something only with every KV page below
        it, so a state and the KV pages between it and the next lower state
        are one unit, and units leave from the top: a cut under pressure
        shortens a conversation to its next lower checkpoint instead of
        taking its states first and leaving KV nobody can resume on (vLLM's
        own order frees the state groups before the attention group).
        Uncached pages go first (vLLM reuses those before evicting anyway).
        A KV page belongs to the lowest state above its first token.
        """
        if not self.reuse_aware:
            return [h for run in kv for h in run.handles] + [b.handle for b in states]
        tops = sorted({b.position for b in states if b.cached}, reverse=True)
        first = []
        # units[0]: KV pages above every state; units[u + 1]: tops[u]'s pages
        units: list = [[] for _ in range(len(tops) + 1)]
        merge = len(kv) > 1
        for size, handles, cached, c0 in kv:
            n = len(handles)
            first += [h for h, c in zip(handles, cached) if not c]
            # page i is tops[u]'s when ceil(tops[u+1] / size) <= c0 + i < ceil(tops[u] / size)
            bounds = [min(n, max(0, -(-pos // size) - c0)) for pos in tops] + [0]
            hi = n
            for u, lo in enumerate(bounds):
                # from the top page down; across groups merged by end below
                for i in range(hi - 1, lo - 1, -1):
                    if cached[i]:
                        units[u].append(((c0 + i + 1) * size, handles[i]) if merge else handles[i])
                hi = min(hi, lo)
        if merge:
            units = [[h for _, h in sorted(unit, key=lambda e: -e[0])] for unit in units]
        at: dict = {}
        for b in states:
            if b.cached:
                at.setdefault(b.position, []).append(b.handle)
            else:
                first.append(b.handle)
        out = first + units[0]
        for u, pos in enumerate(tops):
            out += at[pos]
            out += units[u + 1]
        return out

    # -- diagnostics ---------------------------------------------------
    def stats_lines(self) -> list[str]:
        # vLLM's block pool evicts silently: only reads are known
        fates = dict(kept="n/a", dropped="n/a", evicted="n/a", orphaned="n/a",
                     read=self.stats.resumed)
        lines = format_stats_lines(self.stats, fates, 0, {}, {})
        if self.gate_on:
            lines.append(format_gate_line(self.stats))
        return lines

