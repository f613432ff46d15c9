"""The price of a prompt-end state inside a page (core/tail_price.py) and
the planner's use of it."""

from __future__ import annotations

import pytest

from atom_hybrid_cache.config import PlacementConfig
from atom_hybrid_cache.core.planner import CheckpointPlanner
from atom_hybrid_cache.core.policy import CheckpointPolicy
from atom_hybrid_cache.core.slot_share import SlotShare
from atom_hybrid_cache.core.tail_price import KVCutRate, keeps_partial_tail


def test_the_cut_rate_is_the_cut_share_of_reusable_tokens_over_its_window():
    rate = KVCutRate(window=3)
    assert rate.rate == 0.0
    rate.record(1000, 1000)          # nothing cut
    rate.record(1000, 600)           # 400 cut
    assert rate.rate == 400 / 2000
    rate.record(0, 0)                # a cold prompt: nothing to cut
    rate.record(2000, 2000)          # the first admission leaves the window
    assert rate.rate == 400 / 3000
    rate.record(500, 0)
    rate.record(500, 500)            # the 400 leaves
    assert rate.rate == 500 / 3000


def test_a_kv_reach_beyond_the_oracle_counts_no_cut():
    rate = KVCutRate()
    rate.record(100, 300)
    assert rate.rate == 0.0


@pytest.mark.parametrize("gain, rate, kept", [
    (64, 0.0, True),
    (64, 0.124, True),       # 64 > 0.124 x 512 = 63.5
    (64, 0.126, False),      # 64 < 64.5
    (1, 0.001, True),
    (1, 0.002, False),       # 1 < 1.024
])
def test_an_inner_state_pays_while_its_gain_exceeds_its_pages_at_the_cut_rate(gain, rate, kept):
    # a checkpoint: 3 pages of 128 tokens of KV; the partial page: 128
    assert keeps_partial_tail(gain, 384, 128, rate) is kept


def _planner(block=128, groups=3):
    policy = CheckpointPolicy(PlacementConfig(), block_size=block,
                              share=SlotShare(40_000, groups * block, 4, in_flight=4))
    return CheckpointPlanner(policy, hash_unit=64, stats_log_interval=0)


def test_the_planner_prices_prompt_ends_by_the_admissions_it_saw():
    planner = _planner()
    hashes = list(range(1, 40))
    for rid, reach in (("a", 2048), ("b", 1024)):
        planner.plan(rid, 2500, hashes, hit=0, kv_reach=reach)
    # no admission yet: rate 0, the inner state is kept
    assert planner.keeps_prompt_end(2496)
    planner.plan("c", 2500, hashes, hit=0, kv_reach=0)
    planner.oracle.learn(hashes)     # "c" could have reused 38 units = 2,432 tokens
    planner.plan("c", 2500, hashes, hit=0, kv_reach=0)
    planner.admitted("c", 0)
    assert planner.kv_cuts.rate == 1.0
    assert not planner.keeps_prompt_end(2496)          # 64 tokens in: not worth 512
    assert not planner.keeps_prompt_end(2368)
    assert planner.keeps_prompt_end(2304)              # on a page boundary: always
    assert planner.stats.partial_tails_dropped == 2


def test_the_start_up_line_states_the_rule_for_the_pool():
    from atom_hybrid_cache.core.tail_price import describe_price

    assert describe_price(1344, 448, 64) == (
        "a prompt-end state g tokens into a 448-token page is kept while the KV pool cuts "
        "under g/1792 of reusable prefixes (64: 3.6%, 384: 21.4%; its checkpoint holds 1344 "
        "tokens of KV and its partial page 448)")
    assert describe_price(384, 128, 128) == ""
