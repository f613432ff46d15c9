"""Per-request checkpoint plans and the stats of a pool managed by someone else.

The vLLM adapter's scheduler asks the planner, for every request it admits,
where the request must leave state checkpoints (`plan`, then `chunk_stop`
for each prefill chunk), and tells it what each request reused and kept
(`admitted`, `finished`). The rule itself is the pool's `CheckpointPolicy`,
the same object the replay's manager asks.

The plans reach vLLM's state managers through `CheckpointPlans`, the one
hand-off object: the managers ask it which positions to keep while a
prefill computes past them (`positions_to_keep`) and which states a forward
writes from inside (`interior_positions`).

No vLLM import here: callers pass plain numbers and hash sequences.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

from .kinds import CheckpointKind
from .oracle import PrefixOracle
from .placement import CheckpointTargets, chunk_end
from .policy import CheckpointPolicy
from .stats import CacheStats, format_shared_pool_lines
from .tail_price import KVCutRate, keeps_partial_tail

logger = logging.getLogger("atom_hybrid_cache")

# Past this many distinct prefix hashes the oracle ("what an unbounded cache
# would reuse") stops learning: it then under-counts, never over-counts.
SEEN_HASH_LIMIT = 1 << 22
# Hash units the oracle may keep queued through a busy step (a few prefill
# chunks' worth); past it a busy step learns the oldest. A quiet step learns
# at most QUIET_LEARN_UNITS (about 0.1 ms: all of a busy run's queue at once
# made a decode step one of the slowest)
QUEUED_UNITS_BUSY = 4096
QUIET_LEARN_UNITS = 256


@dataclass
class RequestPlan:
    prompt_len: int
    hit: int
    kv_reach: int
    reusable: int
    targets: CheckpointTargets
    # every planned position -> kind, kept after the stop is passed: the
    # stats name the kind written
    kinds: dict = field(default_factory=dict)
    # the same positions, for the state managers' retention (`positions_to_keep`)
    retained: tuple = ()
    admitted: bool = False
    retained_max: int = 0


class CheckpointPlans:
    """The plans of the requests in flight, as the state managers read them.
    `interior`: the linear layers write planned states from inside a
    forward (else no forward is given any)."""

    __slots__ = ("_by_request", "interior")

    def __init__(self, interior: bool = False) -> None:
        self._by_request: dict[str, RequestPlan] = {}
        self.interior = interior

    def get(self, request_id: str) -> Optional[RequestPlan]:
        return self._by_request.get(request_id)

    def put(self, request_id: str, plan: RequestPlan) -> None:
        self._by_request[request_id] = plan

    def pop(self, request_id: str) -> Optional[RequestPlan]:
        return self._by_request.pop(request_id, None)

    def positions_to_keep(self, request_id: str, num_computed: int) -> tuple:
        """The planned positions a state manager keeps besides vLLM's own,
        while one is still ahead of the `num_computed` tokens (blocks up to
        it were hashed by earlier calls, so later ones need nothing); one
        dict lookup on the per-step path."""
        plan = self._by_request.get(request_id)
        if plan is None or plan.retained_max <= num_computed:
            return ()
        return plan.retained

    def interior_positions(self, request_id: str, start: int, end: int) -> list:
        """Planned positions strictly inside a forward over [start, end):
        the states its linear layers write from inside it."""
        plan = self._by_request.get(request_id)
        if plan is None or not self.interior:
            return []
        return [p for p in plan.retained if start < p < end]


class CheckpointPlanner:
    def __init__(self, policy: CheckpointPolicy, *, hash_unit: int, stats_log_interval: int,
                 interior_readable: bool = False,
                 pool_state: Callable[[], dict] = dict,
                 log: Callable[[str], None] = logger.info) -> None:
        """`hash_unit`: the tokens of one prefix hash; `interior_readable`:
        the linear layers write planned states from inside a forward (then
        chunks are not cut); `pool_state`: the shared pool's page counts for
        the stats lines."""
        self.policy = policy
        self.block_size = policy.block_size
        self.hash_unit = hash_unit
        self.stats = CacheStats()
        # the scheduler runs the admission gate: its line joins the stats lines
        self.gate_on = False
        self.stats_log_interval = stats_log_interval
        self.interior_readable = interior_readable
        self.pool_state = pool_state
        self._log = log
        self.plans = CheckpointPlans(interior_readable)
        # more lines for the stats report (a store connector's)
        self.extra_lines: list = []
        self.oracle = PrefixOracle(SEEN_HASH_LIMIT)
        self._step_chunks: list = []    # (hashes, start, stop) scheduled this step
        self.kv_cuts = KVCutRate()

    # -- admission -----------------------------------------------------
    def plan(self, request_id: str, prompt_len: int, block_hashes: Sequence, *,
             hit: int, kv_reach: int) -> RequestPlan:
        """(Re)plan a request that has not started: `hit` is where it resumes,
        `kv_reach` how far its KV prefix alone reaches."""
        B = self.block_size
        unit = self.hash_unit
        cap = min(len(block_hashes), (prompt_len - 1) // unit)
        reusable = max(self.oracle.reach(block_hashes, cap, hit // unit) * unit, kv_reach)
        targets = self.policy.plan(prompt_len, hit=hit, kv_reach=kv_reach // B * B,
                                   reusable=reusable // B * B)
        # vLLM keeps the prompt-end state itself (at hash granularity, finer
        # than ours); a stop of our own there would only be coarser.
        for pos, kind in list(targets.kinds.items()):
            if kind == CheckpointKind.ANCHOR or pos % B:
                targets.positions.remove(pos)
                del targets.kinds[pos]
        plan = RequestPlan(prompt_len, hit, kv_reach, reusable, targets, dict(targets.kinds),
                           tuple(targets.kinds), retained_max=max(targets.kinds, default=0))
        self.plans.put(request_id, plan)
        return plan

    def chunk_stop(self, request_id: str, start: int, end: int) -> int:
        """Where a prefill chunk [start, end) must end so that every planned
        checkpoint in it is a chunk end: without interior extraction a
        linear layer's forward stores a state only there."""
        plan = self.plans.get(request_id)
        if plan is None:
            return end
        return chunk_end(start, end - start, end, plan.targets, self.interior_readable)[0]

    def forward_scheduled(self, request_id: str, start: int, end: int) -> None:
        """A forward over [start, end) of this request's prompt was
        scheduled: with interior extraction, count the planned states it
        writes from inside."""
        if self.interior_readable:
            self.stats.interior_writes += len(
                self.plans.interior_positions(request_id, start, end))

    def admitted(self, request_id: str, num_cached_tokens: int) -> None:
        """The request was scheduled for the first time with this hit."""
        plan = self.plans.get(request_id)
        if plan is None or plan.admitted:
            return
        plan.admitted = True
        self.kv_cuts.record(plan.reusable, plan.kv_reach)
        hit = min(num_cached_tokens, plan.kv_reach)
        s = self.stats
        s.record_admission(plan.prompt_len, plan.reusable, plan.kv_reach, plan.kv_reach, hit)
        s.computed_prefill_tokens += plan.prompt_len - num_cached_tokens
        if self.stats_log_interval and s.admissions % self.stats_log_interval == 0:
            for line in self.stats_lines():
                self._log(line)

    def resumed(self, request_id: str, recomputed_tokens: int) -> None:
        """A preempted request was scheduled again: not a new admission (its
        reuse counted once), but the tokens it computes again are computed."""
        self.stats.computed_prefill_tokens += max(0, recomputed_tokens)

    # -- release -------------------------------------------------------
    def keeps_prompt_end(self, position: int) -> bool:
        """Whether the prompt-end state at `position`, inside a page, is
        worth keeping past its request (`tail_price`); a state on a page
        boundary always is."""
        B = self.block_size
        gain = position % B
        if not gain:
            return True
        keep = keeps_partial_tail(gain, self.policy.checkpoint_kv_tokens, B, self.kv_cuts.rate)
        if not keep:
            self.stats.partial_tails_dropped += 1
        return keep

    def chunk_scheduled(self, block_hashes: Sequence, start: int, stop: int) -> None:
        """A prefill over hash units [start, stop) of a prompt was scheduled
        this step: vLLM indexes its pages as it schedules them, and the
        oracle learns their hashes with them (a chunk's few hundred, where
        learning at the release put a long prompt's thousands into one
        step), once the step's scheduling is done (`step_scheduled`): a
        request planned later in the same step does not see them."""
        self._step_chunks.append((block_hashes, start, stop))

    def step_scheduled(self, learn_now: bool = False) -> None:
        """The step's chunks join the oracle's queue: learned in a quiet
        step (`catch_up`), or before the next plan reads the oracle
        (`learn_now`: the queue learned at once)."""
        self.oracle.learn_later(self._step_chunks)
        self._step_chunks.clear()
        if learn_now:
            self.oracle.catch_up()

    def catch_up(self, quiet: bool) -> None:
        """After a step: a quiet one (no prefill) learns the oldest queued
        chunks, `QUIET_LEARN_UNITS` at most; a busy one only what is past
        `QUEUED_UNITS_BUSY`."""
        if quiet:
            self.oracle.catch_up(0, QUIET_LEARN_UNITS)
        else:
            self.oracle.catch_up(QUEUED_UNITS_BUSY)

    def finished(self, request_id: str, block_hashes: Sequence, kept_states: Iterable[int],
                 computed: Optional[int] = None) -> None:
        """A request gave its pages back: the first `computed` of its
        `block_hashes` (None: all) were computed; `kept_states` are the
        positions of the states it wrote that are still indexed (one state
        group's)."""
        plan = self.plans.pop(request_id)
        # its prompt's hashes were learned as its chunks were scheduled
        # (`chunk_scheduled`); what it generated is learned here (a next turn
        # resends it)
        skip = plan.prompt_len // self.hash_unit if plan is not None else 0
        # queued behind its prompt's chunks (one entry): a release of a
        # short output often follows its prefill with no quiet step between
        stop = len(block_hashes) if computed is None else min(computed, len(block_hashes))
        self.oracle.learn_later([(block_hashes, skip, stop)])
        if plan is None:
            return
        prompt_end_block = (plan.prompt_len - 1) // self.block_size * self.block_size
        for pos in kept_states:
            if pos <= plan.hit:
                continue
            kind = plan.kinds.get(pos)
            if kind is None:
                # vLLM's own: the prompt's end, or a shared-prefix junction
                kind = (CheckpointKind.ANCHOR if pos >= prompt_end_block
                        else CheckpointKind.JUNCTION)
            self.stats.record_write(kind)

    # -- diagnostics ---------------------------------------------------
    def stats_lines(self) -> list[str]:
        return (format_shared_pool_lines(self.stats, self.pool_state(), self.gate_on)
                + [line() for line in self.extra_lines])
