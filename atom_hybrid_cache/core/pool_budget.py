"""What a pool can afford: insurance states priced against a request slot's share.

A checkpoint costs the KV of `checkpoint_kv_tokens` tokens (its bytes over
the KV bytes per token). The cold checkpoints' and the floors' states are
insurance, most never read: a live request holds up to two floors and a
conversation's start two cold checkpoints, four states beside its anchor,
each taken from the live prefixes of the requests sharing the pool. They
pay while they stay a small part of what one request slot holds: so they
run where a slot's share of the pool (the pool over the requests in
flight, `slot_share`) holds at least MIN_SLOT_CHECKPOINTS checkpoints'
worth, four states being an eighth of it. The line was a fixed pool of
100 checkpoints' worth; on the small-pool sweep (84 cells, 30 to 1000
checkpoints' worth, 2 to 8 in flight; BENCHMARKS.md, "Small pools") the
slot share turns them off in the 100-checkpoint cells run 4 and 8 in
flight, where they cost up to 3.2 points at 1.0x, and keeps them from 200
up, where they gain.

The floors fade in above the line rather than switch on at it: the pool
share all floors may take rises from none at MIN_SLOT_CHECKPOINTS
checkpoints' worth a slot to all of it (`floor_ledger.FLOOR_MAX_POOL_SHARE`)
FLOOR_FADE_CHECKPOINTS above (`floor_scale`). At a share just above the
line the floors pinned what cut early turns' KV: on the eight other
groupings of the small-pool sweep (BENCHMARKS.md, "Eight other groupings")
the switch left subset 7 at 200 checkpoints' worth, 1.0x (a share of 33),
0.77 point under native; the fade puts it 0.42 above. Fades over 16, 32 and
64 checkpoints' worth were measured: 16 is the best of them on both grids
(+3.296 on the 84 published cells, +3.698 on the 160; no fade +3.296,
+3.682) and keeps the replay's c8 / 30 GiB saturated point (45 a slot),
where a fade over 32 lost 0.5 point.

The retained states (a release takes back one state near each retain
fraction of its prefix, `eviction.refreshed_positions`) are insurance too,
and in the smallest pools the first to crowd out what they insure: a
release keeps its own states (its prompt's page boundary and its
prompt-end copy, RELEASE_OWN_STATES) and one per fraction, so they run
where a slot's share holds that many checkpoints' worth (`affords_retained`:
six at the default four fractions). Under it the retained states took the
pages of the next round's prefixes: the small-pool sweep's pools of 15
checkpoints' worth, 3 in flight, lost 5.5 points to native with them, 0.5
without (BENCHMARKS.md, "The retained states need six checkpoints' worth
a slot").
"""

from __future__ import annotations

# a request slot's share of the pool, in checkpoints' worth, from which the
# insurance states (floors, cold checkpoints: four per slot) are an eighth
MIN_SLOT_CHECKPOINTS = 32
# checkpoints' worth a slot above that over which the floors' pool share
# rises from none to all of it (`floor_scale`)
FLOOR_FADE_CHECKPOINTS = 16
# the states a release keeps of its own beside the retained ones: the
# prompt's page-boundary state and its prompt-end copy
RELEASE_OWN_STATES = 2


def pool_checkpoints(pool_kv_tokens: int, checkpoint_kv_tokens: int) -> int:
    """How many checkpoints' worth of KV `pool_kv_tokens` tokens hold (0
    when a checkpoint's cost is unknown)."""
    return pool_kv_tokens // checkpoint_kv_tokens if checkpoint_kv_tokens else 0


def slot_under_minimum(kv_share_tokens: int, checkpoint_kv_tokens: int) -> bool:
    """Whether one request slot's share of the pool (`kv_share_tokens` of
    KV) holds fewer than MIN_SLOT_CHECKPOINTS checkpoints of
    `checkpoint_kv_tokens` (0: unknown, never under)."""
    return bool(checkpoint_kv_tokens) and (
        kv_share_tokens < MIN_SLOT_CHECKPOINTS * checkpoint_kv_tokens)


def past_line(kv_share_tokens: int, checkpoint_kv_tokens: int, width: float) -> float:
    """How far past the line a request slot's share (`kv_share_tokens` of
    KV) stands, 0 to 1: 0 where it holds at most MIN_SLOT_CHECKPOINTS
    checkpoints of `checkpoint_kv_tokens`, 1 from `width` more, linear
    between (1 when a checkpoint's cost is unknown). The fades above the
    line (the floors', priced eviction's) run on it."""
    if not checkpoint_kv_tokens:
        return 1.0
    above = kv_share_tokens / checkpoint_kv_tokens - MIN_SLOT_CHECKPOINTS
    return min(1.0, max(0.0, above / width))


def floor_scale(kv_share_tokens: int, checkpoint_kv_tokens: int) -> float:
    """How much of their pool share the floors may take, 0 to 1: none at the
    line, all of it FLOOR_FADE_CHECKPOINTS above (`past_line`)."""
    return past_line(kv_share_tokens, checkpoint_kv_tokens, FLOOR_FADE_CHECKPOINTS)


def affords_retained(kv_share_tokens: int, checkpoint_kv_tokens: int, retained: int) -> bool:
    """Whether a request slot's share (`kv_share_tokens` of KV) holds a
    release's own states and `retained` more, a checkpoint of
    `checkpoint_kv_tokens` each (always, where that cost is unknown)."""
    return (not checkpoint_kv_tokens
            or kv_share_tokens >= (RELEASE_OWN_STATES + retained) * checkpoint_kv_tokens)
