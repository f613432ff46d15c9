"""A request slot's share of the KV pool: the pool over the requests that
share it, counted as they arrive.

The insurance states (cold checkpoints, floors), priced eviction and the
fallback rungs are sized by what one request slot holds
(`pool_budget.MIN_SLOT_CHECKPOINTS`). `max_num_seqs` is only a ceiling on
the requests that share the pool: vLLM's default is 128 (CPU) to 1,024
(an H100 or H200 server), so a share taken from it puts most servers under
the line whatever their traffic. Measured on the small-pool sweep
(BENCHMARKS.md, "Small pools"), a share of the pool over 128 instead of the
requests really in flight cost up to 7 points at 500-1,000 checkpoints'
worth. So the share is the pool over the most requests in flight at once so
far (running and waiting, at most `max_num_seqs`), taken before each
scheduler step by the vLLM adapter and by the planner alike. It only
shrinks: a pool whose share fell under the line stays there (a lull does
not turn insurance on for the next burst), and a server that flips says so
once.
"""

from __future__ import annotations

from .pool_budget import MIN_SLOT_CHECKPOINTS, pool_checkpoints, slot_under_minimum


class SlotShare:
    def __init__(self, pool_kv_tokens: int, checkpoint_kv_tokens: int, max_num_seqs: int,
                 in_flight: int = 0) -> None:
        """`in_flight`: requests known to share the pool from the start (0:
        none yet, the share is the whole pool until the first step)."""
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs is >= 1, got {max_num_seqs!r}")
        self.pool_kv_tokens = pool_kv_tokens
        self.checkpoint_kv_tokens = checkpoint_kv_tokens
        self.max_num_seqs = max_num_seqs
        # the most requests in flight at once so far, capped at max_num_seqs
        self.peak = min(max(0, in_flight), max_num_seqs)

    @property
    def tokens(self) -> int:
        """One request slot's share of the pool, in tokens of KV."""
        return self.pool_kv_tokens // max(1, self.peak)

    @property
    def under_line(self) -> bool:
        return slot_under_minimum(self.tokens, self.checkpoint_kv_tokens)

    def observe(self, in_flight: int) -> bool:
        """`in_flight` requests share the pool now: whether the share has
        just shrunk (more requests in flight than ever before)."""
        n = min(in_flight, self.max_num_seqs)
        if n <= self.peak:
            return False
        self.peak = n
        return True

    def line(self) -> int:
        """The fewest requests in flight whose share is under the line
        (0: none up to max_num_seqs): a share of pool // n is under
        MIN_SLOT_CHECKPOINTS checkpoints from n = pool // that + 1."""
        if not self.checkpoint_kv_tokens:
            return 0
        n = self.pool_kv_tokens // (MIN_SLOT_CHECKPOINTS * self.checkpoint_kv_tokens) + 1
        return n if n <= self.max_num_seqs else 0

    def describe(self) -> str:
        """The log's account of the share now: 'N requests in flight: a
        request slot's share of the KV pool (T tokens) holds M checkpoints'
        worth' (', under 32' where it is); before any step, the whole
        pool's."""
        who = (f"{self.peak} request{'s' if self.peak > 1 else ''} in flight: a request "
               f"slot's share of the KV pool" if self.peak else "the whole KV pool")
        text = (f"{who} ({self.tokens:,} tokens) holds "
                f"{pool_checkpoints(self.tokens, self.checkpoint_kv_tokens)} checkpoints' worth")
        return text + (f", under {MIN_SLOT_CHECKPOINTS}" if self.under_line else "")
