"""The store connector's vLLM-free parts: the joint boundary, the keys, the
object framing, what the release registers and what an eviction spills,
the scheduler's index of the store, the counters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from atom_hybrid_cache.connector.counters import ConnectorCounters
from atom_hybrid_cache.connector.joint_boundary import joint_boundary
from atom_hybrid_cache.connector.keys import (ObjectKey, StoreLayout, kv_key, state_key,
                                              unit_hashes)
from atom_hybrid_cache.connector.spill_registry import SpillRegistry
from atom_hybrid_cache.connector.store_index import StoreIndex
from atom_hybrid_cache.core.eviction import FreedState, KVPages, freed_units

UNIT, B = 64, 128


def boundary(local, n, kv_upto, states, max_probes=24, every_unit=False):
    """Full KV pages 0..kv_upto-1 held; `states` the held state positions."""
    probed = []

    def state_held(p):
        probed.append(p)
        return p in states

    jb = joint_boundary(local=local, num_tokens=n, unit=UNIT, block_size=B,
                        kv_pages_held=lambda first, last: max(0, min(kv_upto, last + 1) - first),
                        state_held=state_held, max_probes=max_probes, every_unit=every_unit)
    return jb, probed


# -- the joint boundary ------------------------------------------------------

def test_the_boundary_is_the_highest_state_the_kv_below_reaches():
    # KV pages 0..5 held (tokens < 768), states at 384, 704 and 960: 960
    # would need page 6 as a plain page (its state object brings page 7
    # only), so J = 704; its KV leg is pages 0..4, page 5 comes with the state
    jb, _ = boundary(0, 2000, 6, {384, 704, 960}, every_unit=True, max_probes=1000)
    assert (jb.position, list(jb.kv_pages)) == (704, [0, 1, 2, 3, 4])
    # probing page boundaries below the top page only (a remote tier's
    # round trips), 704 is passed over for 384
    jb, _ = boundary(0, 2000, 6, {384, 704, 960})
    assert (jb.position, list(jb.kv_pages)) == (384, [0, 1])


def test_never_past_the_state_never_past_the_kv_never_the_last_token():
    # KV everywhere, the only state at the prompt's last token: not usable
    jb, _ = boundary(0, 1024, 100, {1024})
    assert jb.position is None and jb.reason == "no state above the GPU's hit"
    jb, _ = boundary(0, 1024, 100, {1024, 960})
    assert jb.position == 960            # J <= n - 1 = 1023, on a unit: 960
    jb, _ = boundary(0, 1025, 100, {1024})
    assert jb.position == 1024           # one token left to compute
    # KV held only up to 256: a state at 512 cannot be reached
    jb, _ = boundary(0, 2000, 2, {512})
    assert jb.position is None
    # nor one at or below the GPU's own hit
    jb, _ = boundary(512, 2000, 100, {512, 384})
    assert jb.position is None and jb.reason == "no state above the GPU's hit"
    jb, _ = boundary(512, 2000, 100, {640})
    assert (jb.position, list(jb.kv_pages)) == (640, [])
    jb, _ = boundary(1024, 1025, 100, {1024})
    assert jb.reason == "nothing beyond the GPU's hit"


def test_probes_every_unit_of_the_top_page_then_page_boundaries():
    _, probed = boundary(0, 2000, 4, set())
    # KV to 512 (pages 0..3), the state object's page 4: cap 640
    assert probed == [640, 576, 512, 384, 256, 128]
    _, probed = boundary(0, 2000, 100, set(), max_probes=3)
    assert len(probed) == 3


# -- keys -------------------------------------------------------------------

def test_unit_hashes_chain_and_extend():
    tokens = list(range(300))
    full = unit_hashes(tokens, UNIT)
    assert len(full) == 4
    assert unit_hashes(tokens, UNIT, full[:2]) == full
    assert unit_hashes(tokens[:200] + [9] * 100, UNIT)[:3] == full[:3]
    assert unit_hashes(tokens[:200] + [9] * 100, UNIT)[3] != full[3]
    assert state_key(full, UNIT, 192) == ObjectKey("state", full[2], 192)
    assert kv_key(full, UNIT, B, 3, 1) == ObjectKey("kv", full[3], 256, 3)


def test_the_fingerprint_names_model_block_and_pages():
    a = StoreLayout("m|float32", 128, (100, 100), (50,))
    assert a.fingerprint == StoreLayout("m|float32", 128, (100, 100), (50,)).fingerprint
    assert a.fingerprint != StoreLayout("m|bfloat16", 128, (100, 100), (50,)).fingerprint
    assert a.fingerprint != StoreLayout("m|float32", 64, (100, 100), (50,)).fingerprint
    assert a.state_object_bytes == 250


# -- framing ------------------------------------------------------------------

def test_a_header_names_its_object_and_its_digest_catches_a_flipped_byte():
    np = pytest.importorskip("numpy")
    from atom_hybrid_cache.connector.framing import CorruptObject, check, header
    key = ObjectKey("state", 12345, 960)
    payload = np.arange(1000, dtype=np.uint8)
    head = header(key, payload)
    check(key, head, payload)
    bad = payload.copy()
    bad[500] ^= 1
    with pytest.raises(CorruptObject, match="digest"):
        check(key, head, bad)
    with pytest.raises(CorruptObject, match="another prefix"):
        check(ObjectKey("state", 12345, 896), head, payload)
    with pytest.raises(CorruptObject, match="magic"):
        check(key, b"\0" * 64, payload)
    with pytest.raises(CorruptObject, match="payload of 999"):
        check(key, head, payload[:999])


# -- what the release registers, what an eviction spills ------------------------

class Block(SimpleNamespace):
    """A vLLM block: id and the hash it holds."""


def _blocks(first_id, n):
    return [Block(block_id=first_id + i, block_hash=f"h{first_id + i}") for i in range(n)]


def _freed(states_at, kv_pages):
    """Three state groups (0, 1, 2) with a page at each of `states_at`, one
    attention group (3) with `kv_pages` pages from 0."""
    states, sid = [], 1000
    for pos in states_at:
        for g in (0, 1, 2):
            states.append(FreedState(Block(block_id=sid, block_hash=f"s{sid}"), pos, True, g))
            sid += 1
    kv = KVPages(B, _blocks(0, kv_pages), [True] * kv_pages)
    return freed_units(states, [kv])


def _registry(index=None):
    counters = ConnectorCounters()
    layout = StoreLayout("m", B, (10, 10, 10), (40,))
    index = index or StoreIndex(1 << 30)
    return SpillRegistry(layout, UNIT, [0, 1, 2], [3], index, counters), index, counters


def test_an_evicted_state_spills_its_unit_and_kv_above_every_state_is_never_registered():
    reg, index, counters = _registry()
    hashes = unit_hashes(list(range(1100)), UNIT)
    # states at 384 and 960; KV pages 0..8 (page 8: tokens 1024..1151, above
    # every state)
    freed = _freed([384, 960], 9)
    reg.register(hashes, freed)
    assert 8 not in reg._by_block                     # no resume reads it
    top_state = freed.units[0].states[0]              # the state at 960, group 0
    reg.on_reuse(top_state)
    spills = reg.take()
    assert spills[0].key == state_key(hashes, UNIT, 960)
    assert spills[0].pages == [(0, 1003), (1, 1004), (2, 1005), (3, 7)]   # page 7 covers 959
    # the unit's full pages 3..7 (page 7 filled by the request: plain too)
    assert [o.key for o in spills[1:]] == [kv_key(hashes, UNIT, B, 3, i) for i in (7, 6, 5, 4, 3)]
    assert counters.spills_requested == 6 and all(o.key in index for o in spills)
    # the unit is spilled once: its other pages' reuse adds nothing
    reg.open_step()
    reg.on_reuse(freed.units[0].kv[0][2])
    assert reg.take() == []


def test_a_unit_whose_kv_goes_first_still_spills_its_state():
    reg, index, _ = _registry()
    hashes = unit_hashes(list(range(1100)), UNIT)
    freed = _freed([384], 3)
    reg.register(hashes, freed)
    reg.on_reuse(freed.units[0].kv[-1][2])            # page 0 first (the state held elsewhere)
    assert [o.key.kind for o in reg.take()] == ["state", "kv", "kv", "kv"]


def test_a_unit_whose_state_page_changed_spills_nothing():
    reg, index, counters = _registry()
    hashes = unit_hashes(list(range(1100)), UNIT)
    freed = _freed([384], 3)
    reg.register(hashes, freed)
    freed.units[0].states[1].block_hash = "reused since"   # another group's state page
    reg.on_reuse(freed.units[0].states[0])
    assert reg.take() == [] and counters.spills_dropped == {"page gone": 1}
    # but with the state already stored, the KV is worth spilling
    reg2, index2, _ = _registry()
    freed2 = _freed([384], 3)
    reg2.register(hashes, freed2)
    index2.add(state_key(hashes, UNIT, 384), 70)
    freed2.units[0].states[1].block_hash = "reused since"
    reg2.on_reuse(freed2.units[0].states[0])
    assert [o.key.kind for o in reg2.take()] == ["kv", "kv", "kv"]


def test_a_page_reused_after_the_step_plan_was_built_is_too_late():
    reg, _, counters = _registry()
    reg.register(unit_hashes(list(range(1100)), UNIT), _freed([384], 3))
    reg.take()                                        # the plan is built
    reg.on_reuse(Block(block_id=1000, block_hash="s1000"))
    assert reg.take() == [] and counters.spills_dropped == {"late": 1}


def test_a_block_reused_since_it_was_registered_is_not_spilled():
    reg, _, counters = _registry()
    reg.register(unit_hashes(list(range(1100)), UNIT), _freed([384], 3))
    reg.on_reuse(Block(block_id=1000, block_hash="someone else's"))
    assert reg.take() == [] and counters.spills_requested == 0


# -- the scheduler's index of the store ---------------------------------------

def test_the_index_keeps_the_most_recent_objects_within_the_capacity():
    index = StoreIndex(100)
    keys = [ObjectKey("kv", i, 128) for i in range(4)]
    for k in keys[:3]:
        index.add(k, 40)                      # the third pushes the first out
    assert [k in index for k in keys[:3]] == [False, True, True]
    index.touch(keys[1])
    index.add(keys[3], 40)                    # keys[2] is now the oldest
    assert [k in index for k in keys] == [False, True, False, True]
    remote = SimpleNamespace(contains=lambda key: key.prefix == 0)
    index.remote = remote
    assert index.held(keys[0]) and not index.held(keys[0], ask_remote=False)


def test_the_counters_line_names_every_counter():
    c = ConnectorCounters(spills_requested=3, spills_stored=2, loads_attempted=1)
    c.bump(c.spills_dropped, "no room")
    c.bump(c.loads_failed, "corrupt")
    assert c.line() == (
        "[Store Connector] spills_requested=3 spills_stored=2 spills_dropped=1 (no_room:1) "
        "loads_attempted=1 loads_completed=0 loads_failed=1 (corrupt:1) joint_boundaries=0 "
        "loaded_tokens=0 declines=0 (-) bytes_spilled=0 bytes_loaded=0")


def test_a_staging_buffer_smaller_than_a_state_object_is_refused_naming_both():
    pytest.importorskip("torch")
    from atom_hybrid_cache.connector.store import StoreConfigError, check_config
    layout = StoreLayout("m", B, (1 << 20, 1 << 20), (1 << 19,))
    config = SimpleNamespace(local_cpu=True, max_local_cpu_size=0.001)   # 1,073,741 bytes
    with pytest.raises(StoreConfigError) as e:
        check_config(config, layout)
    assert "holds 1,073,741 bytes, less than one state object of this model (2,621,504 bytes" \
        in str(e.value)
    check_config(SimpleNamespace(local_cpu=True, max_local_cpu_size=0.01), layout)
    with pytest.raises(StoreConfigError):
        check_config(SimpleNamespace(local_cpu=False, max_local_cpu_size=5.0), layout)
