"""StepLookups: a lookup kept before vLLM's schedule() answers vLLM's own
lookup of the same request, and the plugin's in the next steps, exactly
while none of that request's prefix keys is inserted into or removed from
vLLM's prefix index."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockHashToBlockMap  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id  # noqa: E402

from atom_hybrid_cache.vllm.step_lookups import StepLookups  # noqa: E402


UNIT = 16


class FakePool:
    hash_block_size = UNIT

    def __init__(self) -> None:
        self.cached_block_hash_to_block = BlockHashToBlockMap()


class FakeCoordinator:
    """vLLM's answer shape: (blocks per group, hit, uncached), one group;
    the hit is the run of leading hashes indexed, in hashes."""

    def __init__(self, pool: FakePool) -> None:
        self.pool = pool
        self.calls = 0

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        self.calls += 1
        blocks = []
        for h in block_hashes[:max_cache_hit_length]:
            b = self.pool.cached_block_hash_to_block.get_one_block(
                make_block_hash_with_group_id(h, 0))
            if b is None:
                break
            blocks.append(b)
        return (blocks,), len(blocks), 0


def _index(pool, block_hash: bytes, block_id: int, own_key: bool = True) -> KVCacheBlock:
    """A page filed under `block_hash` (b"a2": the second hash of a prefix,
    a prefix of 2 * UNIT tokens), as vLLM files one: the key its own,
    with the prefix's length (`own_key=False`: a page's second key, no
    length known)."""
    block = KVCacheBlock(block_id)
    key = make_block_hash_with_group_id(block_hash, 0)
    if own_key:
        block.set_block_hash(key, num_tokens=UNIT * int(block_hash[1:]))
    pool.cached_block_hash_to_block.insert(key, block)
    return block


def test_kept_lookup_answers_until_one_of_its_keys_changes():
    pool = FakePool()
    coordinator = FakeCoordinator(pool)
    lookups = StepLookups(coordinator, pool)
    a = [b"a1", b"a2", b"a3"]
    other = [b"o1"]
    b1, b2 = _index(pool, b"a1", 1), _index(pool, b"a2", 2)

    lookups.begin_step()
    kept = coordinator.find_longest_cache_hit(a, 3)
    assert kept == (([b1, b2],), 2, 0) and coordinator.calls == 1

    # vLLM's lookup of the same list: answered, in lists of its own
    again = coordinator.find_longest_cache_hit(a, 3)
    assert again == kept and again[0][0] is not kept[0][0]
    assert (coordinator.calls, lookups.answered) == (1, 1)
    # another length, or a request not looked up before: computed (and
    # kept: each caller's lists are its own, the first one's too)
    shorter = coordinator.find_longest_cache_hit(a, 1)
    assert shorter == (([b1],), 1, 0)
    shorter[0][0].append("the caller's")
    assert coordinator.find_longest_cache_hit(other, 1) == (([],), 0, 0)
    assert coordinator.calls == 3
    assert coordinator.find_longest_cache_hit(a, 1) == (([b1],), 1, 0)
    assert (coordinator.calls, lookups.answered) == (3, 2)

    # a key of another prefix changes nothing
    _index(pool, b"o1", 9)
    assert coordinator.find_longest_cache_hit(a, 3) == kept and coordinator.calls == 3

    # a running prefill indexes the request's next key: the hit grows
    b3 = _index(pool, b"a3", 3)
    assert coordinator.find_longest_cache_hit(a, 3) == (([b1, b2, b3],), 3, 0)
    assert (coordinator.calls, lookups.dropped) == (4, 1)


def test_an_eviction_of_its_key_drops_it_and_a_step_without_the_ask_ends_it():
    pool = FakePool()
    coordinator = FakeCoordinator(pool)
    lookups = StepLookups(coordinator, pool)
    a = [b"a1", b"a2"]
    b1, b2 = _index(pool, b"a1", 1), _index(pool, b"a2", 2)

    lookups.begin_step()
    assert coordinator.find_longest_cache_hit(a, 2) == (([b1, b2],), 2, 0)
    # removing a block the key does not name changes nothing
    assert pool.cached_block_hash_to_block.pop(make_block_hash_with_group_id(b"a2", 0), 7) is None
    assert coordinator.find_longest_cache_hit(a, 2) == (([b1, b2],), 2, 0)
    assert (coordinator.calls, lookups.dropped) == (1, 0)
    pool.cached_block_hash_to_block.pop(make_block_hash_with_group_id(b"a2", 0), 2)
    assert coordinator.find_longest_cache_hit(a, 2) == (([b1],), 1, 0)
    assert (coordinator.calls, lookups.dropped) == (2, 1)

    # kept into the next step while asked, gone after a step without the ask
    assert coordinator.find_longest_cache_hit(a, 2) == (([b1],), 1, 0)
    assert coordinator.calls == 2
    lookups.begin_step()
    assert coordinator.find_longest_cache_hit(a, 2) == (([b1],), 1, 0)
    assert coordinator.calls == 2
    lookups.begin_step()
    lookups.begin_step()
    assert lookups._changes == [] and lookups._watch.change_log is None
    assert coordinator.find_longest_cache_hit(a, 2) == (([b1],), 1, 0)
    assert coordinator.calls == 3


def test_a_kept_lookup_stands_across_steps_while_asked_each_step():
    """A request waiting for room is looked up again the next step: the
    kept answer stands while it is asked every step and none of the
    request's keys changed (a change is read at its prefix length only:
    another prefix's key of the same length is not the request's); a step
    without the ask drops it, and with no lookup kept nothing is listed."""
    pool = FakePool()
    coordinator = FakeCoordinator(pool)
    lookups = StepLookups(coordinator, pool)
    a = [b"a1", b"a2", b"a3"]
    b1, b2 = _index(pool, b"a1", 1), _index(pool, b"a2", 2)

    lookups.begin_step()
    kept = coordinator.find_longest_cache_hit(a, 3)
    lookups.end_step()
    # the steps after: other prefixes' pages cached and evicted, at the
    # request's lengths too
    o2 = _index(pool, b"o2", 9)
    _index(pool, b"o3", 10)
    pool.cached_block_hash_to_block.pop(make_block_hash_with_group_id(b"o2", 0), o2.block_id)
    for step in range(3):
        lookups.begin_step()
        got = coordinator.find_longest_cache_hit(a, 3)
        assert got == kept == (([b1, b2],), 2, 0) and got[0][0] is not kept[0][0]
        lookups.end_step()
        # what the answer read is listed no longer
        assert lookups._changes == []
        _index(pool, b"o1", 20 + step)
    assert (coordinator.calls, lookups.answered, lookups.dropped) == (1, 3, 0)
    assert len(lookups._changes) == 1

    # the request's own next key is cached: the hit grows
    b3 = _index(pool, b"a3", 3)
    lookups.begin_step()
    assert coordinator.find_longest_cache_hit(a, 3) == (([b1, b2, b3],), 3, 0)
    assert (coordinator.calls, lookups.dropped) == (2, 1)
    lookups.end_step()

    # a step that does not ask for it: gone, and nothing listed any more
    lookups.begin_step()
    lookups.end_step()
    lookups.begin_step()
    assert lookups._kept == {} and pool.cached_block_hash_to_block is lookups._index
    assert lookups._watch.change_log is None and lookups._changes == []
    coordinator.find_longest_cache_hit(a, 3)
    assert coordinator.calls == 3


def test_a_change_of_unknown_length_is_compared_with_the_hashes():
    """A key filed only as a page's second key has no prefix length: the
    request's hashes are compared with it (another prefix's stands, the
    request's own drops)."""
    pool = FakePool()
    coordinator = FakeCoordinator(pool)
    lookups = StepLookups(coordinator, pool)
    a = [b"a1", b"a2"]
    b1 = _index(pool, b"a1", 1)
    lookups.begin_step()
    coordinator.find_longest_cache_hit(a, 2)
    _index(pool, b"o2", 5, own_key=False)
    assert lookups._changes == [(b"o2", None)]
    assert coordinator.find_longest_cache_hit(a, 2) == (([b1],), 1, 0)
    assert (coordinator.calls, lookups.answered) == (1, 1)
    b2 = _index(pool, b"a2", 6, own_key=False)
    assert coordinator.find_longest_cache_hit(a, 2) == (([b1, b2],), 2, 0)
    assert (coordinator.calls, lookups.dropped) == (2, 1)


def test_a_reset_index_is_watched_again():
    pool = FakePool()
    coordinator = FakeCoordinator(pool)
    lookups = StepLookups(coordinator, pool)
    a = [b"a1"]
    pool.cached_block_hash_to_block = BlockHashToBlockMap()   # vLLM's reset_prefix_cache
    lookups.begin_step()
    assert coordinator.find_longest_cache_hit(a, 1) == (([],), 0, 0)
    b1 = _index(pool, b"a1", 1)
    assert coordinator.find_longest_cache_hit(a, 1) == (([b1],), 1, 0)
    assert (coordinator.calls, lookups.dropped) == (2, 1)


def test_a_change_before_a_lookup_was_kept_does_not_drop_it():
    pool = FakePool()
    coordinator = FakeCoordinator(pool)
    lookups = StepLookups(coordinator, pool)
    a, other = [b"a1", b"a2"], [b"o1"]
    lookups.begin_step()
    coordinator.find_longest_cache_hit(other, 1)     # kept: changes are listed from now
    b1 = _index(pool, b"a1", 1)                      # a key of `a`, before `a` is looked up
    assert coordinator.find_longest_cache_hit(a, 2) == (([b1],), 1, 0)
    lookups.end_step()
    lookups.begin_step()
    assert coordinator.find_longest_cache_hit(a, 2) == (([b1],), 1, 0)
    assert (coordinator.calls, lookups.answered, lookups.dropped) == (2, 1, 0)
