"""The replay planner's own pools (`core/manager.py`): KV blocks and state
slots apart, sized from a model's geometry and a memory budget.

Not an `ATOM_*` setting (those are `config.py`): the replay derives these
from its model and memory arguments; only the checkpoint-only slots follow
`ATOM_STATE_CHECKPOINT_SLOTS`, and the placement is the core's policy
(`config.PlacementConfig`). Bad values raise `ConfigError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..config import ConfigError, PlacementConfig, check_non_negative, check_positive

# Checkpoint-only slots per request slot in the replay planner when
# ATOM_STATE_CHECKPOINT_SLOTS is unset: room for each conversation's anchor,
# its insurance, branch points and the anchors of a few turns back.
DEFAULT_HEADROOM_PER_SEQ = 8


@dataclass(frozen=True)
class ReplayPoolConfig:
    """The replay planner's pools: KV blocks and state slots apart."""

    block_size: int = 16
    num_kv_blocks: int = 1024
    max_num_seqs: int = 8
    num_spec: int = 0
    # on top of max_num_seqs * (1 + num_spec); None: DEFAULT_HEADROOM_PER_SEQ each
    state_checkpoint_slots: Optional[int] = None
    successor_room: int = 1
    # KV tokens one checkpoint's bytes would hold (0: unknown; core/pool_budget.py)
    checkpoint_kv_tokens: int = 0
    interior_states_readable: bool = False
    stats_log_interval: int = 0
    strict_stats: bool = False      # raise on a stats nesting violation
    # a free state at every block: attention-only with this KV (the ceiling)
    kv_only_ceiling: bool = False
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    @property
    def live_slots(self) -> int:
        return self.max_num_seqs * (1 + self.num_spec)

    @property
    def num_state_slots(self) -> int:
        return self.live_slots + self.state_checkpoint_slots

    def __post_init__(self) -> None:
        if self.state_checkpoint_slots is None and isinstance(self.max_num_seqs, int):
            object.__setattr__(self, "state_checkpoint_slots",
                               DEFAULT_HEADROOM_PER_SEQ * self.max_num_seqs)
        check_positive("block_size", self.block_size)
        if self.num_kv_blocks < 2:
            raise ConfigError("num_kv_blocks must be >= 2 (block 0 is the null block), "
                              f"got {self.num_kv_blocks}")
        check_positive("max_num_seqs", self.max_num_seqs)
        check_non_negative("num_spec", self.num_spec)
        check_non_negative("state_checkpoint_slots", self.state_checkpoint_slots)
        check_positive("successor_room", self.successor_room)
        check_non_negative("checkpoint_kv_tokens", self.checkpoint_kv_tokens)
        check_non_negative("stats_log_interval", self.stats_log_interval)
