"""placement: interval snapping, rungs, the anchor formula, chunk cuts."""

import pytest

from atom_hybrid_cache.core.placement import (CheckpointTargets, anchor_position, chunk_end,
                                              is_rung, ladder_positions, resume_cap_blocks,
                                              snap_interval)


def _snap(interval, block):
    warnings = []
    return snap_interval(interval, block, warnings.append), warnings


# -- snap_interval ------------------------------------------------------

@pytest.mark.parametrize("interval", [-1, 0])
def test_snap_special_values_returned_as_is(interval):
    assert _snap(interval, 64) == (interval, [])
    assert _snap(interval, 3) == (interval, [])


def test_snap_multiple_unchanged_without_warning():
    assert _snap(8192, 64) == (8192, [])
    assert _snap(64, 64) == (64, [])


def test_snap_down_to_block_multiple_warns():
    got, warnings = _snap(100, 64)
    assert got == 64
    assert len(warnings) == 1
    assert "100" in warnings[0] and "64" in warnings[0]
    assert "OFF" not in warnings[0]


def test_snap_below_block_turns_off_and_says_so():
    got, warnings = _snap(40, 64)
    assert got == 0
    assert len(warnings) == 1
    assert "OFF" in warnings[0] and "40" in warnings[0]


@pytest.mark.parametrize("interval", [-2, -64, -100])
def test_snap_below_minus_one_raises_naming_the_setting(interval):
    with pytest.raises(ValueError, match="state_checkpoint_interval_tokens"):
        snap_interval(interval, 64)


# -- rungs ----------------------------------------------------------------

def test_is_rung_never_true_without_a_ladder():
    for pos in range(0, 300):
        assert not is_rung(pos, -1)  # pos % -1 == 0 for every pos
        assert not is_rung(pos, 0)


def test_is_rung_on_a_ladder():
    assert [p for p in range(0, 200) if is_rung(p, 64)] == [64, 128, 192]
    assert not is_rung(0, 64)


def test_ladder_positions():
    assert ladder_positions(0, 1000, -1) == []
    assert ladder_positions(0, 1000, 0) == []
    assert ladder_positions(0, 200, 64) == [64, 128, 192]
    assert ladder_positions(64, 192, 64) == [128, 192]   # above lo, at most hi
    assert ladder_positions(63, 191, 64) == [64, 128]
    assert ladder_positions(10, 5, 64) == []
    assert ladder_positions(64, 64, 64) == []


# -- anchor ----------------------------------------------------------------

def _formula(L, B, room, margin):
    return max(0, (L - room - margin) // B * B)


@pytest.mark.parametrize("L,B,room,margin,expected", [
    (16, 4, 1, 1, 12),     # L % B == 0
    (17, 4, 1, 1, 12),     # L % B == 1
    (18, 4, 1, 1, 16),
    (19, 4, 1, 1, 16),
    (16, 4, 1, 0, 12),     # L % B == 0: never the whole prompt
    (17, 4, 1, 0, 16),     # L % B == 1
    (8192, 64, 1, 1, 8128),
    (8193, 64, 1, 1, 8128),
    (8194, 64, 1, 1, 8192),
    (40, 8, 3, 2, 32),
    (45, 8, 3, 2, 40),
    (2, 4, 1, 1, 0),
    (1, 4, 1, 1, 0),       # never negative
    (0, 4, 1, 1, 0),
])
def test_anchor_position_formula(L, B, room, margin, expected):
    assert anchor_position(L, B, room, margin) == expected
    assert expected == _formula(L, B, room, margin)
    assert expected % B == 0 and expected < max(L, 1)


def test_resume_cap_blocks_leaves_the_successor_room():
    assert resume_cap_blocks(16, 4, 1) == 3
    assert resume_cap_blocks(17, 4, 1) == 4
    assert resume_cap_blocks(17, 4, 2) == 3
    assert resume_cap_blocks(1, 4, 1) == 0


# -- targets and chunk cuts -------------------------------------------------

def _targets(**kinds_at):
    t = CheckpointTargets()
    for kind, positions in kinds_at.items():
        for p in positions:
            t.add(p, kind)
    return t


def test_chunk_ends_on_earliest_target_inside_the_chunk():
    t = CheckpointTargets()
    t.add(48, "ladder")
    t.add(32, "anchor")
    assert chunk_end(0, 64, 100, t, False) == (32, "anchor")
    assert chunk_end(32, 64, 100, t, False) == (48, "ladder")
    assert chunk_end(48, 64, 100, t, False) == (100, None)


def test_chunk_not_cut_when_interior_readable():
    t = _targets(anchor=[32], ladder=[48])
    assert chunk_end(0, 64, 100, t, True) == (64, None)
    assert chunk_end(64, 64, 100, t, True) == (100, None)


def test_target_exactly_at_chunk_end_is_not_a_cut():
    t = _targets(anchor=[64])
    assert chunk_end(0, 64, 200, t, False) == (64, None)
    t = _targets(anchor=[100])
    assert chunk_end(0, 128, 100, t, False) == (100, None)  # end bounded by total


def test_targets_outside_the_chunk_do_not_cut():
    t = _targets(anchor=[16, 200])
    assert chunk_end(16, 64, 300, t, False) == (80, None)   # 16 is not inside (16, 80]
    assert chunk_end(0, 64, 50, t, False) == (16, "anchor")


def test_checkpoint_targets_add_and_pop_through_order():
    t = CheckpointTargets()
    t.add(48, "ladder")
    t.add(16, "anchor")
    t.add(32, "demand")
    t.add(16, "cut")   # already pending: first kind stays
    t.add(0, "ladder")  # not a position
    t.add(-4, "ladder")
    assert len(t) == 3
    assert t.earliest_in(16, 48) == 32   # lo excluded
    assert t.earliest_in(0, 15) is None
    assert t.earliest_in(0, 16) == 16    # hi included
    assert t.pop_through(40) == [(16, "anchor"), (32, "demand")]
    assert len(t) == 1
    assert t.pop_through(40) == []
    assert t.pop_through(48) == [(48, "ladder")]
    assert len(t) == 0 and t.kinds == {}


# -- cold-prompt checkpoints ----------------------------------------------

def _cold_targets(L, hit, checkpoint_kv_tokens=0, **placement):
    from atom_hybrid_cache.config import PlacementConfig
    from atom_hybrid_cache.core.placement import plan_checkpoints

    t = plan_checkpoints(L, 32, hit=hit, kv_reach=hit, reusable=hit, kv_share_tokens=1 << 20,
                         placement=PlacementConfig(**placement), successor_room=1, interval=-1,
                         checkpoint_kv_tokens=checkpoint_kv_tokens)
    return dict(t.kinds)


def test_a_cold_prompt_keeps_a_checkpoint_at_each_cold_fraction():
    # a conversation's first prompt, 2,408 tokens: 0.875 of it is 2,107,
    # floored to the 32-token block; the anchor sits at the last block
    assert _cold_targets(2408, 0, cold_fractions=(0.875,)) == {2080: "cold", 2400: "anchor"}
    assert _cold_targets(2408, 0, cold_fractions=(0.5, 0.875)) == {
        1184: "cold", 2080: "cold", 2400: "anchor"}
    # resumed below half its length (a restart after a cut): still cold
    assert _cold_targets(2408, 1184, cold_fractions=(0.875,)) == {2080: "cold", 2400: "anchor"}


def test_no_cold_checkpoint_below_four_checkpoints_worth_of_kv():
    # a checkpoint the KV of 288 tokens: none below 4 x 288 = 1,152
    assert _cold_targets(2408, 0, 288, cold_fractions=(0.5, 0.875)) == {
        1184: "cold", 2080: "cold", 2400: "anchor"}
    # of 300 tokens: none below 1,200, so 1,184 goes
    assert _cold_targets(2408, 0, 300, cold_fractions=(0.5, 0.875)) == {
        2080: "cold", 2400: "anchor"}
    # the floor is for the cold checkpoints only: the anchor stays
    assert _cold_targets(2408, 0, 1000, cold_fractions=(0.5, 0.875)) == {2400: "anchor"}


def test_a_slot_share_under_32_checkpoints_keeps_no_cold_checkpoints():
    from atom_hybrid_cache.config import PlacementConfig
    from atom_hybrid_cache.core.policy import CheckpointPolicy
    from atom_hybrid_cache.core.slot_share import SlotShare
    cold = PlacementConfig(cold_fractions=(0.5, 0.875))

    def kept(pool, ckpt):
        return CheckpointPolicy(cold, block_size=128, share=SlotShare(pool, ckpt, 1, 1)
                                ).placement.cold_fractions
    assert kept(32 * 384, 384) == (0.5, 0.875)
    assert kept(32 * 384 - 1, 384) == ()
    # a checkpoint of unknown cost: no limit
    assert kept(10, 0) == (0.5, 0.875)


def test_the_core_manager_drops_an_unaffordable_cold_checkpoints_and_says_so():
    from atom_hybrid_cache.config import PlacementConfig
    from atom_hybrid_cache.core.replay_pool_config import ReplayPoolConfig
    from atom_hybrid_cache.core.manager import HybridCacheManager
    said = []
    cold = PlacementConfig(cold_fractions=(0.5, 0.875))
    # 64 blocks of 16 tokens: 1,008 tokens of KV, 504 a slot of two; a
    # checkpoint of 16 is 31 of them
    small = HybridCacheManager(ReplayPoolConfig(num_kv_blocks=64, max_num_seqs=2, placement=cold,
                                                checkpoint_kv_tokens=16), warn=said.append)
    assert small.policy.placement.cold_fractions == ()
    assert said == ["cold checkpoints off: 2 requests in flight: a request slot's share of the "
                    "KV pool (504 tokens) holds 31 checkpoints' worth, under 32"]
    roomy = HybridCacheManager(ReplayPoolConfig(num_kv_blocks=66, max_num_seqs=2, placement=cold,
                                                checkpoint_kv_tokens=16), warn=said.append)
    assert roomy.policy.placement.cold_fractions == (0.5, 0.875) and len(said) == 1


def test_a_small_share_drops_the_floor_states_too_and_names_what_it_dropped():
    from atom_hybrid_cache.config import PlacementConfig
    from atom_hybrid_cache.core.policy import CheckpointPolicy
    from atom_hybrid_cache.core.slot_share import SlotShare
    said = []
    cold = PlacementConfig(cold_fractions=(0.5,))
    floors = (0.25, 0.5)

    def policy(pool, placement=cold):
        return CheckpointPolicy(placement, block_size=128, share=SlotShare(pool, 384, 1, 1),
                                floor_fractions=floors, budget_warn=said.append)
    roomy = policy(64 * 384)
    assert (roomy.placement.cold_fractions, roomy.floor_fractions) == ((0.5,), floors)
    # at the line the cold checkpoints stay, the floors have no pool share
    # (pool_budget.floor_scale)
    at_line = policy(32 * 384)
    assert (at_line.placement.cold_fractions, at_line.floor_fractions) == ((0.5,), ())
    assert said == []
    small = policy(31 * 384)
    assert (small.placement.cold_fractions, small.floor_fractions) == ((), ())
    assert said == ["cold checkpoints and floor states off: 1 request in flight: a request "
                    "slot's share of the KV pool (11,904 tokens) holds 31 checkpoints' worth, "
                    "under 32"]
    assert policy(10 * 384, PlacementConfig()).floor_fractions == ()
    assert said[-1].startswith("floor states off: 1 request in flight: a request slot's share "
                               "of the KV pool (3,840 tokens)")


def test_the_insurance_goes_off_at_the_step_whose_requests_in_flight_leave_a_small_share():
    """vLLM's max_num_seqs is a ceiling (256 here): the share is the pool
    over the requests in flight. 64 checkpoints' worth hold 32 a request
    for two, 21 for three: the third request turns the cold checkpoints and
    floors off, once, and the log names why."""
    from atom_hybrid_cache.config import PlacementConfig
    from atom_hybrid_cache.core.policy import CheckpointPolicy
    from atom_hybrid_cache.core.slot_share import SlotShare
    said = []
    policy = CheckpointPolicy(PlacementConfig(cold_fractions=(0.5,)), block_size=128,
                              share=SlotShare(64 * 384, 384, 256), floor_fractions=(0.25,),
                              budget_warn=said.append)
    assert policy.share.line() == 3
    assert "cold checkpoints and floor states on up to 2 in flight (the floors' pool share " \
        "shrinking and a release's refreshed states spaced out under 48 checkpoints' worth " \
        "a request); from 3" in policy.describe_share()
    # the fade of priced eviction is said whatever the line, and where the
    # retained states run (two own states and one per retain fraction)
    assert policy.describe_share().endswith(
        "off; where ATOM_EVICTION_PRICE_WEIGHT is auto, eviction priced under 120 "
        "checkpoints' worth a request, in full from 32 down; a release's retained states "
        "(one per retain fraction) where a share holds 6 checkpoints' worth")
    loose = CheckpointPolicy(PlacementConfig(), block_size=128,
                             share=SlotShare(64 * 384, 384, 1), floor_fractions=(0.25,))
    assert loose.describe_share().endswith(
        "cold checkpoints and floor states stay on; where ATOM_EVICTION_PRICE_WEIGHT is auto, "
        "eviction priced under 120 checkpoints' worth a request, in full from 32 down; a "
        "release's retained states (one per retain fraction) where a share holds 6 "
        "checkpoints' worth")
    # two in flight leave 32 a request: the floors' pool share is gone
    # (pool_budget.floor_scale) before they go off at the third
    assert [policy.observe_in_flight(n) for n in (2, 1, 3, 5)] == [True, False, True, False]
    assert (policy.placement.cold_fractions, policy.floor_fractions) == ((), ())
    assert said == ["cold checkpoints and floor states off: 3 requests in flight: a request "
                    "slot's share of the KV pool (8,192 tokens) holds 21 checkpoints' worth, "
                    "under 32"]
    # fallback rungs sit under the share the requests in flight leave
    assert policy.kv_share_tokens == 64 * 384 // 5


def test_the_floors_pool_share_fades_in_above_the_line():
    """The floors may take 1/16 of the pool where a request slot's share
    holds 48 checkpoints' worth or more (the line, 32, and
    FLOOR_FADE_CHECKPOINTS, 16), none at 32 (where they go off), a straight
    line between: 128 checkpoints' worth over 2, 3, 4 requests in flight
    hold 64, 42.7 and 32 a request. Each step that moves it says so (the
    adapters then resize the floors' ledger); with no share left the floors
    are off, not refused at every request. Before the fade the floors took
    all 62 of 1,000 pages down to the line."""
    from atom_hybrid_cache.config import PlacementConfig
    from atom_hybrid_cache.core.policy import CheckpointPolicy
    from atom_hybrid_cache.core.pool_budget import floor_scale
    from atom_hybrid_cache.core.slot_share import SlotShare
    # (a set price weight: auto's fades with the share too,
    # tests/test_priced_eviction.py)
    policy = CheckpointPolicy(PlacementConfig(eviction_price_weight=0.0), block_size=128,
                              share=SlotShare(128 * 384, 384, 256), floor_fractions=(0.25,))
    seen = []
    for n in (2, 3, 4, 5):
        changed = policy.observe_in_flight(n)
        seen.append((n, changed, policy.floor_max_pages(1000), policy.floor_fractions))
    assert seen == [(2, False, 62, (0.25,)), (3, True, 41, (0.25,)), (4, True, 0, ()),
                    (5, True, 0, ())]
    assert [floor_scale(t * 384, 384) for t in (0, 32, 40, 48, 640)] == [0.0, 0.0, 0.5, 1.0, 1.0]
    assert floor_scale(1000, 0) == 1.0


def test_a_floor_ledger_exists_only_where_some_requests_in_flight_leave_room_for_floors():
    """The planner and vLLM's adapter both build the floors' ledger from
    `floor_ledger_fractions`: the configured floors wherever one request
    alone holds 32 checkpoints' worth (even if more in flight will turn
    them off), none under that for any number, none with LRU release."""
    from atom_hybrid_cache.config import PlacementConfig
    from atom_hybrid_cache.core.policy import CheckpointPolicy
    from atom_hybrid_cache.core.slot_share import SlotShare

    def ledger(pool_checkpoints, eviction="reuse-aware", in_flight=0):
        return CheckpointPolicy(PlacementConfig(eviction=eviction), block_size=128,
                                share=SlotShare(pool_checkpoints * 384, 384, 256, in_flight),
                                floor_fractions=(0.25, 0.5)).floor_ledger_fractions
    assert ledger(32) == (0.25, 0.5)
    # three in flight from the start: off now, but a ledger for the pool
    assert ledger(64, in_flight=3) == (0.25, 0.5)
    assert ledger(31) == ()
    assert ledger(64, eviction="lru") == ()



def test_a_warm_prompt_or_the_default_keeps_none():
    # the next turn resumes at the first one's end: not cold
    assert _cold_targets(2543, 2400, cold_fractions=(0.875,)) == {2528: "anchor"}
    # resumed at exactly half: not cold either
    assert _cold_targets(2400, 1200, cold_fractions=(0.875,)) == {2368: "anchor"}
    # off by default
    assert _cold_targets(2408, 0) == {2400: "anchor"}


def test_a_prompt_keeps_a_checkpoint_at_each_span_fraction_its_prefill_covers():
    # ATOM_STATE_CHECKPOINT_SPAN: 0.5 and 0.875 of 2,408 tokens are 1,204 and
    # 2,107, floored to the 32-token block: 1,184 and 2,080
    span = {"span_fractions": (0.5, 0.875)}
    # computed from 0: both, as COLD would place them
    assert _cold_targets(2408, 0, **span) == {1184: "span", 2080: "span", 2400: "anchor"}
    # a turn that appended 1,108 tokens to a 1,300-token prefix: not cold,
    # so COLD places nothing, but its span covers 0.875
    assert _cold_targets(2408, 1300, cold_fractions=(0.5, 0.875)) == {2400: "anchor"}
    assert _cold_targets(2408, 1300, **span) == {2080: "span", 2400: "anchor"}
    # a resume exactly at a fraction writes nothing there (the state exists)
    assert _cold_targets(2408, 1184, **span) == {2080: "span", 2400: "anchor"}
    # a short turn covers none of them
    assert _cold_targets(2543, 2400, **span) == {2528: "anchor"}
    # off by default
    assert _cold_targets(2408, 1300) == {2400: "anchor"}
