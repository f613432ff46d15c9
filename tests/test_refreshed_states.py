"""Which older states of its prefix a release takes back into its units
(`core.eviction.spaced_refreshed`): where a request slot's share of the
pool is at the line, those closer than a checkpoint's KV to a state the
release keeps stay where their own release left them in the LRU."""

from __future__ import annotations

from atom_hybrid_cache.config import PlacementConfig
from atom_hybrid_cache.core.eviction import spaced_refreshed
from atom_hybrid_cache.core.policy import CheckpointPolicy
from atom_hybrid_cache.core.slot_share import SlotShare


def test_states_closer_than_the_spacing_to_a_kept_one_are_left():
    # the hit at 8,064 and the own prompt end at 8,512; found at the hit and
    # the retain fractions of 8,516 tokens
    found = [(8064, "h"), (7616, "a"), (7168, "b"), (6272, "c"), (4032, "d")]
    # lowest first: 4,032 and 6,272 stand 1,344 from the start, each other
    # and the hit; 7,168 is 896 above 6,272, 7,616 448 under the hit
    assert spaced_refreshed(found, [8512], 8064, 1344) == [(8064, "h"), (6272, "c"),
                                                           (4032, "d")]
    assert spaced_refreshed(found, [8512], 8064, 448) == found
    assert spaced_refreshed(found, [8512], 8064, 0) == found


def test_the_highest_found_is_taken_back_however_close():
    """The hit's state gone (or in the release's own table), the highest
    found is the fallback right under the top: kept 64 tokens under it."""
    found = [(10496, "a"), (10240, "b"), (9000, "c")]
    assert spaced_refreshed(found, [10560, 10624], 10560, 384) == [(10496, "a"), (9000, "c")]


def test_a_state_near_the_prompts_start_is_left():
    assert spaced_refreshed([(3000, "a"), (300, "b")], [4000], 0, 800) == [(3000, "a")]


def test_the_spacing_fades_out_as_the_floors_fade_in():
    """A checkpoint's KV at a share at or under the line (32 checkpoints'
    worth), none from 48 on, linear between; none where a checkpoint's cost
    is unknown."""
    def spacing(slot_checkpoints, checkpoint_kv_tokens=1000):
        share = SlotShare(slot_checkpoints * 1000, checkpoint_kv_tokens, 1)
        return CheckpointPolicy(PlacementConfig(), block_size=64, share=share)\
            .refresh_spacing_tokens
    assert [spacing(n) for n in (9, 32, 36, 40, 48, 100)] == [1000, 1000, 750, 500, 0, 0]
    assert spacing(9, checkpoint_kv_tokens=0) == 0


def test_a_conversation_returning_to_an_older_context_finds_it(sweep, monkeypatch):
    """The planner's model, the small-pool sweep's grouping 0 of 8 at 75
    checkpoints' worth, 1.25x the live set (8 in flight, 9 checkpoints'
    worth a slot). trace_0348's turns 39-46 leave the context its turn 47
    returns to (2,432 tokens shared with turn 38). Its turns end one or two
    64-token units apart, and each release took back the states at its
    retain fractions beside the ones it kept: their pages pushed that
    context's KV out (hit 512). Spaced, the plugin caches what
    native-pmu64 does, the better native here."""
    convs, w, pool, in_flight = sweep.cell_workload(0, 75, 1.25, count=8)
    cell = dict(pool_pages=pool, in_flight=in_flight)
    assert (pool, in_flight) == (225, 8)
    assert sweep.planner_cached("native-pmu64", convs, w, cell) == 626880
    assert sweep.planner_cached("plugin", convs, w, cell) == 626880
    monkeypatch.setattr(CheckpointPolicy, "refresh_spacing_tokens", property(lambda self: 0))
    assert sweep.planner_cached("plugin", convs, w, cell) == 624960


def test_retained_states_run_where_a_share_holds_them_beside_the_releases_own():
    """A release keeps its own two states (the page boundary and the
    prompt-end copy) and takes back one per retain fraction: where a
    request slot's share holds fewer checkpoints' worth than that (six at
    the four default fractions), none (`pool_budget.affords_retained`)."""
    def fractions(slot_checkpoints, retain=(0.5, 0.75, 0.875, 0.94), checkpoint_kv_tokens=1000):
        share = SlotShare(int(slot_checkpoints * 1000), checkpoint_kv_tokens, 1)
        return CheckpointPolicy(PlacementConfig(retain_fractions=retain), block_size=64,
                                share=share).retain_fractions
    assert fractions(6) == (0.5, 0.75, 0.875, 0.94)
    assert fractions(5.99) == ()
    assert fractions(3) == () and fractions(3, retain=(0.5,)) == (0.5,)
    assert fractions(2.9, retain=(0.5,)) == ()
    assert fractions(1, checkpoint_kv_tokens=0) == (0.5, 0.75, 0.875, 0.94)


def test_a_pool_of_15_checkpoints_worth_keeps_the_next_rounds_prefixes(sweep):
    """The small-pool sweep's subset 2 at 15 checkpoints' worth, 0.83x (45
    pages, 3 in flight: 5 checkpoints' worth a slot). The states the
    releases took back at their retain fractions took the pages of the next
    round's prefixes: 76,608 cached against native's 82,816 (5.5 points of
    the oracle under it). Under the retained states' line, 82,240."""
    convs, w, pool, in_flight = sweep.cell_workload(2, 15, 0.83)
    cell = dict(pool_pages=pool, in_flight=in_flight)
    assert (pool, in_flight, sum(w.oracle)) == (45, 3, 113_710)
    assert sweep.planner_cached("native", convs, w, cell) == 82_816
    assert sweep.planner_cached("plugin", convs, w, cell) == 82_240
