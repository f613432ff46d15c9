"""StepLookups: a lookup kept before vLLM's schedule() answers vLLM's own
lookup of the same request exactly while none of that request's prefix
keys is inserted into or removed from vLLM's prefix index."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockHashToBlockMap  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id  # noqa: E402

from atom_hybrid_cache.vllm.step_lookups import StepLookups  # noqa: E402


class FakePool:
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


def _index(pool, block_hash: bytes, block_id: int) -> KVCacheBlock:
    block = KVCacheBlock(block_id)
    pool.cached_block_hash_to_block.insert(make_block_hash_with_group_id(block_hash, 0), block)
    return block


def test_kept_lookup_answers_until_one_of_its_keys_changes():
    pool = FakePool()
    coordinator = FakeCoordinator(pool)
    lookups = StepLookups(coordinator, pool)
    a = [b"a1", b"a2", b"a3"]
    other = [b"o1"]
    b1, b2 = _index(pool, b"a1", 1), _index(pool, b"a2", 2)

    lookups.record()
    kept = coordinator.find_longest_cache_hit(a, 3)
    assert kept == (([b1, b2],), 2, 0) and coordinator.calls == 1
    lookups.stop_recording()

    # vLLM's lookup of the same list: answered, in lists of its own
    again = coordinator.find_longest_cache_hit(a, 3)
    assert again == kept and again[0][0] is not kept[0][0]
    assert (coordinator.calls, lookups.answered) == (1, 1)
    # another length, or a request not looked up before: computed, not kept
    assert coordinator.find_longest_cache_hit(a, 1) == (([b1],), 1, 0)
    assert coordinator.find_longest_cache_hit(other, 1) == (([],), 0, 0)
    assert coordinator.calls == 3

    # a key of another prefix changes nothing
    _index(pool, b"o1", 9)
    assert coordinator.find_longest_cache_hit(a, 3) == kept and coordinator.calls == 3

    # a running prefill indexes the request's next key: the hit grows
    b3 = _index(pool, b"a3", 3)
    assert coordinator.find_longest_cache_hit(a, 3) == (([b1, b2, b3],), 3, 0)
    assert (coordinator.calls, lookups.dropped) == (4, 1)


def test_an_eviction_of_its_key_drops_it_and_forget_ends_the_step():
    pool = FakePool()
    coordinator = FakeCoordinator(pool)
    lookups = StepLookups(coordinator, pool)
    a = [b"a1", b"a2"]
    b1, b2 = _index(pool, b"a1", 1), _index(pool, b"a2", 2)

    lookups.record()
    assert coordinator.find_longest_cache_hit(a, 2) == (([b1, b2],), 2, 0)
    # removing a block the key does not name changes nothing
    assert pool.cached_block_hash_to_block.pop(make_block_hash_with_group_id(b"a2", 0), 7) is None
    assert coordinator.find_longest_cache_hit(a, 2) == (([b1, b2],), 2, 0)
    assert (coordinator.calls, lookups.dropped) == (1, 0)
    pool.cached_block_hash_to_block.pop(make_block_hash_with_group_id(b"a2", 0), 2)
    assert coordinator.find_longest_cache_hit(a, 2) == (([b1],), 1, 0)
    assert (coordinator.calls, lookups.dropped) == (2, 1)

    # kept while recording (the gate's lookups), gone with the step
    assert coordinator.find_longest_cache_hit(a, 2) == (([b1],), 1, 0)
    assert coordinator.calls == 2
    lookups.forget()
    assert coordinator.find_longest_cache_hit(a, 2) == (([b1],), 1, 0)
    assert coordinator.calls == 3


def test_a_reset_index_is_watched_again():
    pool = FakePool()
    coordinator = FakeCoordinator(pool)
    lookups = StepLookups(coordinator, pool)
    a = [b"a1"]
    pool.cached_block_hash_to_block = BlockHashToBlockMap()   # vLLM's reset_prefix_cache
    lookups.record()
    assert coordinator.find_longest_cache_hit(a, 1) == (([],), 0, 0)
    b1 = _index(pool, b"a1", 1)
    assert coordinator.find_longest_cache_hit(a, 1) == (([b1],), 1, 0)
    assert (coordinator.calls, lookups.dropped) == (2, 1)


def test_a_change_before_a_lookup_was_kept_does_not_drop_it():
    pool = FakePool()
    coordinator = FakeCoordinator(pool)
    lookups = StepLookups(coordinator, pool)
    a, other = [b"a1", b"a2"], [b"o1"]
    lookups.record()
    coordinator.find_longest_cache_hit(other, 1)     # kept: changes are listed from now
    b1 = _index(pool, b"a1", 1)                      # a key of `a`, before `a` is looked up
    assert coordinator.find_longest_cache_hit(a, 2) == (([b1],), 1, 0)
    lookups.stop_recording()
    assert coordinator.find_longest_cache_hit(a, 2) == (([b1],), 1, 0)
    assert (coordinator.calls, lookups.answered, lookups.dropped) == (2, 1, 0)
