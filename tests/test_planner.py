"""The core's planner, as the vLLM adapter drives it (no vLLM): plans,
chunk stops, the hand-off to the state managers, the order a freed
request's pages go back to the LRU, and its stats."""

from __future__ import annotations

import pytest

from atom_hybrid_cache.config import PlacementConfig, Settings, apply_env, replay_defaults
from atom_hybrid_cache.core.eviction import FreedState, KVPages, eviction_order
from atom_hybrid_cache.core.planner import CheckpointPlanner
from atom_hybrid_cache.core.policy import CheckpointPolicy
from atom_hybrid_cache.core.slot_share import SlotShare


def make_planner(placement: PlacementConfig = PlacementConfig(), *, kv_share_tokens: int = 1984,
                 interior: bool = False, stats_log_interval: int = 0,
                 log=lambda m: None) -> CheckpointPlanner:
    policy = CheckpointPolicy(placement, block_size=128,
                              share=SlotShare(kv_share_tokens, 0, 1, in_flight=1))
    return CheckpointPlanner(policy, hash_unit=64, stats_log_interval=stats_log_interval,
                             interior_readable=interior, log=log)


def planner(**placement) -> CheckpointPlanner:
    return make_planner(PlacementConfig(**placement))


def freed_order(states, kv=(), **placement):
    return eviction_order(states, kv, PlacementConfig(**placement).eviction == "reuse-aware")


def kv(first_col, n, uncached=(), names=None):
    """A KV group's pages first_col .. first_col + n - 1 (named K<col>)."""
    cols = range(first_col, first_col + n)
    return KVPages(128, names or [f"K{c}" for c in cols], [c not in uncached for c in cols], first_col)


def st(pos, cached=True, name=None):
    return FreedState(name or f"S{pos}", pos, cached)


def test_units_leave_from_the_top_state_first_uncached_before_all():
    pages = kv(0, 7, uncached={6}, names=[f"K{c}" for c in range(6)] + ["Kpartial"])
    states = [st(256), st(640), st(0, cached=False, name="Srun")]
    order = freed_order(states, [pages])
    assert order == ["Kpartial", "Srun",
                     "K5",                      # above every state: worth nothing alone
                     "S640", "K4", "K3", "K2",  # the unit of the state at 640
                     "S256", "K1", "K0"]        # the lowest unit leaves last


def test_lru_setting_keeps_vllms_order():
    assert freed_order([st(128)], [kv(0, 2)], eviction="lru") == ["K0", "K1", "S128"]


def test_a_state_on_a_partial_block_needs_that_block():
    # a prompt-end state at 1216 (hash granularity 64) needs KV [1152, 1280)
    assert freed_order([st(1216), st(1024)], [kv(8, 2)]) == [
        "S1216", "K9", "K8", "S1024"]


def test_two_kv_groups_merge_by_page_end_within_a_unit():
    # group A: 128-token pages 0..3; group B: 256-token pages 0..1 (ends 256, 512)
    a = kv(0, 4, names=["A0", "A1", "A2", "A3"])
    b = KVPages(256, ["B0", "B1"], [True, True])
    order = freed_order([st(384)], [a, b])
    # above 384: A3 (384-512); B1 (256-512) starts below 384: the unit of
    # 384, whose pages leave by end, equal ends in group order (A1, B0)
    assert order == ["A3", "S384", "B1", "A2", "A1", "B0", "A0"]


def test_plan_after_a_cut_places_backoffs_but_not_the_anchor():
    p = planner()
    seen = [f"h{i}" for i in range(16)]
    p.finished("old", seen, [])          # an earlier request indexed 16 units of 64
    plan = p.plan("r", 1195, seen[:16] + ["x"] * 2, hit=0, kv_reach=768)
    # reusable: 16 units of 64 = 1024 > kv_reach: a KV tail cut of 256
    assert plan.reusable == 1024
    # demand at 768; backoffs 0.03/0.15/0.4 of 6 blocks -> 640, 640, 384;
    # vLLM keeps the prompt end itself: no anchor stop of ours
    assert plan.kinds == {768: "demand", 640: "cut", 384: "cut"}
    assert plan.targets.positions == [384, 640, 768]


def test_chunk_stops_at_the_earliest_planned_checkpoint_inside():
    p = planner()
    p.finished("old", [f"h{i}" for i in range(16)], [])
    p.plan("r", 1195, [f"h{i}" for i in range(18)], hit=0, kv_reach=768)
    assert p.chunk_stop("r", 0, 1195) == 384
    assert p.chunk_stop("r", 384, 1195) == 640
    assert p.chunk_stop("r", 640, 700) == 700
    assert p.chunk_stop("r", 768, 1195) == 1195
    assert p.chunk_stop("unknown", 0, 100) == 100


def test_with_interior_extraction_chunks_run_on_and_the_forward_gets_its_targets():
    p = make_planner(interior=True)
    p.finished("old", [f"h{i}" for i in range(16)], [])
    p.plan("r", 1195, [f"h{i}" for i in range(18)], hit=0, kv_reach=768)
    # the same plan as when cutting, but no stop: the forward writes them
    assert p.plans.get("r").kinds == {768: "demand", 640: "cut", 384: "cut"}
    assert p.chunk_stop("r", 0, 1195) == 1195
    assert p.plans.interior_positions("r", 0, 1195) == [768, 640, 384]
    # strictly inside: the state at a chunk's end is the forward's own
    assert p.plans.interior_positions("r", 384, 768) == [640]
    assert p.plans.interior_positions("r", 640, 700) == []
    # retention is unchanged: the managers keep all three
    assert sorted(p.plans.get("r").retained) == [384, 640, 768]
    assert p.plans.get("r").retained_max == 768
    # the hand-off: all three kept while one is still ahead of the computed
    assert sorted(p.plans.positions_to_keep("r", 700)) == [384, 640, 768]
    assert p.plans.positions_to_keep("r", 768) == ()
    assert p.plans.positions_to_keep("unknown", 0) == ()
    # a forward over [0, 1195) writes the three from inside
    p.forward_scheduled("r", 0, 1195)
    assert p.stats.interior_writes == 3
    # cutting planner: no interior targets, ever
    q = planner()
    q.finished("old", [f"h{i}" for i in range(16)], [])
    q.plan("r", 1195, [f"h{i}" for i in range(18)], hit=0, kv_reach=768)
    assert q.plans.interior_positions("r", 0, 1195) == []
    q.forward_scheduled("r", 0, 1195)
    assert q.stats.interior_writes == 0


def test_fallback_rungs_follow_the_pool_share_on_a_quarter_share_grid():
    # share 1984 tokens: grid min(4096, 496) -> 384; rungs 0.5 -> 768, 0.85 -> 1536
    plan = planner().plan("r", 1990, [], hit=0, kv_reach=0)
    assert plan.kinds == {768: "fallback", 1536: "fallback"}
    short = planner().plan("s", 1900, [], hit=0, kv_reach=0)   # within its share
    assert short.kinds == {}


def test_admissions_feed_the_core_stats_and_its_log_lines():
    lines = []
    p = make_planner(stats_log_interval=2, log=lines.append)
    p.finished("old", [f"h{i}" for i in range(10)], [])
    p.plan("a", 700, [f"h{i}" for i in range(10)], hit=640, kv_reach=640)
    p.admitted("a", 640)
    p.admitted("a", 640)                  # counted once
    p.plan("b", 300, ["z"] * 4, hit=0, kv_reach=0)
    p.admitted("b", 0)
    s = p.stats
    assert (s.admissions, s.prompt_tokens, s.reusable, s.kv_reach, s.cached) == (2, 1000, 640, 640, 640)
    assert s.computed_prefill_tokens == 60 + 300
    assert len(lines) == 5 and lines[0].startswith("[Cache Stats] admissions=2 reusable=640 cached=640")
    p.plan("c", 1195, [f"h{i}" for i in range(10)] + ["y"] * 8, hit=0, kv_reach=512)
    # kept states: a planned cut rung, vLLM's own junction and prompt end;
    # 0 is no write
    assert p.plans.get("c").kinds[384] == "cut"
    p.finished("c", [], [0, 384, 512, 768, 1152])
    assert s.written_by_kind == {"cut": 1, "demand": 1, "junction": 1, "anchor": 1}


@pytest.mark.parametrize("bad", ["ATOM_STATE_CHECKPOINT_SLOTS=-1", "ATOM_STATE_CHECKPOINT_CUT_BACKOFF=1.5",
                                 "ATOM_STATE_CHECKPOINT_FALLBACK=x", "ATOM_STATE_CHECKPOINT_RETAIN=0.5,1.0",
                                 "ATOM_STATE_CHECKPOINT_COLD=0.875,1",
                                 "ATOM_STATE_CHECKPOINT_SPAN=0,0.5",
                                 "ATOM_INTERIOR_CHECKPOINTS=auto", "ATOM_ADMISSION_ORDER=lifo",
                                 "ATOM_ADMISSION_GATE=yes"])
def test_new_settings_are_validated_with_their_names(bad):
    from atom_hybrid_cache.config import ConfigError
    var, raw = bad.split("=")
    with pytest.raises(ConfigError) as e:
        apply_env(Settings(), {var: raw})
    assert var in str(e.value)


def test_cold_fractions_reach_the_chunk_stops():
    # ATOM_STATE_CHECKPOINT_COLD, read as the scheduler reads it, puts a
    # chunk stop at 0.875 of a first prompt (1,500 tokens: 1,312 -> 1,280);
    # the next turn, resumed at its end, gets none
    placement = apply_env(replay_defaults(), {"ATOM_STATE_CHECKPOINT_COLD": "0.875"}).placement
    assert placement.cold_fractions == (0.875,)
    p = make_planner(placement, kv_share_tokens=1 << 20)
    p.plan("first", 1500, [f"h{i}" for i in range(23)], hit=0, kv_reach=0)
    assert p.plans.get("first").kinds == {1280: "cold"}
    assert p.chunk_stop("first", 0, 1500) == 1280
    p.plan("next", 1700, [f"h{i}" for i in range(26)], hit=1472, kv_reach=1472)
    assert p.plans.get("next").kinds == {}


def test_span_fractions_reach_the_chunk_stops():
    # ATOM_STATE_CHECKPOINT_SPAN, read as the scheduler reads it: a turn
    # resumed at 896 of 1,700 tokens (0.875 of it: 1,487 -> 1,408) gets a
    # chunk stop there; COLD gives it none (resumed above half)
    placement = apply_env(replay_defaults(),
                          {"ATOM_STATE_CHECKPOINT_SPAN": "0.5,0.875"}).placement
    assert placement.span_fractions == (0.5, 0.875)
    p = make_planner(placement, kv_share_tokens=1 << 20)
    p.plan("turn", 1700, [f"h{i}" for i in range(26)], hit=896, kv_reach=896)
    assert p.plans.get("turn").kinds == {1408: "span"}
    assert p.chunk_stop("turn", 896, 1700) == 1408
    cold = apply_env(replay_defaults(), {"ATOM_STATE_CHECKPOINT_COLD": "0.5,0.875"}).placement
    q = make_planner(cold, kv_share_tokens=1 << 20)
    q.plan("turn", 1700, [f"h{i}" for i in range(26)], hit=896, kv_reach=896)
    assert q.plans.get("turn").kinds == {}


def test_the_release_order_without_units_is_the_units_order():
    """core.eviction.freed_order (the release without the store's record of
    each unit, and the planner's model) frees in the order of
    freed_units(...).order(), on releases drawn at random: states cached or
    not at unit boundaries, KV pages indexed up to a point (or, a case in
    four, here and there: a table with null pages), a first column past 0,
    one KV group and two."""
    import random

    from atom_hybrid_cache.core.eviction import freed_order, freed_units
    rng = random.Random(7)
    for case in range(300):
        size = rng.choice((16, 64, 128))
        n = rng.randrange(0, 40)
        c0 = rng.choice((0, 0, 3))
        spots = range(8, (n + c0 + 2) * size, 8)
        positions = rng.sample(spots, k=min(len(spots), rng.randrange(0, 7)))
        states = [FreedState(f"s{i}", p, rng.random() < 0.8, i % 3)
                  for i, p in enumerate(positions)]
        states += [FreedState(f"s{i}b", p, True, 1) for i, p in enumerate(positions[:2])]
        groups = 1 if case % 3 else 2
        kv = []
        for g in range(groups):
            indexed = rng.randrange(0, n + 1)
            flags = ([i < indexed for i in range(n)] if case % 4
                     else [rng.random() < 0.6 for _ in range(n)])
            kv.append(KVPages(size, [f"k{g}.{i}" for i in range(n)], flags, c0))
        assert freed_order(states, kv) == freed_units(states, kv).order(), case


def test_the_state_walk_over_kept_positions_is_the_range_walk():
    """core.eviction.highest_states_at_or_below with `kept_positions` (the
    positions where any prefix's state sits; the adapter's, from vLLM's
    index) answers as the walk over the ranges does, on random state maps:
    states of this prefix at unit and page boundaries, other prefixes'
    positions (in the kept list, not found here), positions off the hash
    unit, tops past the end and a search depth of 0 to 64 pages."""
    import random

    from atom_hybrid_cache.core.eviction import highest_states_at_or_below
    rng = random.Random(11)
    for case in range(2000):
        unit = rng.choice((16, 50, 64))
        page = unit * rng.choice((1, 2, 7, 8))
        end = unit * rng.randrange(1, 400)
        ours = {p: [f"s{p}"] for p in rng.sample(range(unit, end + 1, unit),
                                                   k=min(end // unit, rng.randrange(0, 12)))}
        ours.update({p: [f"s{p}"] for p in range(page, end + 1, page) if rng.random() < 0.1})
        others = {rng.randrange(1, end + 2 * page) for _ in range(rng.randrange(0, 30))}
        kept = sorted(set(ours) | others)
        tops = [rng.randrange(0, end + 3 * unit) for _ in range(rng.randrange(0, 6))]
        max_pages = rng.choice((0, 1, 3, 64))
        asked = []

        def state_at(pos):
            asked.append(pos)
            return ours.get(pos)
        want = highest_states_at_or_below(tops, unit, page, max_pages, state_at)
        asked_by_ranges = len(asked)
        asked.clear()
        got = highest_states_at_or_below(tops, unit, page, max_pages, state_at,
                                         kept_positions=kept)
        assert got == want, case
        assert set(asked) <= set(kept) and len(asked) <= asked_by_ranges, case


def test_the_oracle_learns_a_prefill_chunk_once_its_step_is_scheduled():
    p = planner()
    hashes = [f"h{i}" for i in range(12)]
    p.finished("first", hashes[:2], [])                 # computed h0, h1
    p.plan("r", 640, hashes, hit=128, kv_reach=128)     # resumed at 2 units of 64
    p.chunk_scheduled(hashes, 2, 6)                     # a chunk over units 2..5
    # a request planned in the same step does not see the chunk (vLLM
    # plans the step's requests before any of them is counted computed)
    assert p.plan("s", 640, hashes, hit=0, kv_reach=0).reusable == 128
    p.step_scheduled()
    # queued (learning misses the cache on a set of millions: a busy step
    # leaves it to a quiet one), and learned before a plan reads the oracle
    assert p.oracle.seen == {"h0", "h1"} and p.oracle.queued_units == 4
    assert p.plan("s", 640, hashes, hit=0, kv_reach=0).reusable == 384
    assert p.oracle.seen == {"h0", "h1", "h2", "h3", "h4", "h5"}
    # the rest of the prompt, then 2 units of output, learned at the release
    p.chunk_scheduled(hashes, 6, 10)
    p.step_scheduled()
    p.finished("r", hashes, [], 12)
    # what it generated queued behind its chunk, in one entry
    assert p.oracle.queued == [[hashes, 6, 12]]
    p.catch_up(quiet=True)
    assert p.oracle.seen == set(hashes) and p.oracle.queued == []
    # without a plan, from the start; without a count, the whole list
    p.finished("t", ["a0", "a1", "a2"], [], 2)
    p.finished("u", ["b0"], [])
    p.catch_up(quiet=True)
    assert p.oracle.seen == set(hashes) | {"a0", "a1", "b0"}


def test_a_quiet_step_learns_a_slice_of_a_long_queue():
    from atom_hybrid_cache.core import planner as planner_module
    assert (planner_module.QUIET_LEARN_UNITS, planner_module.QUEUED_UNITS_BUSY) == (256, 4096)
    p = planner()
    hashes = [f"h{i}" for i in range(1000)]
    p.chunk_scheduled(hashes, 0, 1000)        # a busy run's queue
    p.step_scheduled()
    p.catch_up(quiet=False)                   # under the busy line: nothing
    assert p.oracle.queued_units == 1000 and not p.oracle.seen
    p.catch_up(quiet=True)                    # a quiet step: 256 units
    assert p.oracle.seen == set(hashes[:256]) and p.oracle.queued == [[hashes, 256, 1000]]
    # a plan reads its chain whole all the same
    assert p.plan("r", 64 * 1001, hashes, hit=0, kv_reach=0).reusable == 64 * 1000


def test_a_chunk_resumed_on_loaded_pages_teaches_their_hashes_too():
    # "r" resumed at 4 units on pages the oracle never saw computed (a KV
    # connector's load): it learns from the highest hash it knows (h1) up,
    # so every hash it keeps has its parent, and its reach stays a prefix
    p = planner()
    hashes = [f"h{i}" for i in range(10)]
    p.finished("first", hashes[:2], [])
    p.chunk_scheduled(hashes, 4, 6)
    p.step_scheduled()
    assert p.oracle.reach(hashes, 10) == 6
    assert p.oracle.seen == {"h0", "h1", "h2", "h3", "h4", "h5"}
