"""The prefix-hash unit the plugin asks of vLLM (`core/hash_unit.py`): the
largest divisor of the blocks up to 64 tokens, 32 where a request slot's
share of the pool is under 32 checkpoints' worth."""

import pytest

from atom_hybrid_cache.core.hash_unit import (describe_limit, hash_unit_limit,
                                              largest_unit_dividing, plugin_hash_unit)
from atom_hybrid_cache.core.pool_budget import vllm_pool_shares
from atom_hybrid_cache.core.shared_pool_shape import default_hash_unit

CHECKPOINT = 3 * 128          # three state pages of 128 tokens


@pytest.mark.parametrize("slot_checkpoints, limit", [(31, 32), (32, 64), (200, 64)])
def test_the_limit_halves_under_32_checkpoints_a_slot(slot_checkpoints, limit):
    assert hash_unit_limit(slot_checkpoints * CHECKPOINT, CHECKPOINT) == limit
    # one token under the line is under it
    assert hash_unit_limit(32 * CHECKPOINT - 1, CHECKPOINT) == 32


def test_unknown_checkpoint_cost_keeps_64():
    assert hash_unit_limit(10, 0) == 64


@pytest.mark.parametrize("blocks, small, large", [
    ([128], 32, 64), ([640], 32, 64), ([400], 25, 50), ([448], 32, 64),
    ([1072], 16, 16), ([48], 24, 48), ([32], 32, 32)])
def test_the_unit_divides_the_blocks(blocks, small, large):
    assert plugin_hash_unit(blocks, 10 * CHECKPOINT, CHECKPOINT) == small
    assert plugin_hash_unit(blocks, 40 * CHECKPOINT, CHECKPOINT) == large
    assert largest_unit_dividing(blocks, 64) == large


def test_vllm_pool_shares_count_the_null_block_and_the_groups():
    # 101 blocks of 128 tokens (one null), 4 in flight, 3 state groups, 1 KV group
    assert vllm_pool_shares(101, 128, 4, 3, 1) == (3200, 12800, 384)
    # two attention groups: a block of KV holds a page of each
    assert vllm_pool_shares(101, 128, 4, 3, 2) == (3200, 6400, 192)


def test_the_planner_picks_the_plugins_unit():
    """The sweep cells' pools: 50 checkpoints' worth (150 pages + null) 2 in
    flight is 25 a slot; 200 checkpoints' worth 4 in flight is 50."""
    assert default_hash_unit(151, 128, 3, 2) == 32
    assert default_hash_unit(601, 128, 3, 4) == 64
    assert default_hash_unit(601, 128, 3, 6) == 64     # 33 a slot
    assert default_hash_unit(601, 128, 3, 7) == 32     # 28 a slot


def test_the_log_says_why():
    assert describe_limit(40 * CHECKPOINT, CHECKPOINT) == "at most 64 tokens"
    assert describe_limit(10 * CHECKPOINT, CHECKPOINT) == (
        "at most 32 tokens, not 64: a request slot's share of the KV pool (3,840 tokens) "
        "holds 10 checkpoints' worth, under 32")


def test_a_small_pools_release_takes_back_the_page_boundary_under_its_hit():
    """With the 32-token unit a hit sits inside a page more often; a client
    rewriting that page's tail resumes at the page boundary under it, so
    under the line the release refreshes that state too (fails without the
    rule: [1440, ...] only)."""
    from atom_hybrid_cache.config import PlacementConfig
    from atom_hybrid_cache.core.eviction import refreshed_positions
    from atom_hybrid_cache.core.policy import CheckpointPolicy

    def policy(slot_checkpoints):
        return CheckpointPolicy(PlacementConfig(retain_fractions=(0.5,)), block_size=128,
                                kv_share_tokens=slot_checkpoints * CHECKPOINT,
                                pool_kv_tokens=4 * slot_checkpoints * CHECKPOINT,
                                checkpoint_kv_tokens=CHECKPOINT)
    assert policy(25).refreshed_positions(1440, 1574) == [1440, 1408, 787]
    assert policy(32).refreshed_positions(1440, 1574) == [1440, 787]
    # a hit on a page boundary, or inside the first page: nothing more
    assert policy(25).refreshed_positions(1408, 1574) == [1408, 787]
    assert policy(25).refreshed_positions(96, 200) == [96, 100]
    assert refreshed_positions(0, 200, (0.5,), 128) == [100]


def test_speculative_decoding_keeps_64():
    assert hash_unit_limit(10 * CHECKPOINT, CHECKPOINT, speculative=True) == 64
    assert plugin_hash_unit([400], 10 * CHECKPOINT, CHECKPOINT, speculative=True) == 50
    assert describe_limit(10 * CHECKPOINT, CHECKPOINT, True) == (
        "at most 64 tokens (speculative decoding)")
