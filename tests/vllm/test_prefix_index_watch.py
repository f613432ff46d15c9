"""One watcher of vLLM's prefix index (`PrefixIndexWatch`) for the kept state
hashes and the step's change log: the index's insert and pop wrapped once,
both kept through a reset (real vLLM BlockPool; no model)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockHashToBlockMap, BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402

from atom_hybrid_cache.vllm import prefix_index_watch  # noqa: E402
from atom_hybrid_cache.vllm.state_hashes import StateHashes  # noqa: E402
from atom_hybrid_cache.vllm.step_lookups import StepLookups  # noqa: E402

STATE_GROUP, KV_GROUP = 1, 0


class Coordinator:
    def __init__(self) -> None:
        self.calls = 0

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        self.calls += 1
        return ([],), 0, 0


def _insert(pool, block_hash: bytes, group: int):
    block = pool.get_new_blocks(1)[0]
    pool.cached_block_hash_to_block.insert(make_block_hash_with_group_id(block_hash, group), block)
    return block


@pytest.mark.parametrize("state_hashes_first", [True, False])
def test_one_wrapper_keeps_the_state_hashes_and_the_change_log(state_hashes_first):
    pool = BlockPool(num_gpu_blocks=32, enable_caching=True, hash_block_size=64)
    coordinator = Coordinator()
    if state_hashes_first:
        kept = StateHashes(pool, STATE_GROUP)
        lookups = StepLookups(coordinator, pool)
    else:
        lookups = StepLookups(coordinator, pool)
        kept = StateHashes(pool, STATE_GROUP)
    assert kept.current() == set()
    index_map = pool.cached_block_hash_to_block
    # the methods under the one wrapper are vLLM's own: no wrapper wraps another
    unwrapped_insert, unwrapped_pop = index_map._atom_unwrapped
    assert unwrapped_insert.__func__ is BlockHashToBlockMap.insert
    assert unwrapped_pop.__func__ is BlockHashToBlockMap.pop
    assert prefix_index_watch.of_pool(pool) is kept.watch

    # nothing kept: nothing logged
    state = _insert(pool, b"s" * 32, STATE_GROUP)
    assert kept.current() == {b"s" * 32} and kept.watch.change_log is None

    # a kept lookup: the changes of every group are logged, and a change
    # of one of its hashes drops it
    prefix = [b"a" * 32, b"s" * 32]
    lookups.begin_step()
    coordinator.find_longest_cache_hit(prefix, 2)
    kv = _insert(pool, b"k" * 32, KV_GROUP)
    pool.cached_block_hash_to_block.pop(make_block_hash_with_group_id(b"s" * 32, STATE_GROUP),
                                        state.block_id)
    # (no page here holds its key as its own: no prefix length known)
    assert lookups._changes == [(b"k" * 32, None), (b"s" * 32, None)]
    assert kept.current() == set()
    coordinator.find_longest_cache_hit(prefix, 2)
    assert (lookups.answered, lookups.dropped, coordinator.calls) == (0, 1, 2)
    # asked in this step, it stands into the next; a step without the ask
    # drops it: nothing kept, nothing logged
    lookups.begin_step()
    assert len(lookups._kept) == 1
    lookups.begin_step()
    assert lookups._kept == {} and kept.watch.change_log is None

    # a reset (every page free): the new index is wrapped once, and both
    # follow it
    pool.free_blocks([state, kv])
    assert pool.reset_prefix_cache()
    assert pool.cached_block_hash_to_block is not index_map
    lookups.begin_step()
    assert kept.current() == set()
    coordinator.find_longest_cache_hit(prefix, 2)
    _insert(pool, b"t" * 32, STATE_GROUP)
    assert kept.current() == {b"t" * 32} and lookups._changes == [(b"t" * 32, None)]
    unwrapped_insert, _ = pool.cached_block_hash_to_block._atom_unwrapped
    assert unwrapped_insert.__func__ is BlockHashToBlockMap.insert


def _index_entries(pool, group: int) -> dict:
    """{block hash: [block ids]} of `group`'s keys in vLLM's index, read
    through vLLM's own map."""
    index_map = pool.cached_block_hash_to_block
    suffix = make_block_hash_with_group_id(b"", group)
    out = {}
    for key, value in index_map._cache.items():
        if key.endswith(suffix) and len(key) == len(suffix) + 32:
            blocks = [value] if not isinstance(value, dict) else list(value.values())
            out[key[:-len(suffix)]] = [b.block_id for b in blocks]
    return out


def _mirrored(entries: dict) -> dict:
    return {h: [b.block_id for b in ([v] if not isinstance(v, dict) else v.values())]
            for h, v in entries.items()}


def test_a_groups_mirror_follows_every_insert_pop_and_reset():
    rng = random.Random(3)
    pool = BlockPool(num_gpu_blocks=500, enable_caching=True, hash_block_size=64)
    watch = prefix_index_watch.of_pool(pool)
    index_map = pool.cached_block_hash_to_block
    hashes = [bytes([i]) * 32 for i in range(12)]
    filed = []   # (key, block) the index holds
    # entries filed before the mirror is asked for are read from the index
    for h in hashes[:3]:
        key = make_block_hash_with_group_id(h, KV_GROUP)
        block = pool.get_new_blocks(1)[0]
        index_map.insert(key, block)
        filed.append((key, block))
    entries = watch.mirror(KV_GROUP)
    assert _mirrored(entries) == _index_entries(pool, KV_GROUP) and len(entries) == 3
    for step in range(400):
        if filed and rng.random() < 0.45:
            key, block = filed.pop(rng.randrange(len(filed)))
            assert index_map.pop(key, block.block_id) is block
        else:
            # a hash filed again names two blocks (vLLM's dict of them); the
            # state group's keys are not this mirror's
            key = make_block_hash_with_group_id(rng.choice(hashes), rng.choice([KV_GROUP, STATE_GROUP]))
            block = pool.get_new_blocks(1)[0]
            index_map.insert(key, block)
            filed.append((key, block))
        assert _mirrored(watch.mirror(KV_GROUP)) == _index_entries(pool, KV_GROUP), step
    assert any(isinstance(v, dict) for v in watch.mirror(KV_GROUP).values())
    # a pop whose block id is not filed under the key changes nothing
    key, block = filed[0]
    assert index_map.pop(key, 10_000) is None
    assert _mirrored(watch.mirror(KV_GROUP)) == _index_entries(pool, KV_GROUP)
    # a reset: the new index's (empty) entries, and it is followed
    pool.free_blocks([b for b in pool.blocks[1:] if b.ref_cnt])
    assert pool.reset_prefix_cache()
    assert watch.mirror(KV_GROUP) == {}
    _insert(pool, hashes[0], KV_GROUP)
    assert _mirrored(watch.mirror(KV_GROUP)) == _index_entries(pool, KV_GROUP) \
        and list(watch.mirror(KV_GROUP)) == [hashes[0]]


def test_the_state_groups_positions_follow_every_insert_pop_and_reset():
    """`KeyPositions`: each kept hash's prefix length, read off a page filed
    under it as its own key; a key that is so far only pages' second key
    counts as unknown (the positions then do not cover the hashes) until a
    page files it as its own; a key filed twice stays until its last page
    goes; one group a pool; rebuilt at a reset."""
    rng = random.Random(5)
    pool = BlockPool(num_gpu_blocks=600, enable_caching=True, hash_block_size=64)
    watch = prefix_index_watch.of_pool(pool)
    index_map = pool.cached_block_hash_to_block
    hashes = [bytes([i]) * 32 for i in range(16)]
    position_of = {h: 64 * (i % 5 + 1) for i, h in enumerate(hashes)}   # shared positions
    known: dict = {}   # the model: state hash -> whether a page gave its position

    def file(h, group, own_key=True):
        key = make_block_hash_with_group_id(h, group)
        block = pool.get_new_blocks(1)[0]
        if own_key:
            block.set_block_hash(key, num_tokens=position_of[h])
        pool.cached_block_hash_to_block.insert(key, block)   # the map after a reset too
        if group == STATE_GROUP:
            known[h] = known.get(h, False) or own_key
        return key, block

    def expected():
        return (sorted({position_of[h] for h, k in known.items() if k}),
                sum(not k for k in known.values()))

    filed = [file(h, STATE_GROUP) for h in hashes[:4]]   # before the ask: read from the index
    kept = watch.positions(STATE_GROUP)
    assert watch.positions(KV_GROUP) is None             # one group a pool
    assert (kept.order, kept.unknown) == ([64, 128, 192, 256], 0) and kept.complete()
    seen_unknown = seen_twice = False
    for step in range(600):
        if filed and rng.random() < 0.45:
            key, block = filed.pop(rng.randrange(len(filed)))
            assert index_map.pop(key, block.block_id) is block
            h = key[:-len(make_block_hash_with_group_id(b"", STATE_GROUP))]
            if key.endswith(make_block_hash_with_group_id(b"", STATE_GROUP)) \
                    and key not in index_map._cache:
                del known[h]
        else:
            filed.append(file(rng.choice(hashes), rng.choice([STATE_GROUP, KV_GROUP]),
                              own_key=rng.random() < 0.85))
        kept = watch.positions(STATE_GROUP)
        assert (kept.order, kept.unknown) == expected(), step
        assert kept.complete() == (kept.unknown == 0)
        seen_unknown |= kept.unknown > 0
        seen_twice |= any(isinstance(v, dict) for v in watch.mirror(STATE_GROUP).values())
    assert seen_unknown and seen_twice
    # a reset rebuilds them from the new (empty) index, and they follow it
    pool.free_blocks([b for b in pool.blocks[1:] if b.ref_cnt])
    assert pool.reset_prefix_cache()
    assert watch.positions(STATE_GROUP).order == []
    known.clear()
    file(hashes[7], STATE_GROUP)
    assert watch.positions(STATE_GROUP).order == [position_of[hashes[7]]] == [192]


def test_a_pages_second_key_has_no_position():
    """A page filed under a key not its own (vLLM's second key of a page
    that already has one) gives that key no position, in the kept positions
    and in the change log: the page's prefix length is its own key's."""
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=64)
    watch = prefix_index_watch.of_pool(pool)
    watch.positions(STATE_GROUP)
    index_map = watch.current()
    own, second = (make_block_hash_with_group_id(bytes([i]) * 32, STATE_GROUP) for i in (1, 2))
    block = pool.get_new_blocks(1)[0]
    block.set_block_hash(own, num_tokens=128)
    watch.change_log = log = []
    index_map.insert(own, block)
    index_map.insert(second, block)
    kept = watch.positions(STATE_GROUP)
    assert (kept.order, kept.unknown) == ([128], 1)
    assert log == [(bytes([1]) * 32, 128), (bytes([2]) * 32, None)]
    assert index_map.pop(second, block.block_id) is block
    assert index_map.pop(own, block.block_id) is block
    assert log[2:] == [(bytes([2]) * 32, None), (bytes([1]) * 32, 128)]
    assert (watch.positions(STATE_GROUP).order, watch.positions(STATE_GROUP).unknown) == ([], 0)
