"""The pool's size counted in checkpoints, and what a small pool goes without.

A checkpoint costs the KV of `checkpoint_kv_tokens` tokens (its bytes over
the KV bytes per token). The cold checkpoints' and the floors' states are
insurance, most never read, and each takes its pages from the live
prefixes; the admission gate holds requests to protect prefixes. On the
measured pools of 21 and 30 checkpoints' worth the ladder cost a fifth to a
third of their hits and the gate 7% and 18%; from 150 up (every other
workload measured) both gained. So a pool under MIN_POOL_CHECKPOINTS runs
without them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

MIN_POOL_CHECKPOINTS = 100


def pool_checkpoints(pool_kv_tokens: int, checkpoint_kv_tokens: int) -> int:
    """How many checkpoints' worth of KV the pool holds (0 when a
    checkpoint's cost is unknown)."""
    return pool_kv_tokens // checkpoint_kv_tokens if checkpoint_kv_tokens else 0


def pool_under_minimum(pool_kv_tokens: int, checkpoint_kv_tokens: int) -> bool:
    """Whether a pool of `pool_kv_tokens` tokens of KV holds fewer than
    MIN_POOL_CHECKPOINTS checkpoints of `checkpoint_kv_tokens` (0: unknown,
    never under)."""
    return bool(checkpoint_kv_tokens) and (
        pool_kv_tokens < MIN_POOL_CHECKPOINTS * checkpoint_kv_tokens)


def under_minimum_reason(pool_kv_tokens: int, checkpoint_kv_tokens: int) -> str:
    """The log's reason for going without: 'the KV pool (N tokens) holds
    M checkpoints' worth, under 100'."""
    return (f"the KV pool ({pool_kv_tokens:,} tokens) holds "
            f"{pool_checkpoints(pool_kv_tokens, checkpoint_kv_tokens)} checkpoints' worth, "
            f"under {MIN_POOL_CHECKPOINTS}")


def affordable_cold_fractions(fractions: tuple, pool_kv_tokens: int,
                              checkpoint_kv_tokens: int) -> tuple:
    """`fractions`, or () where the pool is under the minimum."""
    return () if pool_under_minimum(pool_kv_tokens, checkpoint_kv_tokens) else fractions


def drop_unaffordable(placement, floor_fractions: tuple, pool_kv_tokens: int,
                      checkpoint_kv_tokens: int, warn: Callable[[str], None]):
    """(`placement`, `floor_fractions`) without the cold checkpoints and the floor
    states where the pool cannot afford them, saying so through `warn`."""
    dropped = [name for name, fractions in (("cold checkpoints", placement.cold_fractions),
                                            ("floor states", floor_fractions))
               if fractions and not affordable_cold_fractions(fractions, pool_kv_tokens,
                                                              checkpoint_kv_tokens)]
    if not dropped:
        return placement, floor_fractions
    warn(f"{' and '.join(dropped)} off: "
         f"{under_minimum_reason(pool_kv_tokens, checkpoint_kv_tokens)}")
    return dataclasses.replace(placement, cold_fractions=()), ()
