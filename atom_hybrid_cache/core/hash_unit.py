"""The prefix-hash unit the plugin asks of vLLM where `--prefix-match-unit`
is unset.

vLLM raises a hybrid model's block to a state page (400-1,600 tokens for
Qwen3.5) and hashes prefixes on it, so a prompt resumes only at a multiple
of it. The plugin asks for a finer unit: a resume then lands at most a
unit short of the previous prompt's end. Each unit boundary is a hash the
scheduler computes, stores and walks, so the unit is the largest divisor
of the blocks up to a limit:

- MAX_HASH_UNIT_TOKENS (64) where a request slot's share of the pool holds
  at least MIN_SLOT_CHECKPOINTS checkpoints' worth (`pool_budget`): there
  a finer unit buys little (the 16-token unit: 0.02 point of hit on all
  shared traces at c8 / 80 GiB) for 3x the hashes and a slower p99 step;
- SMALL_POOL_HASH_UNIT_TOKENS (32) under that line, where what a slot
  keeps cached is short and a unit's rounding is a larger share of each
  resume. On the small-pool sweep (BENCHMARKS.md, "Small pools") it lifts
  the loose cells, where vLLM with `prefix_match_unit=64` is at the paged
  bound and the unit is the only lever: 10 of the 160 check cells below
  the better native -> 2, 0 of the 84 published cells before and after.
  Not with speculative decoding: there, with MTP drafts and ReplaySSM, a
  resume at a 32-token boundary inside a page gave outputs other than
  caching off's (`tests/e2e/test_replayssm_mtp.py`), not yet traced.
"""

from __future__ import annotations

import math
from typing import Sequence

from .pool_budget import slot_under_minimum, under_minimum_reason

MAX_HASH_UNIT_TOKENS = 64
SMALL_POOL_HASH_UNIT_TOKENS = 32


def largest_unit_dividing(block_sizes: Sequence[int], limit: int) -> int:
    """The largest number of tokens, at most `limit`, that divides every
    block size (vLLM's rule): 64 for 128- or 448-token blocks, 50 for 400."""
    g = math.gcd(*block_sizes)
    return max(d for d in range(1, min(limit, g) + 1) if g % d == 0)


def hash_unit_limit(kv_share_tokens: int, checkpoint_kv_tokens: int,
                    speculative: bool = False) -> int:
    """The largest unit the plugin asks for: SMALL_POOL_HASH_UNIT_TOKENS
    where a request slot's share (`kv_share_tokens` of KV) holds fewer than
    MIN_SLOT_CHECKPOINTS checkpoints of `checkpoint_kv_tokens` and the
    engine does not run speculative decoding, else MAX_HASH_UNIT_TOKENS."""
    return (SMALL_POOL_HASH_UNIT_TOKENS
            if not speculative and slot_under_minimum(kv_share_tokens, checkpoint_kv_tokens)
            else MAX_HASH_UNIT_TOKENS)


def plugin_hash_unit(block_sizes: Sequence[int], kv_share_tokens: int,
                     checkpoint_kv_tokens: int, speculative: bool = False) -> int:
    """The unit the plugin asks for blocks of `block_sizes` in this pool
    (it may equal vLLM's own, the blocks' GCD, on small blocks)."""
    return largest_unit_dividing(block_sizes, hash_unit_limit(
        kv_share_tokens, checkpoint_kv_tokens, speculative))


def describe_limit(kv_share_tokens: int, checkpoint_kv_tokens: int,
                   speculative: bool = False) -> str:
    """The start-up log's why: 'at most 32 tokens: a request slot's share
    of the KV pool (...) holds N checkpoints' worth, under 32'."""
    limit = hash_unit_limit(kv_share_tokens, checkpoint_kv_tokens, speculative)
    if limit == MAX_HASH_UNIT_TOKENS:
        under = slot_under_minimum(kv_share_tokens, checkpoint_kv_tokens)
        return f"at most {limit} tokens" + (" (speculative decoding)" if under else "")
    return (f"at most {limit} tokens, not {MAX_HASH_UNIT_TOKENS}: "
            f"{under_minimum_reason(kv_share_tokens, checkpoint_kv_tokens)}")
