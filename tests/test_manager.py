"""HybridCacheManager: the resume rule, checkpoint placement, chunk cuts,
slot widths, stats, configuration.

Placement knobs the lead engineer tunes (cut_backoff, fallback_fractions,
protected_per_seq, headroom) are passed explicitly here, so these tests
check rules, never tuned defaults.
"""

import dataclasses
import logging

import pytest

from atom_hybrid_cache.config import ConfigError, PlacementConfig, Settings, apply_env
from atom_hybrid_cache.core.replay_pool_config import ReplayPoolConfig
from atom_hybrid_cache.core.hashing import ROOT_PARENT, hash_block, hash_blocks, split_full_blocks
from atom_hybrid_cache.core.manager import HybridCacheManager, Request
from atom_hybrid_cache.core.stats import NestingError
from atom_hybrid_cache.diagnose import diagnose

B = 4


# Tuning knobs pinned to values that keep extra targets out of the way; a knob
# the lead engineer has not added (or has renamed) yet is left alone.
PINNED = {"cut_backoff": 0.0, "cut_backoffs": (), "fallback_fractions": (), "protected_per_seq": 2,
          "protected_kinds": ("anchor", "cut"), "insure_recompute_tokens": 1 << 30}
PLACEMENT_FIELDS = {f.name for f in dataclasses.fields(PlacementConfig)}


def make_cfg(**kw):
    p = {"interval_tokens": -1, "anchor_margin_tokens": 1, "eviction": "reuse-aware"}
    p.update({k: v for k, v in PINNED.items() if k in PLACEMENT_FIELDS})
    p.update({k: kw.pop(k) for k in list(kw) if k in PLACEMENT_FIELDS})
    c = {"block_size": B, "num_kv_blocks": 64, "max_num_seqs": 4, "num_spec": 0,
         "state_checkpoint_slots": 8, "successor_room": 1, "strict_stats": True}
    c.update(kw)
    return ReplayPoolConfig(placement=PlacementConfig(**p), **c)


def make_manager(warnings=None, **kw):
    warn = (lambda msg: None) if warnings is None else warnings.append
    return HybridCacheManager(make_cfg(**kw), warn=warn)


def toks(seed, n):
    return [seed * 1000 + i for i in range(n)]


def make_req(rid, tokens, block=B):
    bt = split_full_blocks(tokens, block)
    return Request(rid, len(tokens), hash_blocks(bt), bt)


def admit(m, req):
    """Admit and check the resume rule on every admission."""
    adm = m.admit(req)
    if adm is not None and adm.hit_tokens:
        h = req.block_hashes[adm.hit_tokens // m.block_size - 1]
        assert req.resumed_from == h and m.state.has(h), "resumed without a checkpoint"
    return adm


def prefill(m, req, budget=10_000, after_each=None):
    chunks = []
    while req.num_computed < req.prompt_len:
        n = m.next_chunk(req, budget)
        assert 0 < n <= budget
        m.prefill_done(req, n)
        chunks.append(n)
        if after_each is not None:
            after_each(req)
    return chunks


def serve(m, rid, tokens, budget=10_000, block=B):
    req = make_req(rid, tokens, block)
    adm = admit(m, req)
    assert adm is not None
    chunks = prefill(m, req, budget)
    return req, adm, chunks


def decode(m, req, n, uid, step=1):
    """Append n decoded tokens, `step` at a time; the caller's part (as the
    simulator's grow()) is adding hashes/tokens of the blocks they fill."""
    Bs = m.block_size
    done = 0
    while done < n:
        k = min(step, n - done)
        hs, ts = req.block_hashes, req.block_tokens
        for i in range(req.num_tokens // Bs, (req.num_tokens + k) // Bs):
            if i < len(hs):
                continue
            t = (-uid, i)
            hs.append(hash_block(hs[i - 1] if i else ROOT_PARENT, t))
            ts.append(t)
        assert m.append_tokens(req, k)
        done += k


def checkpoint_kinds(m):
    return {i.position: i.kind for i in m.state.slot_info if i is not None}


def tiers(m):
    """Checkpoint positions in eviction order (head first): (plain, protected)."""
    st = m.state
    return ([st.slot_info[s].position for s in st._plain],
            [st.slot_info[s].position for s in st._protected])


# -- the resume rule -------------------------------------------------------

def test_kv_hit_without_checkpoint_never_resumes():
    m = make_manager()
    A = toks(1, 20)
    r, adm, _ = serve(m, "a1", A)
    m.finish(r)
    r, adm, _ = serve(m, "a2", A)
    assert adm.hit_tokens == 16  # resumes at the anchor
    m.finish(r)
    for h in list(m.state.index):
        m.state.invalidate(h)
    lost = m.stats.as_dict()["lost_to_checkpoint"]
    miss = m.stats.paged_match_state_miss
    r = make_req("a3", A)
    assert len(m.kv.prefix_blocks(r.block_hashes, r.block_tokens, 4)) == 4  # KV all there
    adm = admit(m, r)
    assert adm.kv_reach == 16
    assert adm.hit_tokens == 0 and r.num_computed == 0
    assert adm.resume_kind is None and r.resumed_from is None
    assert m.stats.as_dict()["lost_to_checkpoint"] - lost == 16
    assert m.stats.paged_match_state_miss == miss + 1


def test_no_checkpoint_slot_means_no_resume():
    # one state slot, held by the request itself when its anchor comes due
    m = make_manager(max_num_seqs=1, state_checkpoint_slots=0)
    A = toks(1, 20)
    r, _, _ = serve(m, "a1", A)
    assert m.state.fates.dropped == 1 and m.state.fates.kept == 0
    assert m.stats.written_by_kind == {}
    m.finish(r)
    r, adm, _ = serve(m, "a2", A)
    assert adm.kv_reach == 16 and adm.hit_tokens == 0
    assert m.stats.as_dict()["lost_to_checkpoint"] == 16


def test_admission_never_evicts_the_checkpoint_it_resumes_from():
    # 2 sequences + 1 headroom slot = 3 state slots, steady state: every
    # slot that is not working holds a checkpoint.
    m = make_manager(max_num_seqs=2, state_checkpoint_slots=1)
    A = toks(1, 20)
    ra, _, _ = serve(m, "a", A)          # A's anchor at 16 (oldest checkpoint)
    m.finish(ra)
    rd, _, _ = serve(m, "d", toks(2, 20))  # D's anchor
    m.finish(rd)
    rb, _, _ = serve(m, "b", [7, 7])     # a live request without a checkpoint
    assert m.state.num_vacant == 0 and m.state.num_checkpoints == 2
    r = make_req("a-again", A)
    adm = m.admit(r)                     # 2 live requests: within max_num_seqs
    assert adm is not None
    assert adm.resume_kind != "block"    # "block" is the ceiling-only kind
    if adm.hit_tokens:
        h = r.block_hashes[adm.hit_tokens // B - 1]
        assert m.state.has(h) and r.resumed_from == h


@pytest.mark.parametrize("L,expected", [(16, 12), (17, 12), (18, 16), (19, 16), (20, 16)])
def test_last_block_never_reused(L, expected):
    m = make_manager()
    A = toks(1, L)
    r, _, _ = serve(m, "a1", A)
    m.finish(r)
    r, adm, _ = serve(m, "a2", A)
    anchor = max(0, (L - 1 - 1) // B * B)  # floor((L - room - margin)/B)*B
    assert expected == anchor
    assert adm.hit_tokens == anchor < L
    assert adm.kv_reach == (L - 1) // B * B  # never the block holding the last token


def test_checkpoint_covering_the_whole_prompt_is_not_used():
    m = make_manager(anchor_margin_tokens=0)
    P = toks(1, 16)
    r, _, _ = serve(m, "long", P + toks(2, 4))  # anchor at (20-1)//4*4 = 16
    assert checkpoint_kinds(m) == {16: "anchor"}
    m.finish(r)
    r = make_req("exact", P)
    assert m.state.has(r.block_hashes[3])       # a state after all 16 tokens exists
    adm = admit(m, r)
    assert adm.kv_reach == 12 and adm.hit_tokens == 0


# -- interval modes ---------------------------------------------------------

def test_interval_minus_one_anchor_only_and_no_decode_checkpoints():
    m = make_manager(interval_tokens=-1)
    assert m.interval == -1 and m.checkpointing
    r, _, _ = serve(m, "a", toks(1, 30))
    assert m.stats.written_by_kind == {"anchor": 1}
    assert checkpoint_kinds(m) == {28: "anchor"}
    decode(m, r, 60, uid=1)  # 15 blocks of decode
    assert r.num_tokens == 90
    assert "decode" not in m.stats.written_by_kind
    assert "ladder" not in m.stats.written_by_kind
    assert m.stats.written_by_kind == {"anchor": 1}
    assert m.state.num_checkpoints == 1


def test_interval_zero_writes_nothing_and_never_hits():
    m = make_manager(interval_tokens=0)
    assert not m.checkpointing
    A = toks(1, 30)
    for i in range(3):
        r, adm, _ = serve(m, f"a{i}", A)
        assert adm.hit_tokens == 0
        if i:
            assert adm.kv_reach == 28
        decode(m, r, 20, uid=i + 1, step=3)
        m.finish(r)
    assert m.stats.written_by_kind == {}
    assert m.state.num_checkpoints == 0 and m.state.fates.kept == 0
    assert m.stats.cached == 0


def test_positive_interval_places_rungs_at_multiples():
    m = make_manager(interval_tokens=8)
    assert m.interval == 8
    A = toks(1, 30)
    r, _, _ = serve(m, "a", A)
    assert checkpoint_kinds(m) == {8: "ladder", 16: "ladder", 24: "ladder", 28: "anchor"}
    assert m.stats.written_by_kind == {"ladder": 3, "anchor": 1}
    decode(m, r, 40, uid=1, step=3)  # 30 -> 70: decode rungs at 32..64
    kinds = checkpoint_kinds(m)
    assert sorted(p for p, k in kinds.items() if k == "decode") == [32, 40, 48, 56, 64]
    assert m.stats.written_by_kind["decode"] == 5
    m.finish(r)
    # a rung is a resume point for a prompt that diverges after it
    _, adm, _ = serve(m, "b", A[:26] + toks(9, 10))
    assert adm.hit_tokens == 24 and adm.resume_kind == "ladder"


def test_interval_8192_multiple_of_block_is_used_unchanged():
    warnings = []
    m = make_manager(warnings, block_size=64, num_kv_blocks=300, interval_tokens=8192)
    assert m.interval == 8192 and warnings == []
    serve(m, "a", toks(1, 8392), block=64)
    assert checkpoint_kinds(m) == {8192: "ladder", 8384: "anchor"}


def test_interval_snapped_down_to_block_multiple():
    warnings = []
    m = make_manager(warnings, interval_tokens=6)
    assert m.interval == 4 and len(warnings) == 1
    serve(m, "a", toks(1, 14))
    # rungs at 4 and 8; 12 is the anchor (planned first, same position)
    assert checkpoint_kinds(m) == {4: "ladder", 8: "ladder", 12: "anchor"}


def test_interval_snapped_to_zero_turns_checkpointing_off():
    warnings = []
    m = make_manager(warnings, interval_tokens=3)
    assert m.interval == 0 and not m.checkpointing
    assert len(warnings) == 1 and "OFF" in warnings[0]
    A = toks(1, 20)
    r, _, _ = serve(m, "a1", A)
    m.finish(r)
    _, adm, _ = serve(m, "a2", A)
    assert adm.hit_tokens == 0 and adm.kv_reach == 16
    assert m.state.num_checkpoints == 0 and m.stats.written_by_kind == {}


# -- demand rung ---------------------------------------------------------------

def test_demand_rung_planned_at_kv_prefix_end():
    m = make_manager()
    P = toks(1, 20)  # 5 full blocks; its anchor at 16
    ra, _, chunks_a = serve(m, "a", P)
    assert chunks_a == [16, 4]
    m.finish(ra)
    rb = make_req("b", P + toks(2, 20))
    adm = admit(m, rb)
    assert adm.kv_reach == 20 and adm.hit_tokens == 16  # KV outran the checkpoints
    assert rb.targets.kinds == {20: "demand", 36: "anchor"}
    assert prefill(m, rb) == [4, 16, 4]
    info = m.state.info(rb.block_hashes[4])
    assert info.kind == "demand" and info.position == 20
    assert m.stats.cuts_by_kind == {"anchor": 2, "demand": 1}
    assert m.stats.written_by_kind == {"anchor": 2, "demand": 1}
    m.finish(rb)
    # the next request with that prefix resumes from the demand rung
    _, adm, _ = serve(m, "c", P + toks(3, 20))
    assert adm.hit_tokens == 20 and adm.resume_kind == "demand"


def test_demand_off_plans_no_demand_rung():
    m = make_manager(demand=False)
    P = toks(1, 20)
    ra, _, _ = serve(m, "a", P)
    m.finish(ra)
    rb = make_req("b", P + toks(2, 20))
    admit(m, rb)
    assert rb.targets.kinds == {36: "anchor"}
    assert prefill(m, rb) == [20, 4]
    assert "demand" not in m.stats.written_by_kind
    m.finish(rb)
    _, adm, _ = serve(m, "c", P + toks(3, 20))
    assert adm.hit_tokens == 16


def _needs(field):
    if field not in PLACEMENT_FIELDS:
        pytest.skip(f"PlacementConfig has no {field} (renamed or removed)")


def _demand_scenario(**kw):
    m = make_manager(**kw)
    P = toks(1, 20)
    ra, _, _ = serve(m, "a", P)
    m.finish(ra)
    rb, _, _ = serve(m, "b", P + toks(2, 20))
    return m, rb.block_hashes[4]


def test_demand_rung_is_a_guess_unless_its_kind_is_protected():
    _needs("protected_kinds")
    m, h = _demand_scenario(protected_kinds=("anchor", "cut"))
    assert not m.state.is_protected(h)
    assert tiers(m)[0][0] == 20  # filed at the plain head
    m, h = _demand_scenario(protected_kinds=("anchor", "cut", "demand"))
    assert m.state.is_protected(h)
    assert 20 in tiers(m)[1]


def test_insurance_fallback_below_anchor_from_the_threshold():
    _needs("insure_recompute_tokens")
    A = toks(1, 30)  # anchor at 28
    one_block = {"insure_distance_tokens": B} if "insure_distance_tokens" in PLACEMENT_FIELDS else {}
    m = make_manager(insure_recompute_tokens=30, **one_block)  # recomputes 30 >= 30
    r = make_req("a", A)
    admit(m, r)
    assert r.targets.kinds == {24: "insurance", 28: "anchor"}
    m = make_manager(insure_recompute_tokens=31, **one_block)  # recomputes 30 < 31
    r = make_req("a", A)
    admit(m, r)
    assert r.targets.kinds == {28: "anchor"}


@pytest.mark.parametrize("distance,expected", [(0, 24), (1, 24), (4, 24), (5, 20), (8, 20),
                                               (9, 16)])
def test_insurance_distance_rounds_up_to_whole_blocks_at_least_one(distance, expected):
    _needs("insure_distance_tokens")
    m = make_manager(insure_recompute_tokens=1, insure_distance_tokens=distance)
    r = make_req("a", toks(1, 30))  # anchor at 28
    admit(m, r)
    assert r.targets.kinds == {expected: "insurance", 28: "anchor"}


def test_insurance_needs_room_above_the_hit():
    _needs("insure_distance_tokens")
    m = make_manager(insure_recompute_tokens=1, insure_distance_tokens=4)
    A = toks(1, 30)
    r, _, _ = serve(m, "a", A[:26])  # its anchor at 24
    m.finish(r)
    r = make_req("b", A)  # hit 24, anchor 28: 24 is not above the hit
    assert admit(m, r).hit_tokens == 24
    assert r.targets.kinds == {28: "anchor"}


def test_insurance_threshold_zero_means_never():
    _needs("insure_recompute_tokens")
    m = make_manager(insure_recompute_tokens=0)
    r = make_req("a", toks(1, 30))
    admit(m, r)
    assert r.targets.kinds == {28: "anchor"}


# -- environment ------------------------------------------------------------------

DEMAND = "ATOM_STATE_CHECKPOINT_DEMAND"


def make_settings(**placement) -> Settings:
    return Settings(placement=PlacementConfig(**placement))


@pytest.mark.parametrize("base", [True, False])
def test_env_demand_unset_leaves_it_unchanged(base):
    cfg = make_settings(demand=base)
    assert apply_env(cfg, {}).placement.demand is base
    assert apply_env(cfg, {"PATH": "/bin", "HOME": "/x"}).placement.demand is base


def test_env_demand_unset_in_process_environment(monkeypatch):
    import os
    for var in [v for v in os.environ if v.startswith("ATOM_")]:
        monkeypatch.delenv(var)
    assert apply_env(make_settings(demand=False)).placement.demand is False
    monkeypatch.setenv(DEMAND, "1")
    assert apply_env(make_settings(demand=False)).placement.demand is True


@pytest.mark.parametrize("base", [True, False])
def test_env_demand_one_and_zero(base):
    cfg = make_settings(demand=base)
    assert apply_env(cfg, {DEMAND: "1"}).placement.demand is True
    assert apply_env(cfg, {DEMAND: "0"}).placement.demand is False
    # nothing else changes
    assert apply_env(cfg, {DEMAND: "1"}).placement.interval_tokens == cfg.placement.interval_tokens


@pytest.mark.parametrize("raw", ["yes", "true", "", "2"])
def test_env_demand_other_values_rejected(raw):
    with pytest.raises(ConfigError, match=DEMAND):
        apply_env(make_settings(), {DEMAND: raw})


def test_env_unknown_atom_variable_rejected():
    with pytest.raises(ConfigError, match="ATOM_FOO"):
        apply_env(make_settings(), {"ATOM_FOO": "1"})


def test_env_interval_not_an_integer_rejected():
    with pytest.raises(ConfigError, match="ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS"):
        apply_env(make_settings(), {"ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS": "abc"})


def test_env_interval_parsed():
    cfg = apply_env(make_settings(), {"ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS": " 64 "})
    assert cfg.placement.interval_tokens == 64


def test_env_negative_slots_rejected_naming_the_setting():
    with pytest.raises(ConfigError, match="state_checkpoint_slots"):
        apply_env(make_settings(), {"ATOM_STATE_CHECKPOINT_SLOTS": "-1"})


# -- orphaning -------------------------------------------------------------------

def test_evicting_kv_block_under_checkpoint_orphans_it():
    m = make_manager(num_kv_blocks=9)  # 8 usable blocks
    A = toks(1, 14)  # 3 full blocks + a partial; anchor at 12 (block 2)
    ra, _, _ = serve(m, "a", A)
    h = ra.block_hashes[2]
    assert m.state.has(h)
    m.finish(ra)
    assert m.kv.num_vacant == 5 and m.kv.num_cached_free == 3
    assert m.state.fates.orphaned == 0
    # 6 blocks: the 5 vacant and then the LRU cached block, A's tail block
    filler = make_req("f", toks(2, 24))
    assert admit(m, filler) is not None
    assert m.kv.evicted == 1
    assert m.state.fates.orphaned == 1
    assert not m.state.has(h)
    assert m.state.num_checkpoints == 0
    m.finish(filler)
    _, adm, _ = serve(m, "a2", A)
    assert adm.hit_tokens == 0


def test_preempt_gives_everything_back_and_readmission_hits_what_it_left():
    m = make_manager()
    A = toks(1, 14)  # anchor at 12
    r, _, _ = serve(m, "a", A)
    decode(m, r, 10, uid=1)
    assert r.num_tokens == 24 and len(r.block_hashes) == 6
    m.preempt(r)
    assert r.num_computed == 0 and r.num_tokens == 14
    assert len(r.block_hashes) == len(r.block_tokens) == 3  # decoded blocks dropped
    assert r.blocks == [] and r.working_slots == [] and len(r.targets) == 0
    assert "a" not in m.running and not r.admitted
    assert m.kv.num_used == 0 and m.state.num_working == 0
    adm = admit(m, r)
    assert adm.hit_tokens == 12 and adm.resume_kind == "anchor"
    assert prefill(m, r) == [2]


def test_preempt_mid_prefill():
    m = make_manager(interval_tokens=8)
    r = make_req("a", toks(1, 30))
    admit(m, r)
    m.prefill_done(r, m.next_chunk(r, 10_000))  # to 8
    m.preempt(r)
    assert r.num_computed == 0 and len(r.targets) == 0
    adm = admit(m, r)
    assert adm.hit_tokens == 8
    assert prefill(m, r) == [8, 8, 4, 2]


def test_kv_admission_counts_free_hit_blocks_it_will_take():
    m = make_manager(num_kv_blocks=9)  # 8 usable
    P = toks(1, 20)  # 5 full blocks, anchor at 16
    ra, _, _ = serve(m, "a", P)
    m.finish(ra)
    assert m.kv.num_cached_free == 5 and m.kv.num_vacant == 3
    # 9 blocks: 5 hit (free, cached) + 4 new, but only 3 others are free
    assert admit(m, make_req("b", P + toks(2, 16))) is None
    assert m.kv.num_cached_free == 5 and m.kv.num_vacant == 3
    assert m.kv.evicted == 0 and m.state.fates.orphaned == 0
    # 8 blocks: 5 hit + 3 new fits exactly, evicting nothing
    r, adm, _ = serve(m, "c", P + toks(2, 12))
    assert adm.hit_tokens == 16
    assert m.kv.num_free == 0 and m.kv.evicted == 0


# -- eviction filing ------------------------------------------------------------------

def test_reuse_aware_files_guesses_at_head_and_protects_the_anchor():
    m = make_manager(interval_tokens=8, eviction="reuse-aware")
    r, _, _ = serve(m, "a", toks(1, 30))
    assert tiers(m) == ([24, 16, 8], [28])
    decode(m, r, 20, uid=1)  # decode rungs 32, 40, 48: guesses too
    assert tiers(m) == ([48, 40, 32, 24, 16, 8], [28])


def test_reuse_aware_anchor_at_tail_when_nothing_is_protected():
    m = make_manager(interval_tokens=8, eviction="reuse-aware", protected_per_seq=0)
    serve(m, "a", toks(1, 30))
    assert tiers(m) == ([24, 16, 8, 28], [])


def test_lru_files_everything_at_tail():
    m = make_manager(interval_tokens=8, eviction="lru")
    r, _, _ = serve(m, "a", toks(1, 30))
    assert tiers(m) == ([8, 16, 24, 28], [])
    decode(m, r, 20, uid=1)
    assert tiers(m) == ([8, 16, 24, 28, 32, 40, 48], [])


# -- chunk cuts ----------------------------------------------------------------------

@pytest.mark.parametrize("budget,expected", [
    (10_000, [8, 8, 8, 4, 2]),
    (12, [8, 8, 8, 4, 2]),
    (5, [5, 3, 5, 3, 5, 3, 4, 2]),
])
def test_prefill_chunks_end_exactly_on_targets(budget, expected):
    m = make_manager(interval_tokens=8)
    r = make_req("a", toks(1, 30))
    admit(m, r)
    seen = []

    def check(req):
        # the checkpoint at a forward's end exists right after that forward
        seen.append(sorted(checkpoint_kinds(m)))
    assert prefill(m, r, budget, check) == expected
    ends = [sum(expected[:i + 1]) for i in range(len(expected))]
    for end, positions in zip(ends, seen):
        assert positions == [p for p in (8, 16, 24, 28) if p <= end]
    assert m.stats.cuts_by_kind == {"ladder": 3, "anchor": 1}


@pytest.mark.parametrize("budget,expected,after", [
    (10_000, [30], [[8, 16, 24, 28]]),
    (12, [12, 12, 6], [[8], [8, 16, 24], [8, 16, 24, 28]]),
])
def test_interior_readable_chunks_not_cut_same_checkpoints(budget, expected, after):
    m = make_manager(interval_tokens=8, interior_states_readable=True)
    r = make_req("a", toks(1, 30))
    admit(m, r)
    seen = []
    assert prefill(m, r, budget, lambda req: seen.append(sorted(checkpoint_kinds(m)))) == expected
    assert seen == after
    assert checkpoint_kinds(m) == {8: "ladder", 16: "ladder", 24: "ladder", 28: "anchor"}
    assert m.stats.cuts_by_kind == {}


# -- per-need width ---------------------------------------------------------------------

def test_each_live_request_holds_one_plus_num_spec_slots():
    m = make_manager(max_num_seqs=2, num_spec=2, state_checkpoint_slots=0)
    assert m.state.num_slots == 6
    r1, _, _ = serve(m, "r1", [1, 2, 3])
    r2, _, _ = serve(m, "r2", [4, 5, 6])
    assert len(r1.working_slots) == 3 and len(r2.working_slots) == 3
    assert not set(r1.working_slots) & set(r2.working_slots)
    free_kv = m.kv.num_free
    r3 = make_req("r3", [7, 8, 9])
    assert admit(m, r3) is None
    assert not r3.admitted and r3.blocks == [] and r3.working_slots == []
    assert m.kv.num_free == free_kv and "r3" not in m.running
    assert m.stats.admissions == 2
    m.finish(r1)
    assert admit(m, r3) is not None
    assert len(r3.working_slots) == 3


def test_admission_without_kv_room_takes_no_slots():
    m = make_manager(num_kv_blocks=5)  # 4 usable blocks
    r1, _, _ = serve(m, "r1", toks(1, 12))
    vacant = m.state.num_vacant
    assert admit(m, make_req("r2", toks(2, 8))) is None
    assert m.state.num_vacant == vacant


# -- stats --------------------------------------------------------------------------------

def test_nesting_violation_raises_when_strict():
    m = make_manager(strict_stats=True)
    with pytest.raises(NestingError):
        m.stats.record_admission(10, 4, 4, 4, 8)  # cached > wanted


def test_nesting_violation_warns_when_live(caplog):
    m = make_manager(strict_stats=False)
    with caplog.at_level(logging.WARNING, logger="atom_hybrid_cache"):
        m.stats.record_admission(10, 4, 4, 4, 8)
    assert any("nesting" in rec.getMessage() and rec.levelno == logging.WARNING
               for rec in caplog.records)
    assert m.stats.admissions == 1


def test_stats_nest_past_the_oracle_limit():
    m = HybridCacheManager(make_cfg(strict_stats=True), warn=lambda msg: None, oracle_limit=1)
    A = toks(1, 20)
    r, _, _ = serve(m, "a1", A)
    m.finish(r)
    serve(m, "a2", A)  # KV reaches 16 tokens, the oracle only knows 1 block


def test_stats_lines_format_and_diagnose_parses_them():
    m = make_manager(interval_tokens=8)
    A = toks(1, 30)
    r, _, _ = serve(m, "a1", A)
    m.finish(r)
    serve(m, "a2", A)
    lines = m.stats_lines()
    assert len(lines) == 6
    tags = ["[Cache Stats]", "[Cache Pools]", "[Cache Freq]", "[Checkpoint Fates]",
            "[Pool Pressure]", "[Checkpoint Kinds]"]
    for line, tag in zip(lines, tags):
        assert line.startswith(tag)
    d = diagnose("\n".join(lines))
    assert d.values["Cache Stats"]["cached"] == m.stats.cached == 28
    assert d.values["Cache Stats"]["reusable"] == m.stats.reusable
    assert d.values["Checkpoint Fates"]["kept"] == m.state.fates.kept
    assert d.values["Checkpoint Fates"]["num_slots"] == m.state.num_slots
    assert d.values["Pool Pressure"]["state_total"] == m.state.num_slots
    assert d.binds in ("state", "kv", "neither")


def test_stats_lines_logged_every_interval():
    logged = []
    m = HybridCacheManager(make_cfg(stats_log_interval=2), warn=lambda msg: None,
                           log=logged.append)
    r, _, _ = serve(m, "a", [1, 2, 3])
    assert logged == []
    serve(m, "b", [4, 5, 6])
    assert len(logged) == 6 and logged[0].startswith("[Cache Stats]")


# -- bad config -------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,name", [
    (dict(block_size=0), "block_size"),
    (dict(num_kv_blocks=1), "num_kv_blocks"),
    (dict(state_checkpoint_slots=-1), "state_checkpoint_slots"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(num_spec=-1), "num_spec"),
])
def test_bad_cache_config_names_the_setting(kw, name):
    with pytest.raises(ConfigError, match=name):
        ReplayPoolConfig(**kw)


def test_unknown_eviction_policy_names_the_setting():
    with pytest.raises(ConfigError, match="eviction"):
        ReplayPoolConfig(placement=PlacementConfig(eviction="fifo"))


def test_interval_below_minus_one_names_the_setting():
    with pytest.raises(ConfigError, match="state_checkpoint_interval_tokens"):
        ReplayPoolConfig(placement=PlacementConfig(interval_tokens=-2))
