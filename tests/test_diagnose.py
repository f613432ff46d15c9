"""diagnose: which pool binds, from the core's stats lines."""

import pytest

from atom_hybrid_cache import diagnose as dg
from atom_hybrid_cache.diagnose import diagnose, last_complete_set, parse_line

STATE_BOUND = """\
[Cache Stats] admissions=1200 reusable=5000000 cached=4700000 hit=0.9400 lost_to_checkpoint=200000 lost_unrecoverable=100000
[Cache Pools] paged_hit=0.9800 state_hit=0.9592 combined=0.9400 binds=state
[Cache Freq] requests=1200 full_reuse=1100 paged_match_state_miss=60 checkpoint_would_fix=55 paged_miss=40
[Checkpoint Fates] written=1500 kept=1500 dropped=10 evicted=900 orphaned=300 read=1150 num_slots=40
[Pool Pressure] kv_used=1000 kv_reusable_free=500 kv_vacant=20 kv_indexed=1400 kv_total=1521 state_used=8 state_reusable_free=30 state_vacant=2 state_indexed=30 state_total=40
"""

# KV memory is short: the paged prefix is the lower factor and most lost
# checkpoints were orphaned by KV eviction.
KV_BOUND = """\
[Cache Stats] admissions=800 reusable=4000000 cached=3000000 hit=0.7500 lost_to_checkpoint=100000 lost_unrecoverable=900000
[Cache Pools] paged_hit=0.7750 state_hit=0.9677 combined=0.7500 binds=kv
[Cache Freq] requests=800 full_reuse=600 paged_match_state_miss=20 checkpoint_would_fix=15 paged_miss=180
[Checkpoint Fates] written=1000 kept=1000 dropped=0 evicted=100 orphaned=700 read=620 num_slots=200
[Pool Pressure] kv_used=900 kv_reusable_free=10 kv_vacant=0 kv_indexed=910 kv_total=910 state_used=40 state_reusable_free=100 state_vacant=60 state_indexed=100 state_total=200
"""


def test_state_bound():
    d = diagnose(STATE_BOUND)
    assert d.binds == "state"
    # (4,700,000 + 200,000) / 5,000,000
    assert d.state_ceiling_hit == pytest.approx(0.98)
    # 300 / (900 + 300) = 25%: exactly on the threshold, so the note is given.
    assert d.orphan_note is not None
    assert "300 of 1,200 checkpoint losses (25.00%)" in d.orphan_note
    assert "more KV memory" in d.orphan_note
    text = "\n".join(d.lines)
    assert "hit 94.00% of 5,000,000 reusable tokens over 1,200 admissions" in text
    assert "paged_hit 98.00% x state_hit 95.92%" in text
    assert "about 98.00%" in text
    # 40 slots kept 1,500: at least 1,460 had to go; 900 / 1,460 = 61.64%
    assert "at least 1,460 had to go" in text
    assert "(61.64% of max(1, kept - num_slots))" in text
    assert "dropped=10: drops alone cannot show a small pool" in text
    assert any(line.startswith("binds: state") for line in d.lines)
    assert "55 of them a checkpoint would fix" in text
    assert "state 8 used / 30 reusable free / 2 vacant of 40" in text
    assert d.values["Checkpoint Fates"]["num_slots"] == 40


def test_kv_bound_with_orphans():
    d = diagnose(KV_BOUND)
    assert d.binds == "kv"
    assert d.state_ceiling_hit == pytest.approx(3_100_000 / 4_000_000)
    assert d.orphan_note is not None
    assert "700 of 800 checkpoint losses (87.50%)" in d.orphan_note
    verdict = [line for line in d.lines if line.startswith("binds:")]
    assert verdict == [
        "binds: kv - orphans outnumber evictions, so checkpoints die with their KV blocks; "
        "more KV memory is the lever"
    ]


def test_orphans_dominating_beat_state_pressure():
    # Heavy eviction and state_hit < paged_hit, but more orphans than
    # evictions: the checkpoints die with their KV blocks, so KV binds.
    log = STATE_BOUND.replace("evicted=900 orphaned=300", "evicted=900 orphaned=901")
    assert diagnose(log).binds == "kv"


def test_paged_hit_lower_binds_kv_without_orphans():
    log = KV_BOUND.replace("evicted=100 orphaned=700", "evicted=100 orphaned=0")
    d = diagnose(log)
    assert d.binds == "kv"
    assert d.orphan_note is None
    assert any("paged_hit is the lower factor" in line for line in d.lines)


def test_little_eviction_binds_neither_and_points_at_placement():
    # 40 slots kept 1,500 -> at least 1,460 lost; 700 evicted is 47.9% < 50%.
    log = STATE_BOUND.replace("evicted=900 orphaned=300", "evicted=700 orphaned=100")
    d = diagnose(log)
    assert d.binds == "neither"
    assert d.orphan_note is None  # 100 / 800 = 12.5%
    assert any("placed" in line for line in d.lines)
    assert "(the core's own lower-factor label says binds=state)" in d.lines


def test_eviction_share_threshold_is_inclusive():
    # exactly half of kept - num_slots = 1,460 -> 730
    log = STATE_BOUND.replace("evicted=900 orphaned=300", "evicted=730 orphaned=0")
    assert diagnose(log).binds == "state"
    log = STATE_BOUND.replace("evicted=900 orphaned=300", "evicted=729 orphaned=0")
    assert diagnose(log).binds == "neither"
    assert dg.STATE_EVICTION_SHARE_BINDS == 0.5
    assert dg.ORPHAN_SHARE_NOTE == 0.25


def test_kept_below_slot_count_uses_max_one():
    # kept <= num_slots: the forced-loss floor is max(1, kept - num_slots) = 1
    log = STATE_BOUND.replace("kept=1500", "kept=30").replace("evicted=900 orphaned=300", "evicted=1 orphaned=0")
    d = diagnose(log)
    assert d.binds == "state"
    assert any("(100.00% of max(1, kept - num_slots))" in line for line in d.lines)


def test_vllm_prefixes_and_last_complete_set():
    prefix = "INFO 11-29 14:00:00 [stats.py:12] "
    older = "".join(prefix + line + "\n" for line in KV_BOUND.splitlines())
    newer = "".join(
        f"(EngineCore_0 pid=123) {prefix}{line}\n" for line in STATE_BOUND.splitlines()
    )
    # A set cut short after the newest complete one must be ignored.
    truncated = prefix + STATE_BOUND.splitlines()[0].replace("cached=4700000", "cached=1") + "\n"
    noise = "WARNING 11-29 14:00:01 [scheduler.py:99] something else [x] a=b\n"
    d = diagnose(older + noise + newer + truncated)
    assert d.binds == "state"
    assert d.values["Cache Stats"]["cached"] == 4_700_000
    assert d.state_ceiling_hit == pytest.approx(0.98)


def test_parse_line_types():
    tag, values = parse_line(
        "INFO 11-29 14:00:00 [file.py:12] [Cache Pools] paged_hit=0.9800 state_hit=0.9592 "
        "combined=0.9400 binds=state"
    )
    assert tag == "Cache Pools"
    assert values == {"paged_hit": 0.98, "state_hit": 0.9592, "combined": 0.94, "binds": "state"}
    assert parse_line("INFO 11-29 14:00:00 [file.py:12] hello") is None


def test_optional_lines_may_be_absent():
    lines = [
        line for line in STATE_BOUND.splitlines()
        if not line.startswith(("[Cache Freq]", "[Pool Pressure]"))
    ]
    d = diagnose("\n".join(lines))
    assert d.binds == "state"
    assert not any(line.startswith(("requests:", "pools at")) for line in d.lines)


def test_missing_line_names_it():
    log = "\n".join(l for l in STATE_BOUND.splitlines() if "[Checkpoint Fates]" not in l)
    with pytest.raises(ValueError, match=r"\[Checkpoint Fates\]"):
        diagnose(log)


def test_empty_log_names_every_required_line():
    with pytest.raises(ValueError) as err:
        diagnose("INFO nothing to see\n")
    msg = str(err.value)
    for tag in ("[Cache Stats]", "[Cache Pools]", "[Checkpoint Fates]"):
        assert tag in msg


def test_missing_key_names_it():
    log = STATE_BOUND.replace(" orphaned=300", "")
    with pytest.raises(ValueError, match=r"\[Checkpoint Fates\] orphaned"):
        last_complete_set(log)


def test_set_split_across_no_complete_set():
    # Every required line appears, but never together in one set.
    lines = STATE_BOUND.splitlines()
    stats, pools, fates = lines[0], lines[1], lines[3]
    log = "\n".join([stats, pools, stats, fates])
    with pytest.raises(ValueError, match=r"last set lacks \[Cache Pools\]"):
        diagnose(log)


# -- the vLLM plugin's lines: one shared pool ----------------------------------

PLUGIN_KV_BOUND = """\
(EngineCore pid=7) INFO 12-02 10:00:00 [planner.py:160] [Cache Stats] admissions=300 reusable=2000000 cached=1500000 hit=0.7500 lost_to_checkpoint=100000 lost_unrecoverable=400000
(EngineCore pid=7) INFO 12-02 10:00:00 [planner.py:160] [Cache Pools] paged_hit=0.8000 state_hit=0.9375 combined=0.7500 binds=kv
(EngineCore pid=7) INFO 12-02 10:00:00 [planner.py:160] [Cache Freq] requests=300 full_reuse=200 paged_match_state_miss=30 checkpoint_would_fix=20 paged_miss=70
(EngineCore pid=7) INFO 12-02 10:00:00 [planner.py:160] [Shared Pool] pages=1413 used=1380 free=33 states_written=900 states_read=260
(EngineCore pid=7) INFO 12-02 10:00:00 [planner.py:160] [Checkpoint Kinds] anchor=600 demand=40 cut=30 fallback=0 cold=100 span=0 insurance=20 ladder=0 decode=0 junction=110 interior=0 floor_holds=250
"""


def test_the_plugin_lines_get_the_shared_pool_verdict():
    d = diagnose(PLUGIN_KV_BOUND)
    assert (d.source, d.binds) == ("plugin", "kv")
    assert d.state_ceiling_hit == pytest.approx(0.8)
    assert d.lines[0] == ("hit 75.00% of 2,000,000 reusable tokens over 300 admissions = "
                          "paged_hit 80.00% x state_hit 93.75%")
    assert ("shared pool at the last report: 1,413 pages, 1,380 used, 33 free; 900 states "
            "written, 260 resumes read one") in d.lines
    verdict = [line for line in d.lines if line.startswith("binds:")]
    assert verdict == ["binds: kv - the pool cut prefixes before their next turn came back; more "
                       "KV cache memory is the lever (a larger --gpu-memory-utilization, a "
                       "smaller --max-model-len or --max-num-seqs), and the admission gate, "
                       "off here (ATOM_ADMISSION_GATE=on forces it)"]
    assert ("checkpoints written by kind: anchor 600, demand 40, cut 30, cold 100, insurance 20, "
            "junction 110") in d.lines


def test_a_plugin_set_losing_to_missing_states_binds_state_and_names_the_gate():
    log = (PLUGIN_KV_BOUND.replace("lost_to_checkpoint=100000 lost_unrecoverable=400000",
                                   "lost_to_checkpoint=400000 lost_unrecoverable=100000")
           + "[Admission Gate] held_steps=12 holds=30 longest_hold=4\n")
    d = diagnose(log)
    assert d.binds == "state"
    assert any(line.startswith("binds: state - KV prefixes were held with no state at their end")
               for line in d.lines)
    assert ("the admission gate held 30 waiting requests over 12 steps (longest hold 4 steps)"
            in d.lines)


def test_the_planner_lines_are_what_diagnose_reads():
    from atom_hybrid_cache.config import PlacementConfig
    from atom_hybrid_cache.core.planner import CheckpointPlanner
    from atom_hybrid_cache.core.policy import CheckpointPolicy
    from atom_hybrid_cache.core.slot_share import SlotShare
    policy = CheckpointPolicy(PlacementConfig(), block_size=128,
                              share=SlotShare(4096, 0, 1, in_flight=1))
    p = CheckpointPlanner(policy, hash_unit=64, stats_log_interval=0,
                          pool_state=lambda: dict(pages=100, used=60, free=40))
    p.finished("old", [f"h{i}" for i in range(10)], [])
    p.plan("a", 700, [f"h{i}" for i in range(10)], hit=640, kv_reach=640)
    p.admitted("a", 640)
    d = diagnose("\n".join(p.stats_lines()))
    assert (d.source, d.binds) == ("plugin", "neither")
    assert d.values["Shared Pool"] == dict(pages=100, used=60, free=40, states_written=0,
                                           states_read=1)
    assert d.values["Cache Stats"]["cached"] == 640


def test_a_plugin_set_without_its_pool_line_names_it():
    log = "\n".join(line for line in PLUGIN_KV_BOUND.splitlines() if "[Shared Pool]" not in line)
    with pytest.raises(ValueError, match=r"\(the replay planner's lines\) or \[Cache Stats\], "
                                         r"\[Cache Pools\], \[Shared Pool\]"):
        diagnose(log)
