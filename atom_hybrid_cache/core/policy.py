"""The checkpoint policy of one pool: the placement settings made to fit it.

The replay's manager and the vLLM adapter's planner both build one and ask
it where an admitted prompt leaves checkpoints, so the rule is the same
code in both: the interval snapped to the block, cold checkpoints the pool
cannot afford dropped (`pool_budget`), the request's share of the pool.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..config import PlacementConfig
from .placement import CheckpointTargets, plan_checkpoints, snap_interval
from .pool_budget import drop_unaffordable
from .priced_eviction import resolved_weight


class CheckpointPolicy:
    def __init__(self, placement: PlacementConfig, *, block_size: int, kv_share_tokens: int,
                 pool_kv_tokens: int, checkpoint_kv_tokens: int = 0, successor_room: int = 1,
                 floor_fractions: tuple = (), warn: Callable[[str], None] = lambda msg: None,
                 budget_warn: Callable[[str], None] = None) -> None:
        """`kv_share_tokens`: one request slot's share of the KV pool;
        `pool_kv_tokens`: the whole pool's KV tokens; `checkpoint_kv_tokens`:
        how many tokens of KV one checkpoint's bytes would hold (0:
        unknown); `floor_fractions`: the server's floor states, dropped
        with the cold checkpoints where a slot's share cannot afford them
        (`self.floor_fractions`). `warn` says what was snapped or dropped
        (`budget_warn`, if given, what was dropped)."""
        self.interval = snap_interval(placement.interval_tokens, block_size, warn)
        self.placement, self.floor_fractions = drop_unaffordable(
            placement, floor_fractions, kv_share_tokens, checkpoint_kv_tokens, budget_warn or warn)
        self.block_size = block_size
        self.kv_share_tokens = kv_share_tokens
        self.pool_kv_tokens = pool_kv_tokens
        self.checkpoint_kv_tokens = checkpoint_kv_tokens
        self.successor_room = successor_room
        self.checkpointing = self.interval != 0
        self.reuse_aware = placement.eviction == "reuse-aware"
        # ATOM_EVICTION_PRICE_WEIGHT resolved for this pool (auto: priced
        # where a slot's share is small); only a release in units prices
        self.placement = dataclasses.replace(self.placement, eviction_price_weight=resolved_weight(
            placement.eviction_price_weight, kv_share_tokens, checkpoint_kv_tokens)
            if self.reuse_aware else 0.0)

    @property
    def eviction_price_weight(self) -> float:
        return self.placement.eviction_price_weight

    def plan(self, prompt_len: int, *, hit: int, kv_reach: int,
             reusable: int) -> CheckpointTargets:
        """The checkpoints one admitted prompt should leave (none when
        checkpointing is off); lengths in tokens, block multiples."""
        if not self.checkpointing:
            return CheckpointTargets()
        return plan_checkpoints(
            prompt_len, self.block_size, hit=hit, kv_reach=kv_reach, reusable=reusable,
            kv_share_tokens=self.kv_share_tokens, placement=self.placement,
            successor_room=self.successor_room, interval=self.interval,
            checkpoint_kv_tokens=self.checkpoint_kv_tokens)
