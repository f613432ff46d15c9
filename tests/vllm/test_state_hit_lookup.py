"""`AtomStateManager.find_longest_cache_hit` gives vLLM's answer without one
pool lookup per hash boundary (real vLLM BlockPool; no model)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import MambaManager  # noqa: E402
from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402

from atom_hybrid_cache.vllm.state_manager import AtomStateManager  # noqa: E402

GROUPS = [1, 2, 3]


def state_spec(block_size: int) -> MambaSpec:
    return MambaSpec(block_size=block_size, shapes=((4,),), dtypes=("float32",),
                     mamba_cache_mode="align")


def pool_with_states(rng, hashes, num_states: int) -> BlockPool:
    """A pool indexing states at random boundaries of `hashes`, some in only
    part of the groups (a state page evicted from one group)."""
    pool = BlockPool(num_gpu_blocks=4 * num_states + 8, enable_caching=True, hash_block_size=64)
    for i in rng.sample(range(len(hashes)), num_states):
        groups = GROUPS if rng.random() < 0.7 else rng.sample(GROUPS, rng.randint(1, 2))
        for g, block in zip(groups, pool.get_new_blocks(len(groups))):
            pool.cached_block_hash_to_block.insert(make_block_hash_with_group_id(hashes[i], g), block)
    return pool


def lookup(cls, hashes, max_length, pool, block_size, alignment=64):
    blocks, hit = cls.find_longest_cache_hit(hashes, max_length, GROUPS, pool,
                                             state_spec(block_size), False, alignment)
    return hit, [[b.block_id for b in group] for group in blocks]


@pytest.mark.parametrize("block_size", [448, 128, 64])
def test_same_hit_and_blocks_as_vllm_on_random_pools(block_size):
    rng = random.Random(block_size)
    for case in range(300):
        hashes = [rng.randbytes(32) for _ in range(rng.randint(1, 120))]
        pool = pool_with_states(rng, hashes, rng.randint(0, min(len(hashes), 12)))
        max_length = rng.randint(0, 64 * len(hashes))
        assert (lookup(AtomStateManager, hashes, max_length, pool, block_size)
                == lookup(MambaManager, hashes, max_length, pool, block_size)), case


def test_a_miss_down_to_zero_costs_no_pool_lookup(monkeypatch):
    # 3,800 boundaries (a 243k-token prompt) with no state: vLLM asks the
    # pool at every one of them; ours at none
    rng = random.Random(0)
    hashes = [rng.randbytes(32) for _ in range(3800)]
    pool = pool_with_states(rng, [rng.randbytes(32)], 1)   # a state of another prompt
    calls = []
    real = pool.get_cached_block
    monkeypatch.setattr(pool, "get_cached_block", lambda *a: calls.append(1) or real(*a))
    assert lookup(MambaManager, hashes, 64 * 3800, pool, 448) == (0, [[], [], []])
    assert len(calls) == 3800
    calls.clear()
    assert lookup(AtomStateManager, hashes, 64 * 3800, pool, 448) == (0, [[], [], []])
    assert len(calls) == 0
