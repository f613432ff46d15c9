"""StateSlotPool: working slots, checkpoint tiers, eviction order, fates."""

import pytest

from atom_hybrid_cache.core.state_pool import CheckpointInfo, StateSlotPool


def info(pos, kind="anchor"):
    return CheckpointInfo(pos, kind, "w")


def plain(pool, h, at_head=False):
    return pool.store(h, info(h, "ladder" if at_head else "anchor"), at_head=at_head)


def protected(pool, h):
    return pool.store(h, info(h, "anchor"), at_head=False, protect=True)


def held(pool, *hs):
    return [pool.has(h) for h in hs]


def test_vacant_slots_lowest_first_before_any_eviction():
    pool = StateSlotPool(4, protected_cap=2)
    assert plain(pool, 101) == 0
    assert pool.take_working("r", 1) == [1]
    assert plain(pool, 102) == 2
    pool.release_working([1])
    assert plain(pool, 103) == 1  # lowest vacant, not 3
    assert plain(pool, 104) == 3
    assert pool.fates.evicted == 0
    assert held(pool, 101, 102, 103, 104) == [True] * 4
    assert pool.num_vacant == 0 and pool.num_checkpoints == 4
    plain(pool, 105)  # now something must go
    assert pool.fates.evicted == 1


def test_checkpoint_in_free_slot_survives_while_vacant_slots_remain():
    pool = StateSlotPool(3, protected_cap=2)
    s = plain(pool, 7)
    assert s == 0
    assert pool.take_working("a", 2) == [1, 2]
    assert pool.has(7) and pool.fates.evicted == 0
    assert pool.slot_owner[1] == "a" and pool.slot_owner[2] == "a"
    # no vacant slot left: the checkpoint gives its slot to a working state
    assert pool.take_working("b", 1) == [0]
    assert not pool.has(7)
    assert pool.fates.evicted == 1
    assert pool.take_working("c", 1) is None
    assert pool.num_working == 3


def test_head_filed_evicted_before_tail_filed():
    pool = StateSlotPool(3, protected_cap=0)
    plain(pool, 1)                 # tail (older)
    plain(pool, 2, at_head=True)   # head (newer, a guess)
    plain(pool, 3)                 # tail
    plain(pool, 4)                 # evicts the head: 2
    assert held(pool, 1, 2, 3, 4) == [True, False, True, True]
    plain(pool, 5)                 # then the oldest tail-filed: 1
    assert held(pool, 1, 3, 4, 5) == [False, True, True, True]
    assert pool.fates.evicted == 2


def test_read_promotes_to_tail():
    pool = StateSlotPool(2, protected_cap=0)
    plain(pool, 10)                # an anchor at the tail
    plain(pool, 20, at_head=True)  # a guess at the head
    assert pool.read(20) == pool.index[20]
    assert pool.fates.read == 1
    plain(pool, 30)                # the older anchor goes, the read guess stays
    assert held(pool, 10, 20, 30) == [False, True, True]
    assert pool.read(999) is None
    assert pool.fates.read == 1


def test_read_promotes_within_protected_tier():
    pool = StateSlotPool(3, protected_cap=3)
    protected(pool, 1)
    protected(pool, 2)
    protected(pool, 3)
    pool.read(1)
    pool.take_working("r", 1)  # plain is empty: oldest protected goes, now 2
    assert held(pool, 1, 2, 3) == [True, False, True]


def test_protected_tier_evicted_only_when_plain_is_empty():
    pool = StateSlotPool(3, protected_cap=2)
    protected(pool, 1)   # oldest of all
    plain(pool, 2)
    protected(pool, 3)
    plain(pool, 4)       # plain non-empty: 2 goes, not the older protected 1
    assert held(pool, 1, 2, 3, 4) == [True, False, True, True]
    plain(pool, 5)       # again plain: 4 goes
    assert held(pool, 1, 3, 4, 5) == [True, True, False, True]
    pool.take_working("r", 1)  # takes plain 5
    assert held(pool, 1, 3, 5) == [True, True, False]
    pool.take_working("q", 1)  # plain empty: oldest protected, 1
    assert held(pool, 1, 3) == [False, True]
    plain(pool, 6)       # a tail-filed checkpoint may evict a protected one
    assert held(pool, 3, 6) == [False, True]
    assert pool.fates.evicted == 5


def test_guess_never_evicts_a_protected_checkpoint():
    pool = StateSlotPool(2, protected_cap=2)
    protected(pool, 1)
    protected(pool, 2)
    assert pool.store(3, info(3, "demand"), at_head=True) is None
    assert pool.fates.dropped == 1
    assert pool.fates.kept == 2 and pool.fates.evicted == 0
    assert held(pool, 1, 2, 3) == [True, True, False]
    assert pool.is_protected(1) and pool.is_protected(2)
    # with a plain checkpoint around, the guess takes that one instead
    pool.unprotect(1)
    assert pool.store(4, info(4, "ladder"), at_head=True) is not None
    assert held(pool, 1, 2, 4) == [False, True, True]
    assert pool.fates.dropped == 1


def test_protected_cap_demotes_oldest_to_plain():
    pool = StateSlotPool(5, protected_cap=2)
    protected(pool, 1)
    protected(pool, 2)
    protected(pool, 3)
    assert [pool.is_protected(h) for h in (1, 2, 3)] == [False, True, True]
    assert held(pool, 1, 2, 3) == [True, True, True]
    plain(pool, 4)
    plain(pool, 5)  # slots now full: 1, 2, 3, 4, 5
    # demoted 1 sits in plain ahead of 4 and 5, so it goes first
    plain(pool, 6)
    assert held(pool, 1, 2, 3, 4, 5, 6) == [False, True, True, True, True, True]


def test_protect_of_existing_plain_checkpoint_and_unprotect():
    pool = StateSlotPool(3, protected_cap=2)
    plain(pool, 1)
    plain(pool, 2)
    pool.protect(1)
    assert pool.is_protected(1)
    plain(pool, 3)
    plain(pool, 4)  # plain head is 2 now
    assert held(pool, 1, 2) == [True, False]
    pool.unprotect(1)  # demoted at the plain tail: 3 goes before it
    assert not pool.is_protected(1)
    plain(pool, 5)
    assert held(pool, 1, 3, 4, 5) == [True, False, True, True]


def test_invalidate_orphans_and_vacates_the_slot():
    pool = StateSlotPool(3, protected_cap=2)
    s = plain(pool, 42)
    protected(pool, 43)
    assert pool.invalidate(42) is True
    assert pool.fates.orphaned == 1 and pool.fates.evicted == 0
    assert not pool.has(42)
    assert pool.slot_key[s] is None and pool.slot_info[s] is None
    assert pool.num_vacant == 2
    assert pool.invalidate(43) is True
    assert pool.fates.orphaned == 2
    assert pool.num_vacant == 3 and pool.num_checkpoints == 0
    assert pool.invalidate(42) is False
    assert pool.fates.orphaned == 2
    # the freed slots are vacant: storing evicts nothing
    plain(pool, 1), plain(pool, 2), plain(pool, 3)
    assert pool.fates.evicted == 0


def test_per_need_width_takes_one_plus_num_spec_slots():
    num_spec = 2
    pool = StateSlotPool(5, protected_cap=2)
    a = pool.take_working("a", 1 + num_spec)
    assert a == [0, 1, 2]
    assert all(pool.slot_owner[s] == "a" for s in a)
    assert pool.take_working("b", 1 + num_spec) is None
    assert pool.num_vacant == 2 and pool.num_working == 3  # nothing taken
    plain(pool, 9)
    # a checkpoint counts as takeable, a working slot does not
    assert pool.take_working("b", 1 + num_spec) is None
    assert pool.has(9)
    assert pool.take_working("b", 2) is not None
    pool.release_working(a)
    assert pool.num_vacant == 3


def test_release_working_twice_raises():
    pool = StateSlotPool(2, protected_cap=0)
    slots = pool.take_working("a", 1)
    pool.release_working(slots)
    with pytest.raises(AssertionError):
        pool.release_working(slots)


def test_storing_an_already_held_hash_is_not_a_second_write():
    pool = StateSlotPool(3, protected_cap=2)
    first = info(8, "anchor")
    s = pool.store(5, first, at_head=False)
    vacant = pool.num_vacant
    again = pool.store(5, info(8, "demand"), at_head=True)
    assert again == s
    assert pool.fates.kept == 1 and pool.fates.duplicate == 1
    assert pool.info(5) is first
    assert pool.num_vacant == vacant and pool.num_checkpoints == 1
    # a duplicate asking for protection gets it, still without a write
    pool.store(5, info(8, "anchor"), at_head=False, protect=True)
    assert pool.is_protected(5)
    assert pool.fates.kept == 1 and pool.fates.duplicate == 2
    assert pool.info(5) is first
