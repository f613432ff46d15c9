"""The manager of our Gated DeltaNet state groups inside vLLM.

vLLM's MambaManager (align mode) keeps the bookkeeping that must not change:
which block-table column holds which state, the copy of a resumed state into
the running column, speculative columns, copy-on-write of partial tails. What
it retains is where we differ: besides vLLM's prompt-end state and
shared-prefix junction, the checkpoints our planner placed (cut backoffs,
fallback rungs, insurance, ladder), whose chunk stops `AtomScheduler` made.
The prefix match itself stays vLLM's: the longest prefix ending at a state
every group still indexes, which is exactly the core's rule.
"""

from __future__ import annotations

from typing import Optional, Sequence

from vllm.v1.core.single_type_kv_cache_manager import MambaManager

from .planner import CheckpointPlanner


class AtomStateManager(MambaManager):
    def __init__(self, kv_cache_spec, block_pool, **kwargs) -> None:
        super().__init__(kv_cache_spec, block_pool, **kwargs)
        # Attached by AtomScheduler; without it (another scheduler class)
        # this manager behaves exactly like vLLM's.
        self.planner: Optional[CheckpointPlanner] = None

    def cache_blocks(self, request, num_tokens: int, retention_interval: Optional[int] = None, *,
                     replay_boundaries: Sequence[int]) -> None:
        if self.planner is not None and retention_interval is not None:
            extra = self.planner.retained_positions(request.request_id)
            if extra:
                replay_boundaries = (*replay_boundaries, *extra)
        super().cache_blocks(request, num_tokens, retention_interval,
                             replay_boundaries=replay_boundaries)
