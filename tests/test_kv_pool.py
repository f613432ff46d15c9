"""KVBlockPool: free order, reference counts, the prefix index."""

import pytest

from atom_hybrid_cache.core.hashing import ROOT_PARENT, hash_block, hash_blocks
from atom_hybrid_cache.core.kv_pool import NULL_BLOCK, KVBlockPool


def _tok(*xs):
    # A fresh tuple object each call, so identity shortcuts are not exercised
    # by accident (CPython folds equal tuple literals into one constant).
    return tuple(list(xs))


def _pool(n, dropped=None):
    return KVBlockPool(n, on_drop=None if dropped is None else dropped.append)


def _fill(kv, blocks, parent=ROOT_PARENT, base=0):
    """Commit one distinct chained block of content into each block; returns hashes."""
    hashes = []
    for i, b in enumerate(blocks):
        tokens = _tok(base + i, base + i + 1)
        h = hash_block(parent, tokens)
        assert kv.commit(b, h, parent, tokens)
        hashes.append(h)
        parent = h
    return hashes


# -- allocation order ---------------------------------------------------

def test_null_block_never_handed_out_even_when_everything_is_allocated():
    kv = _pool(8)
    got = kv.allocate(7)
    assert got == [1, 2, 3, 4, 5, 6, 7]
    assert NULL_BLOCK not in got
    assert kv.num_free == 0 and kv.num_used == 7
    with pytest.raises(MemoryError):
        kv.allocate(1)
    # index them all, free them all, allocate all again: still never block 0
    _fill(kv, got)
    kv.release(reversed(got))
    again = kv.allocate(7)
    assert NULL_BLOCK not in again
    assert sorted(again) == [1, 2, 3, 4, 5, 6, 7]
    assert kv.ref_cnt[NULL_BLOCK] == 0


def test_asking_for_more_than_free_takes_nothing():
    kv = _pool(4)
    with pytest.raises(MemoryError):
        kv.allocate(4)
    assert kv.num_free == 3
    assert kv.allocate(3) == [1, 2, 3]


def test_release_of_null_block_is_ignored():
    kv = _pool(4)
    kv.release([NULL_BLOCK])
    assert kv.ref_cnt[NULL_BLOCK] == 0
    assert kv.num_free == 3
    assert NULL_BLOCK not in kv.allocate(3)


def test_vacant_blocks_lowest_id_first():
    kv = _pool(10)
    got = kv.allocate(9)
    kv.release([7, 2, 9, 4])  # unindexed: back to the vacant heap
    assert kv.num_vacant == 4 and kv.num_cached_free == 0
    assert kv.allocate(4) == [2, 4, 7, 9]
    assert got == list(range(1, 10))


def test_vacant_blocks_go_before_cached_ones():
    kv = _pool(6)
    got = kv.allocate(5)  # 1..5
    _fill(kv, [1, 2])
    # cached blocks released FIRST, vacant ones later: vacant still go first
    kv.release([1, 2])
    kv.release([5, 3])
    assert kv.num_cached_free == 2 and kv.num_vacant == 2
    assert kv.allocate(2) == [3, 5]
    assert kv.evicted == 0
    assert kv.num_indexed == 2
    assert got == [1, 2, 3, 4, 5]


def test_cached_free_blocks_evicted_in_release_order():
    dropped = []
    kv = _pool(6, dropped)
    kv.allocate(5)
    hashes = _fill(kv, [1, 2, 3, 4, 5])
    h = dict(zip([1, 2, 3, 4, 5], hashes))
    kv.release([3])
    kv.release([1])
    kv.release([5, 2])
    kv.release([4])
    assert kv.num_vacant == 0 and kv.num_cached_free == 5
    assert kv.allocate(1) == [3]
    assert kv.allocate(2) == [1, 5]
    assert kv.allocate(2) == [2, 4]
    assert kv.evicted == 5
    assert dropped == [h[3], h[1], h[5], h[2], h[4]]
    assert kv.num_indexed == 0


def test_request_released_tail_first_loses_its_tail_first():
    dropped = []
    kv = _pool(5, dropped)
    blocks = kv.allocate(4)  # 1..4, one request's blocks in order
    tokens = [_tok(i, i) for i in range(4)]
    hashes = hash_blocks(tokens)
    parent = ROOT_PARENT
    for b, h, t in zip(blocks, hashes, tokens):
        assert kv.commit(b, h, parent, t)
        parent = h
    kv.release(reversed(blocks))
    # one eviction: the LAST block goes, the head of the prefix survives
    assert kv.allocate(1) == [4]
    assert dropped == [hashes[3]]
    assert kv.prefix_blocks(hashes, tokens, 4) == [1, 2, 3]
    assert kv.allocate(1) == [3]
    assert dropped == [hashes[3], hashes[2]]
    assert kv.prefix_blocks(hashes, tokens, 4) == [1, 2]


# -- reference counts ---------------------------------------------------

def test_acquire_on_cached_free_block_takes_it_off_the_free_list():
    kv = _pool(4)
    kv.allocate(3)
    h1, h2, h3 = _fill(kv, [1, 2, 3])
    kv.release([3, 2, 1])
    assert kv.num_cached_free == 3
    kv.acquire([3])
    assert kv.ref_cnt[3] == 1
    assert kv.num_cached_free == 2 and kv.num_free == 2
    kv.acquire([3])
    assert kv.ref_cnt[3] == 2
    # allocating every free block never hands out the acquired one
    assert sorted(kv.allocate(2)) == [1, 2]
    with pytest.raises(MemoryError):
        kv.allocate(1)
    assert kv.hash_to_block[h3] == 3
    kv.release([3])
    assert kv.ref_cnt[3] == 1 and kv.num_free == 0
    kv.release([3])
    assert kv.ref_cnt[3] == 0 and kv.num_cached_free == 1


def test_double_release_raises():
    kv = _pool(4)
    (b,) = kv.allocate(1)
    kv.release([b])
    with pytest.raises(AssertionError):
        kv.release([b])


def test_release_of_shared_block_waits_for_last_reference():
    kv = _pool(4)
    (b,) = kv.allocate(1)
    _fill(kv, [b])
    kv.acquire([b])
    kv.release([b])
    assert kv.ref_cnt[b] == 1
    assert kv.num_free == 2 and kv.num_cached_free == 0
    kv.release([b])
    assert kv.num_cached_free == 1


# -- index ----------------------------------------------------------------

def test_commit_then_lookup_hits_with_equal_content():
    kv = _pool(4)
    (b,) = kv.allocate(1)
    tokens = _tok(5, 6, 7, 8)
    h = hash_block(ROOT_PARENT, tokens)
    assert kv.commit(b, h, ROOT_PARENT, tokens)
    assert kv.lookup(h, ROOT_PARENT, _tok(5, 6, 7, 8)) == b
    assert kv.lookup(h, ROOT_PARENT, tokens) == b
    assert kv.collisions == 0
    assert kv.lookup(h + 1, ROOT_PARENT, tokens) is None  # plain miss
    assert kv.collisions == 0


def test_lookup_same_hash_different_tokens_is_a_collision_miss():
    kv = _pool(4)
    (b,) = kv.allocate(1)
    tokens = _tok(1, 2, 3, 4)
    h = hash_block(ROOT_PARENT, tokens)
    kv.commit(b, h, ROOT_PARENT, tokens)
    # crafted: pretend other content hashed to h
    assert kv.lookup(h, ROOT_PARENT, _tok(1, 2, 3, 5)) is None
    assert kv.collisions == 1
    # same tokens (equal, not identical), different parent: also other content
    assert kv.lookup(h, 12345, _tok(1, 2, 3, 4)) is None
    assert kv.collisions == 2
    assert kv.lookup(h, ROOT_PARENT, _tok(1, 2, 3, 4)) == b
    assert kv.collisions == 2


def test_lookup_same_tokens_object_different_parent_is_a_collision_miss():
    kv = _pool(4)
    (b,) = kv.allocate(1)
    tokens = _tok(1, 2, 3, 4)
    h = hash_block(ROOT_PARENT, tokens)
    kv.commit(b, h, ROOT_PARENT, tokens)
    # the very same tuple object (simulator and vLLM reuse block tuples),
    # but under another parent: different prefix, must not hit
    assert kv.lookup(h, 12345, tokens) is None
    assert kv.prefix_blocks([h], [tokens], 1, parent0=12345) == []
    assert kv.collisions == 2


def test_prefix_blocks_collision_stops_the_prefix_and_counts():
    kv = _pool(6)
    blocks = kv.allocate(3)
    tokens = [_tok(1, 1), _tok(2, 2), _tok(3, 3)]
    hashes = hash_blocks(tokens)
    parent = ROOT_PARENT
    for b, h, t in zip(blocks, hashes, tokens):
        kv.commit(b, h, parent, t)
        parent = h
    crafted = [_tok(1, 1), _tok(9, 9), _tok(3, 3)]  # block 1 differs, hash reused
    assert kv.prefix_blocks(hashes, crafted, 3) == [blocks[0]]
    assert kv.collisions == 1
    assert kv.prefix_blocks(hashes, [_tok(1, 1), _tok(2, 2), _tok(3, 3)], 3) == blocks
    assert kv.collisions == 1


def test_duplicate_commit_returns_false_and_block_stays_unindexed():
    kv = _pool(5)
    b1, b2 = kv.allocate(2)
    tokens = _tok(4, 4)
    h = hash_block(ROOT_PARENT, tokens)
    assert kv.commit(b1, h, ROOT_PARENT, tokens) is True
    assert kv.commit(b2, h, ROOT_PARENT, _tok(4, 4)) is False
    assert kv.block_hash[b2] is None and kv.block_content[b2] is None
    assert kv.hash_to_block[h] == b1
    assert kv.num_indexed == 1
    # freed, the duplicate goes back to the vacant list, not the cached one
    kv.release([b2])
    assert kv.num_vacant == 3 and kv.num_cached_free == 0
    # a block already indexed cannot be indexed again under another hash
    h2 = hash_block(ROOT_PARENT, _tok(5, 5))
    assert kv.commit(b1, h2, ROOT_PARENT, _tok(5, 5)) is False
    assert h2 not in kv.hash_to_block
    assert kv.block_hash[b1] == h


def test_null_block_is_never_indexed():
    kv = _pool(4)
    with pytest.raises(AssertionError):
        kv.commit(NULL_BLOCK, 1, ROOT_PARENT, _tok(1))
    assert kv.num_indexed == 0


def test_evicted_counts_pool_ran_out_and_fires_on_drop():
    dropped = []
    kv = _pool(3, dropped)
    b1, b2 = kv.allocate(2)
    h1, h2 = _fill(kv, [b1, b2])
    kv.release([b2, b1])
    assert kv.evicted == 0 and dropped == []
    assert kv.allocate(1) == [b2]
    assert kv.evicted == 1 and kv.retired == 0
    assert dropped == [h2]
    assert h2 not in kv.hash_to_block and kv.block_hash[b2] is None
    assert kv.lookup(h1, ROOT_PARENT, kv.block_content[b1][1]) == b1


def test_retire_counts_apart_from_evicted_and_fires_on_drop():
    dropped = []
    kv = _pool(4, dropped)
    b1, b2 = kv.allocate(2)
    h1, h2 = _fill(kv, [b1, b2])
    # retire a block in use: content unindexed, block stays with its owner
    kv.retire(b2)
    assert kv.retired == 1 and kv.evicted == 0
    assert dropped == [h2]
    assert h2 not in kv.hash_to_block
    assert kv.ref_cnt[b2] == 1
    kv.release([b2])
    assert kv.num_vacant == 2 and kv.num_cached_free == 0
    # retire a cached-free block: it becomes vacant, no eviction counted later
    kv.release([b1])
    assert kv.num_cached_free == 1
    kv.retire(b1)
    assert kv.retired == 2 and kv.evicted == 0
    assert dropped == [h2, h1]
    assert kv.num_cached_free == 0 and kv.num_vacant == 3
    kv.allocate(3)
    assert kv.evicted == 0
    # retiring an unindexed block is a no-op
    kv.retire(b1)
    assert kv.retired == 2 and dropped == [h2, h1]


def test_prefix_blocks_stops_at_first_miss_and_at_limit():
    kv = _pool(8)
    tokens = [_tok(i, i) for i in range(5)]
    hashes = hash_blocks(tokens)
    blocks = kv.allocate(5)
    parent = ROOT_PARENT
    for i, (b, h, t) in enumerate(zip(blocks, hashes, tokens)):
        if i != 2:  # block 2's content is not indexed
            kv.commit(b, h, parent, t)
        parent = h
    assert kv.prefix_blocks(hashes, tokens, 5) == blocks[:2]
    assert kv.prefix_blocks(hashes, tokens, 1) == blocks[:1]
    assert kv.prefix_blocks(hashes, tokens, 0) == []
    assert kv.prefix_blocks(hashes[3:], tokens[3:], 5, parent0=hashes[2]) == blocks[3:]
    assert kv.prefix_blocks(hashes[3:], tokens[3:], 1, parent0=hashes[2]) == blocks[3:4]
    assert kv.collisions == 0
