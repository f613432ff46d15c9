"""The vLLM adapter's policy object, without vLLM: plans, chunk stops, the
order a freed request's pages go back to the LRU, and its stats."""

from __future__ import annotations

import pytest

from atom_hybrid_cache.config import PlacementConfig
from atom_hybrid_cache.vllm.planner import CheckpointPlanner, FreedState, KVPages


def planner(**placement) -> CheckpointPlanner:
    return CheckpointPlanner(PlacementConfig(**placement), block_size=128, hash_block_size=64,
                             kv_share_tokens=1984, stats_log_interval=0, log=lambda m: None)


def kv(first_col, n, uncached=(), names=None):
    """A KV group's pages first_col .. first_col + n - 1 (named K<col>)."""
    cols = range(first_col, first_col + n)
    return KVPages(128, names or [f"K{c}" for c in cols], [c not in uncached for c in cols], first_col)


def st(pos, cached=True, name=None):
    return FreedState(name or f"S{pos}", pos, cached)


def test_units_leave_from_the_top_state_first_uncached_before_all():
    pages = kv(0, 7, uncached={6}, names=[f"K{c}" for c in range(6)] + ["Kpartial"])
    states = [st(256), st(640), st(0, cached=False, name="Srun")]
    order = planner().eviction_order(states, [pages])
    assert order == ["Kpartial", "Srun",
                     "K5",                      # above every state: worth nothing alone
                     "S640", "K4", "K3", "K2",  # the unit of the state at 640
                     "S256", "K1", "K0"]        # the lowest unit leaves last


def test_lru_setting_keeps_vllms_order():
    assert planner(eviction="lru").eviction_order([st(128)], [kv(0, 2)]) == ["K0", "K1", "S128"]


def test_a_state_on_a_partial_block_needs_that_block():
    # a prompt-end state at 1216 (hash granularity 64) needs KV [1152, 1280)
    assert planner().eviction_order([st(1216), st(1024)], [kv(8, 2)]) == [
        "S1216", "K9", "K8", "S1024"]


def test_two_kv_groups_merge_by_page_end_within_a_unit():
    # group A: 128-token pages 0..3; group B: 256-token pages 0..1 (ends 256, 512)
    a = kv(0, 4, names=["A0", "A1", "A2", "A3"])
    b = KVPages(256, ["B0", "B1"], [True, True])
    order = planner().eviction_order([st(384)], [a, b])
    # above 384: A3 (384-512); B1 (256-512) starts below 384: the unit of
    # 384, whose pages leave by end, equal ends in group order (A1, B0)
    assert order == ["A3", "S384", "B1", "A2", "A1", "B0", "A0"]


def test_plan_after_a_cut_places_backoffs_but_not_the_anchor():
    p = planner()
    seen = [f"h{i}" for i in range(16)]
    p.finished("old", seen, [])          # an earlier request indexed 16 units of 64
    plan = p.plan("r", 1195, seen[:16] + ["x"] * 2, hit=0, compressed=768)
    # reusable: 16 units of 64 = 1024 > compressed: a KV tail cut of 256
    assert plan.reusable == 1024
    # demand at 768; backoffs 0.03/0.15/0.4 of 6 blocks -> 640, 640, 384;
    # vLLM keeps the prompt end itself: no anchor stop of ours
    assert plan.kinds == {768: "demand", 640: "cut", 384: "cut"}
    assert plan.targets.positions == [384, 640, 768]


def test_chunk_stops_at_the_earliest_planned_checkpoint_inside():
    p = planner()
    p.finished("old", [f"h{i}" for i in range(16)], [])
    p.plan("r", 1195, [f"h{i}" for i in range(18)], hit=0, compressed=768)
    assert p.chunk_stop("r", 0, 1195) == 384
    assert p.chunk_stop("r", 384, 1195) == 640
    assert p.chunk_stop("r", 640, 700) == 700
    assert p.chunk_stop("r", 768, 1195) == 1195
    assert p.chunk_stop("unknown", 0, 100) == 100


def test_with_interior_extraction_chunks_run_on_and_the_forward_gets_its_targets():
    p = CheckpointPlanner(PlacementConfig(), block_size=128, hash_block_size=64,
                          kv_share_tokens=1984, stats_log_interval=0, interior_readable=True,
                          log=lambda m: None)
    p.finished("old", [f"h{i}" for i in range(16)], [])
    p.plan("r", 1195, [f"h{i}" for i in range(18)], hit=0, compressed=768)
    # the same plan as when cutting, but no stop: the forward writes them
    assert p.plans["r"].kinds == {768: "demand", 640: "cut", 384: "cut"}
    assert p.chunk_stop("r", 0, 1195) == 1195
    assert p.interior_positions("r", 0, 1195) == [768, 640, 384]
    # strictly inside: the state at a chunk's end is the forward's own
    assert p.interior_positions("r", 384, 768) == [640]
    assert p.interior_positions("r", 640, 700) == []
    # retention is unchanged: the managers keep all three
    assert sorted(p.plans["r"].retained) == [384, 640, 768]
    assert p.plans["r"].retained_max == 768
    # cutting planner: no interior targets, ever
    q = planner()
    q.finished("old", [f"h{i}" for i in range(16)], [])
    q.plan("r", 1195, [f"h{i}" for i in range(18)], hit=0, compressed=768)
    assert q.interior_positions("r", 0, 1195) == []


def test_fallback_rungs_follow_the_pool_share_on_a_quarter_share_grid():
    # share 1984 tokens: grid min(4096, 496) -> 384; rungs 0.5 -> 768, 0.85 -> 1536
    plan = planner().plan("r", 1990, [], hit=0, compressed=0)
    assert plan.kinds == {768: "fallback", 1536: "fallback"}
    short = planner().plan("s", 1900, [], hit=0, compressed=0)   # within its share
    assert short.kinds == {}


def test_admissions_feed_the_core_stats_and_its_log_lines():
    lines = []
    p = CheckpointPlanner(PlacementConfig(), block_size=128, hash_block_size=64,
                          kv_share_tokens=1984, stats_log_interval=2, log=lines.append)
    p.finished("old", [f"h{i}" for i in range(10)], [])
    p.plan("a", 700, [f"h{i}" for i in range(10)], hit=640, compressed=640)
    p.admitted("a", 640)
    p.admitted("a", 640)                  # counted once
    p.plan("b", 300, ["z"] * 4, hit=0, compressed=0)
    p.admitted("b", 0)
    s = p.stats
    assert (s.admissions, s.prompt_tokens, s.reusable, s.compressed, s.cached) == (2, 1000, 640, 640, 640)
    assert s.computed_prefill_tokens == 60 + 300
    assert len(lines) == 5 and lines[0].startswith("[Cache Stats] admissions=2 reusable=640 cached=640")
    p.plan("c", 1195, [f"h{i}" for i in range(10)] + ["y"] * 8, hit=0, compressed=512)
    # kept states: a planned cut rung, vLLM's own junction and prompt end;
    # 0 is no write
    assert p.plans["c"].kinds[384] == "cut"
    p.finished("c", [], [0, 384, 512, 768, 1152])
    assert s.written_by_kind == {"cut": 1, "demand": 1, "junction": 1, "anchor": 1}


@pytest.mark.parametrize("bad", ["ATOM_STATE_CHECKPOINT_SLOTS=-1", "ATOM_STATE_CHECKPOINT_CUT_BACKOFF=1.5",
                                 "ATOM_STATE_CHECKPOINT_FALLBACK=x", "ATOM_STATE_CHECKPOINT_RETAIN=0.5,1.0",
                                 "ATOM_STATE_CHECKPOINT_COLD=0.875,1",
                                 "ATOM_STATE_CHECKPOINT_SPAN=0,0.5",
                                 "ATOM_INTERIOR_CHECKPOINTS=auto", "ATOM_ADMISSION_ORDER=lifo",
                                 "ATOM_ADMISSION_GATE=yes"])
def test_new_settings_are_validated_with_their_names(bad):
    from atom_hybrid_cache.config import CacheConfig, ConfigError, apply_env
    var, raw = bad.split("=")
    with pytest.raises(ConfigError) as e:
        apply_env(CacheConfig(), {var: raw})
    assert var in str(e.value)


def test_cold_fractions_reach_the_chunk_stops():
    # ATOM_STATE_CHECKPOINT_COLD, read as the scheduler reads it, puts a
    # chunk stop at 0.875 of a first prompt (1,500 tokens: 1,312 -> 1,280);
    # the next turn, resumed at its end, gets none
    from atom_hybrid_cache.config import CacheConfig, apply_env

    placement = apply_env(CacheConfig(), {"ATOM_STATE_CHECKPOINT_COLD": "0.875"}).placement
    assert placement.cold_fractions == (0.875,)
    p = CheckpointPlanner(placement, block_size=128, hash_block_size=64, kv_share_tokens=1 << 20,
                          stats_log_interval=0, log=lambda m: None)
    p.plan("first", 1500, [f"h{i}" for i in range(23)], hit=0, compressed=0)
    assert p.plans["first"].kinds == {1280: "fallback"}
    assert p.chunk_stop("first", 0, 1500) == 1280
    p.plan("next", 1700, [f"h{i}" for i in range(26)], hit=1472, compressed=1472)
    assert p.plans["next"].kinds == {}


def test_span_fractions_reach_the_chunk_stops():
    # ATOM_STATE_CHECKPOINT_SPAN, read as the scheduler reads it: a turn
    # resumed at 896 of 1,700 tokens (0.875 of it: 1,487 -> 1,408) gets a
    # chunk stop there; COLD gives it none (resumed above half)
    from atom_hybrid_cache.config import CacheConfig, apply_env

    placement = apply_env(CacheConfig(), {"ATOM_STATE_CHECKPOINT_SPAN": "0.5,0.875"}).placement
    assert placement.span_fractions == (0.5, 0.875)
    p = CheckpointPlanner(placement, block_size=128, hash_block_size=64, kv_share_tokens=1 << 20,
                          stats_log_interval=0, log=lambda m: None)
    p.plan("turn", 1700, [f"h{i}" for i in range(26)], hit=896, compressed=896)
    assert p.plans["turn"].kinds == {1408: "fallback"}
    assert p.chunk_stop("turn", 896, 1700) == 1408
    cold = apply_env(CacheConfig(), {"ATOM_STATE_CHECKPOINT_COLD": "0.5,0.875"}).placement
    q = CheckpointPlanner(cold, block_size=128, hash_block_size=64, kv_share_tokens=1 << 20,
                          stats_log_interval=0, log=lambda m: None)
    q.plan("turn", 1700, [f"h{i}" for i in range(26)], hit=896, compressed=896)
    assert q.plans["turn"].kinds == {}
