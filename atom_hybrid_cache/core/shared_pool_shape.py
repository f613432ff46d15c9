"""The pool the planner's model of the plugin runs on (`shared_pool_manager`):
vLLM's page pool as the plugin sees it, vLLM's align-mode split of a
prefill over its pages, and the checkpoint policy the plugin sizes for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import PlacementConfig
from .kinds import CheckpointKind
from .policy import CheckpointPolicy
from .slot_share import SlotShare


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
    # speculative decoding with 1 + k working states (vLLM's align mode,
    # `num_speculative_blocks`): the k scratch pages a running request holds
    # in each state group from its first chunk to its release (0: no
    # speculation, or ReplaySSM's one state a request)
    speculative_state_pages: int = 0

    def __post_init__(self) -> None:
        if self.page_tokens % self.hash_unit:
            raise ValueError(f"page of {self.page_tokens} tokens is not a multiple of the "
                             f"hash unit {self.hash_unit}")

    def vllm_positions(self, L: int, hit: int, junction: int) -> dict:
        """Position -> kind of the states vLLM's own split keeps past `hit`
        in a prompt of `L` tokens: the last page boundary and hash-unit
        boundary before its last token, and the `junction`."""
        P, U = self.page_tokens, self.hash_unit
        end = L - self.successor_room
        return {pos: kind for pos, kind in ((junction, CheckpointKind.JUNCTION),
                                            (end // U * U, CheckpointKind.ANCHOR),
                                            (end // P * P, CheckpointKind.ANCHOR))
                if pos > hit}

    def chunk(self, start: int, L: int, budget: int, keep) -> int:
        """vLLM's align-mode split (`_mamba_block_aligned_split`) of a
        prompt of `L` tokens computed to `start`, at most `budget` tokens:
        whole pages unless it ends the prompt, stopping at the next page
        boundary and at every kept position (`keep`; the plugin's among
        them, as its `chunk_stop` cuts them)."""
        P = self.page_tokens
        end = min(L, start + budget)
        if end < L:
            aligned = end // P * P
            if aligned > start or not self.step_tokens or P <= self.step_tokens:
                end = aligned
        stops = [p for p in keep if start < p < end]
        if start % P and (start // P + 1) * P < end:
            stops.append((start // P + 1) * P)
        return max(0, (min(stops) if stops else end) - start)


def shared_pool_policy(shape: SharedPoolShape, placement: PlacementConfig,
                       floor_fractions: tuple = (), warn=lambda msg: None,
                       in_flight: int = 0) -> CheckpointPolicy:
    """The plugin's policy for this pool, sized as `vllm/scheduler_setup.py`
    sizes it from vLLM's groups (one attention group); `in_flight`: the
    requests already known to share it (0: none before the first step)."""
    pool_tokens = (shape.num_pages - 1) * shape.page_tokens
    share = SlotShare(pool_tokens, shape.pages_per_state * shape.page_tokens,
                      shape.max_num_seqs, in_flight)
    return CheckpointPolicy(placement, block_size=shape.page_tokens, share=share,
                            floor_fractions=floor_fractions, warn=warn, budget_warn=warn)
