"""The checkpoint policy of one pool: the placement settings made to fit it.

The replay's manager and the vLLM adapter's planner both build one and ask
it where an admitted prompt leaves checkpoints, so the rule is the same
code in both: the interval snapped to the block, and what a request slot's
share of the pool (`slot_share`) affords: the cold checkpoints and floors
where it holds enough (`pool_budget`; the floors' pool share fading in
above the line, the release's refreshed states spaced out fading as
they do), priced eviction where it does not, fallback rungs under the
share.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..config import PlacementConfig
from .floor_ledger import FLOOR_MAX_POOL_SHARE
from .placement import CheckpointTargets, plan_checkpoints, snap_interval
from .pool_budget import (FLOOR_FADE_CHECKPOINTS, MIN_SLOT_CHECKPOINTS, RELEASE_OWN_STATES,
                          affords_retained, floor_scale, pool_checkpoints)
from .priced_eviction import PRICE_FADE_END_CHECKPOINTS, resolved_weight
from .slot_share import SlotShare


class CheckpointPolicy:
    def __init__(self, placement: PlacementConfig, *, block_size: int, share: SlotShare,
                 successor_room: int = 1, floor_fractions: tuple = (),
                 warn: Callable[[str], None] = lambda msg: None,
                 budget_warn: Callable[[str], None] = None) -> None:
        """`share`: a request slot's share of the KV pool, which the
        scheduler's steps update (`observe_in_flight`); `floor_fractions`:
        the server's floor states, held with the cold checkpoints while the
        share affords them (`self.floor_fractions`). `warn` says what was
        snapped or dropped (`budget_warn`, if given, what was dropped)."""
        self.interval = snap_interval(placement.interval_tokens, block_size, warn)
        self.configured = placement
        self.configured_floor_fractions = tuple(floor_fractions)
        self.share = share
        self.block_size = block_size
        self.successor_room = successor_room
        self.checkpointing = self.interval != 0
        self.reuse_aware = placement.eviction == "reuse-aware"
        self._budget_warn = budget_warn or warn
        self._fit()
        if share.under_line:
            self._say_dropped(share.describe())

    pool_kv_tokens = property(lambda self: self.share.pool_kv_tokens)
    checkpoint_kv_tokens = property(lambda self: self.share.checkpoint_kv_tokens)
    kv_share_tokens = property(lambda self: self.share.tokens)

    def _fit(self) -> None:
        """`placement` and `floor_fractions` for the share now: the cold
        checkpoints off under the line, the floors sized (`_size_floors`),
        ATOM_EVICTION_PRICE_WEIGHT resolved (auto: priced under the line;
        only a release in units prices)."""
        under = self.share.under_line
        placement = self.configured
        if under:
            placement = dataclasses.replace(placement, cold_fractions=())
        weight = resolved_weight(placement.eviction_price_weight, self.share.tokens,
                                 self.share.checkpoint_kv_tokens) if self.reuse_aware else 0.0
        self.placement = dataclasses.replace(placement, eviction_price_weight=weight)
        self._size_floors()

    def _size_floors(self) -> None:
        # the floors' pool share at the share now; where it holds no whole
        # checkpoint they are off (not looked up and refused at every request)
        share = self.share
        self._sized_under = share.under_line
        self.floor_scale = floor_scale(share.tokens, share.checkpoint_kv_tokens)
        room = (pool_checkpoints(share.pool_kv_tokens, share.checkpoint_kv_tokens)
                * FLOOR_MAX_POOL_SHARE * self.floor_scale)
        on = room >= 1 or not share.checkpoint_kv_tokens
        self.floor_fractions = self.configured_floor_fractions if on else ()

    def floor_max_pages(self, num_pages: int) -> int:
        """What all floors together may hold in a pool of `num_pages` pages
        at the share now (`pool_budget.floor_scale` of FLOOR_MAX_POOL_SHARE)."""
        return int(num_pages * FLOOR_MAX_POOL_SHARE * self.floor_scale)

    @property
    def refresh_spacing_tokens(self) -> int:
        """How far apart the older states a release takes back stand
        (`eviction.spaced_refreshed`): a checkpoint's KV at a share at or
        under the line, fading to none as the floors fade in above it
        (`floor_scale`; none where a checkpoint's cost is unknown)."""
        return int(self.checkpoint_kv_tokens * (1.0 - self.floor_scale))

    @property
    def retain_fractions(self) -> tuple:
        """The fractions at which a release takes back older states of its
        prefix (`eviction.refreshed_positions`): the configured ones where
        a request slot's share holds them beside the release's own states
        (`pool_budget.affords_retained`), none under that."""
        fractions = self.placement.retain_fractions
        if affords_retained(self.share.tokens, self.share.checkpoint_kv_tokens, len(fractions)):
            return fractions
        return ()

    @property
    def floor_ledger_fractions(self) -> tuple:
        """The floor fractions a server keeps a ledger for: the configured
        ones where the release is reuse-aware and some number of requests in
        flight leaves a share above the line (the floors are held only while
        `floor_fractions` is non-empty); () where no share ever affords them."""
        if not self.reuse_aware or self.share.line() == 1:
            return ()
        return self.configured_floor_fractions

    def _say_dropped(self, why: str) -> None:
        dropped = [name for name, on in (("cold checkpoints", self.configured.cold_fractions),
                                         ("floor states", self.configured_floor_fractions)) if on]
        if dropped:
            self._budget_warn(f"{' and '.join(dropped)} off: {why}")

    def observe_in_flight(self, in_flight: int) -> bool:
        """Before a scheduler step, `in_flight` requests (running and
        waiting) share the pool: whether what the share sizes changed (the
        floors' pool share, `floor_max_pages`, and auto's price weight as
        the share shrinks toward the line; the placement, floors and price
        weight where it just fell under the line, which the log says
        once)."""
        if not self.share.observe(in_flight):
            return False
        # (what the last sizing saw: nothing more on the steps that change nothing)
        was_under, was_scale = self._sized_under, self.floor_scale
        if self.share.under_line and not was_under:
            self._fit()
            self._say_dropped(self.share.describe())
            return True
        self._size_floors()
        return self._refit_weight() or self.floor_scale != was_scale

    def _refit_weight(self) -> bool:
        # auto's weight fades out above the line (`priced_eviction`): the
        # steps that move the share within the fade move it
        if not self.reuse_aware:
            return False
        weight = resolved_weight(self.configured.eviction_price_weight, self.share.tokens,
                                 self.share.checkpoint_kv_tokens)
        if weight == self.placement.eviction_price_weight:
            return False
        self.placement = dataclasses.replace(self.placement, eviction_price_weight=weight)
        return True

    def describe_share(self) -> str:
        """The start-up log's account of what follows the requests in
        flight."""
        line, top = self.share.line(), self.share.max_num_seqs
        head = ("a request slot's share of the KV pool is the pool over the most requests in "
                f"flight at once (at most max_num_seqs={top})")
        # what follows a slot's share besides the cold checkpoints and floors
        also = (f"; where ATOM_EVICTION_PRICE_WEIGHT is auto, eviction priced under "
                f"{PRICE_FADE_END_CHECKPOINTS} checkpoints' worth a request, in full from "
                f"{MIN_SLOT_CHECKPOINTS} down")
        retained = len(self.configured.retain_fractions)
        if retained:
            also += (f"; a release's retained states (one per retain fraction) where a share "
                     f"holds {RELEASE_OWN_STATES + retained} checkpoints' worth")
        if line == 1:
            return f"{head}: under {MIN_SLOT_CHECKPOINTS} checkpoints' worth at any number{also}"
        if not line:
            return (f"{head}: at least {MIN_SLOT_CHECKPOINTS} checkpoints' worth up to "
                    f"{top}, cold checkpoints and floor states stay on{also}")
        return (f"{head}: cold checkpoints and floor states on up to {line - 1} in flight "
                f"(the floors' pool share shrinking and a release's refreshed states "
                f"spaced out under "
                f"{MIN_SLOT_CHECKPOINTS + FLOOR_FADE_CHECKPOINTS} checkpoints' worth a "
                f"request); from {line} (a share under "
                f"{MIN_SLOT_CHECKPOINTS} checkpoints' worth) off{also}")

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
