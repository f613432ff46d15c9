"""`AtomStateManager.find_longest_cache_hit` gives vLLM's answer without one
pool lookup per hash boundary (real vLLM BlockPool; no model), with the
scheduler's kept set of state hashes (`StateHashes`, watching the index
change) and without it."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import MambaManager  # noqa: E402
from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402

from atom_hybrid_cache.vllm.state_hashes import StateHashes  # noqa: E402
from atom_hybrid_cache.vllm.state_manager import AtomStateManager  # noqa: E402

GROUPS = [1, 2, 3]


def state_spec(block_size: int) -> MambaSpec:
    return MambaSpec(block_size=block_size, shapes=((4,),), dtypes=("float32",),
                     mamba_cache_mode="align")


def pool_with_states(rng, hashes, num_states: int, kept: bool = False,
                     second_keys: float = 0.0) -> BlockPool:
    """A pool indexing states at random boundaries of `hashes`, some in only
    part of the groups (a state page evicted from one group), some filed
    twice under one key, then some keys' pages taken out of the index
    again. Each page holds its key as vLLM files it (`set_block_hash` with
    the prefix's length: the kept positions read it), unless `second_keys`
    of the keys are a page's second key (no position: the scan then reads
    every hash). `kept`: a StateHashes watches the index from the start."""
    pool = BlockPool(num_gpu_blocks=8 * num_states + 8, enable_caching=True, hash_block_size=64)
    if kept:
        StateHashes(pool, GROUPS[0])
    index = pool.cached_block_hash_to_block
    filed = []
    for i in rng.sample(range(len(hashes)), num_states):
        groups = GROUPS if rng.random() < 0.7 else rng.sample(GROUPS, rng.randint(1, 2))
        copies = 2 if rng.random() < 0.2 else 1
        for g in groups:
            key = make_block_hash_with_group_id(hashes[i], g)
            for block in pool.get_new_blocks(copies):
                if rng.random() >= second_keys:
                    block.set_block_hash(key, num_tokens=64 * (i + 1))
                index.insert(key, block)
                filed.append((key, block.block_id))
    for key, block_id in rng.sample(filed, len(filed) // 4):
        assert index.pop(key, block_id) is not None
    return pool


def lookup(cls, hashes, max_length, pool, block_size, alignment=64):
    blocks, hit = cls.find_longest_cache_hit(hashes, max_length, GROUPS, pool,
                                             state_spec(block_size), False, alignment)
    return hit, [[b.block_id for b in group] for group in blocks]


@pytest.mark.parametrize("second_keys", [0.0, 0.1])
@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("block_size", [448, 128, 64])
def test_same_hit_and_blocks_as_vllm_on_random_pools(block_size, kept, second_keys):
    rng = random.Random(block_size)
    for case in range(300):
        hashes = [rng.randbytes(32) for _ in range(rng.randint(1, 120))]
        pool = pool_with_states(rng, hashes, rng.randint(0, min(len(hashes), 12)), kept,
                                second_keys)
        max_length = rng.randint(0, 64 * len(hashes))
        assert (lookup(AtomStateManager, hashes, max_length, pool, block_size)
                == lookup(MambaManager, hashes, max_length, pool, block_size)), case


@pytest.mark.parametrize("kept", [False, True])
def test_a_miss_down_to_zero_costs_no_pool_lookup(monkeypatch, kept):
    # 3,800 boundaries (a 243k-token prompt) with no state: vLLM asks the
    # pool at every one of them; ours at none
    rng = random.Random(0)
    hashes = [rng.randbytes(32) for _ in range(3800)]
    pool = pool_with_states(rng, [rng.randbytes(32)], 1, kept)   # another prompt's state
    calls = []
    real = pool.get_cached_block
    monkeypatch.setattr(pool, "get_cached_block", lambda *a: calls.append(1) or real(*a))
    assert lookup(MambaManager, hashes, 64 * 3800, pool, 448) == (0, [[], [], []])
    assert len(calls) == 3800
    calls.clear()
    assert lookup(AtomStateManager, hashes, 64 * 3800, pool, 448) == (0, [[], [], []])
    assert len(calls) == 0


class _ReadsSeen(list):
    """A hash list that counts the single hashes read of it."""

    reads = 0

    def __getitem__(self, key):
        if not isinstance(key, slice):
            self.reads += 1
        return super().__getitem__(key)


def test_a_lookup_reads_only_the_hashes_at_kept_positions():
    """With the kept states' positions a lookup reads the prompt's hash at
    each position where some state sits, not every hash down to it: 3,800
    boundaries, other prompts' states at 3 positions above this prompt's
    state, 3,000 boundaries down: 4 reads, then vLLM's own lookup from the
    hit. Filed as each page's second key (no position), the scan reads the
    3,800 hashes in slices and no single one, and finds the same hit."""
    reads = {}
    for positioned in (True, False):
        rng = random.Random(3)
        hashes = _ReadsSeen(rng.randbytes(32) for _ in range(3800))
        pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=64)
        StateHashes(pool, GROUPS[0])
        for i, block_hash in [(3000, rng.randbytes(32)), (2000, rng.randbytes(32)),
                              (1000, rng.randbytes(32)), (799, hashes[799])]:
            for g in GROUPS:
                block = pool.get_new_blocks(1)[0]
                key = make_block_hash_with_group_id(block_hash, g)
                if positioned:
                    block.set_block_hash(key, num_tokens=64 * (i + 1))
                pool.cached_block_hash_to_block.insert(key, block)
        hashes.reads = 0
        blocks, hit = AtomStateManager.find_longest_cache_hit(
            hashes, 64 * 3800, GROUPS, pool, state_spec(448), False, 64)
        assert hit == 64 * 800 and [b[-1].is_null for b in blocks] == [False] * 3
        reads[positioned] = hashes.reads
    assert reads[True] == reads[False] + 4


def test_the_kept_hashes_follow_the_index_through_a_reset():
    rng = random.Random(1)
    hashes = [rng.randbytes(32) for _ in range(40)]
    pool = pool_with_states(rng, hashes, 30, kept=True)
    kept = StateHashes(pool, GROUPS[0])
    suffix = make_block_hash_with_group_id(b"", GROUPS[0])
    in_index = {k[:-len(suffix)] for k in pool.cached_block_hash_to_block._cache
                if k.endswith(suffix)}
    assert kept.current() == in_index and len(in_index) > 5
    # a reset replaces vLLM's index: the set is the new one's (empty), and
    # it follows the new index from then on
    for key, blocks in list(pool.cached_block_hash_to_block._cache.items()):
        for b in (list(blocks.values()) if isinstance(blocks, dict) else [blocks]):
            pool.cached_block_hash_to_block.pop(key, b.block_id)
    assert kept.current() == set()
    pool.reset_prefix_cache()
    assert kept.current() == set()
    block = pool.get_new_blocks(1)[0]
    pool.cached_block_hash_to_block.insert(make_block_hash_with_group_id(hashes[3], GROUPS[0]),
                                           block)
    assert kept.current() == {hashes[3]}
    # a key filed twice stays while one of its pages does
    key = make_block_hash_with_group_id(hashes[5], GROUPS[0])
    first, second = pool.get_new_blocks(2)
    pool.cached_block_hash_to_block.insert(key, first)
    pool.cached_block_hash_to_block.insert(key, second)
    pool.cached_block_hash_to_block.pop(key, first.block_id)
    assert kept.current() == {hashes[3], hashes[5]}
    pool.cached_block_hash_to_block.pop(key, second.block_id)
    assert kept.current() == {hashes[3]}
    # another group's keys are not this group's states
    pool.cached_block_hash_to_block.insert(make_block_hash_with_group_id(hashes[7], GROUPS[1]),
                                           pool.get_new_blocks(1)[0])
    assert kept.current() == {hashes[3]}


def test_first_at_or_below_is_the_plain_scan():
    """The C scan over a slice answers as a loop over the indices would,
    tops past the list's end and a stop at index 0 included, with the kept
    positions (each kept hash at its prefix length, among other prefixes'
    lengths) and without."""
    from atom_hybrid_cache.vllm.prefix_index_watch import KeyPositions
    from atom_hybrid_cache.vllm.state_hashes import first_at_or_below

    rng = random.Random(7)
    for _ in range(2000):
        n = rng.randrange(0, 40)
        hashes = [bytes([i]) for i in range(n)]
        kept = {h for h in hashes if rng.random() < 0.15}
        step = rng.choice([1, 1, 3, 10])
        last = rng.randrange(0, 45)
        first = last + rng.randrange(-2, 50)
        asked = list(range(first, last - 1, -step))
        want = next((k for k, i in enumerate(asked) if i < n and hashes[i] in kept), len(asked))
        assert first_at_or_below(kept, hashes, first, last, step) == want, (n, first, last, step)
        positions = KeyPositions()
        for i, h in enumerate(hashes):
            if h in kept:
                positions.add(h, 64 * (i + 1))
        for j in range(rng.randrange(0, 5)):
            positions.add(b"other" + bytes([j]), rng.randrange(1, 64 * (n + 3)))
        assert first_at_or_below(kept, hashes, first, last, step, positions, 64) == want
    # exact: the third asked index (20, 10, 0: index 0) holds the only kept hash
    assert first_at_or_below({b"\x00"}, [bytes([i]) for i in range(25)], 20, 0, 10) == 2
