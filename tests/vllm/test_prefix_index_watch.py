"""One watcher of vLLM's prefix index (`PrefixIndexWatch`) for the kept state
hashes and the step's change log: the index's insert and pop wrapped once,
both kept through a reset (real vLLM BlockPool; no model)."""

from __future__ import annotations

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
    lookups.record()
    coordinator.find_longest_cache_hit(prefix, 2)
    lookups.stop_recording()
    kv = _insert(pool, b"k" * 32, KV_GROUP)
    pool.cached_block_hash_to_block.pop(make_block_hash_with_group_id(b"s" * 32, STATE_GROUP),
                                        state.block_id)
    assert lookups._changes == [b"k" * 32, b"s" * 32]
    assert kept.current() == set()
    coordinator.find_longest_cache_hit(prefix, 2)
    assert (lookups.answered, lookups.dropped, coordinator.calls) == (0, 1, 2)
    lookups.forget()
    assert kept.watch.change_log is None

    # a reset (every page free): the new index is wrapped once, and both
    # follow it
    pool.free_blocks([state, kv])
    assert pool.reset_prefix_cache()
    assert pool.cached_block_hash_to_block is not index_map
    lookups.record()
    assert kept.current() == set()
    coordinator.find_longest_cache_hit(prefix, 2)
    _insert(pool, b"t" * 32, STATE_GROUP)
    assert kept.current() == {b"t" * 32} and lookups._changes == [b"t" * 32]
    unwrapped_insert, _ = pool.cached_block_hash_to_block._atom_unwrapped
    assert unwrapped_insert.__func__ is BlockHashToBlockMap.insert
