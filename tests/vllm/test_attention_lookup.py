"""AtomAttentionLookup: the plugin's walk of the full-attention blocks
returns what vLLM's FullAttentionManager.find_longest_cache_hit returns, on
random pools of vLLM's BlockPool (holes, several blocks under one hash,
partial blocks indexed under a hash unit inside them, several groups)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from atom_hybrid_cache.vllm.attention_lookup import AtomAttentionLookup, install  # noqa: E402


def _spec(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8,
                             dtype=torch.float32)


def _random_pool(rng: random.Random, unit: int, block: int, hashes: list, groups: list):
    """A pool indexing a random part of `hashes`' blocks: runs with holes,
    some hashes naming two blocks, some hash units inside a block indexed
    as partial entries."""
    pool = BlockPool(4096, True, unit)
    scale = block // unit
    free = iter(range(1, 4096))
    index = pool.cached_block_hash_to_block
    n_blocks = len(hashes) // scale
    run = rng.randrange(0, n_blocks + 1)
    for g in groups:
        # the groups mostly agree; one may lose a block of the run
        lost = rng.randrange(0, n_blocks + 1) if rng.random() < 0.3 else None
        for j in range(n_blocks):
            if j >= run and rng.random() < 0.7:
                continue
            if j == lost:
                continue
            key = make_block_hash_with_group_id(hashes[(j + 1) * scale - 1], g)
            for _ in range(2 if rng.random() < 0.2 else 1):
                index.insert(key, pool.blocks[next(free)])
        for i in range(len(hashes)):
            if (i + 1) % scale and rng.random() < 0.15:
                index.insert(make_block_hash_with_group_id(hashes[i], g), pool.blocks[next(free)])
    return pool


@pytest.mark.parametrize("unit,block", [(16, 16), (16, 64), (50, 400)])
def test_walk_equals_vllms_on_random_pools(unit, block):
    rng = random.Random(unit * 1000 + block)
    spec = _spec(block)
    compared = partial_hits = 0
    for trial in range(300):
        hashes = [rng.randbytes(8) for _ in range(rng.randrange(0, 12 * block // unit))]
        groups = [0] if trial % 3 else [0, 2]
        pool = _random_pool(rng, unit, block, hashes, groups)
        for alignment in {unit, block}:
            for max_length in (len(hashes) * unit, rng.randrange(0, len(hashes) * unit + 1)):
                args = (hashes, max_length, groups, pool, spec, False, alignment)
                ours = AtomAttentionLookup.find_longest_cache_hit(*args)
                theirs = FullAttentionManager.find_longest_cache_hit(*args)
                assert ours == theirs, (trial, alignment, max_length)
                assert [[b.block_id for b in g] for g in ours[0]] == \
                    [[b.block_id for b in g] for g in theirs[0]]
                compared += 1
                partial_hits += ours[1] % block != 0
    assert compared >= 600
    if unit < block:
        assert partial_hits > 0   # the hash-unit probes were exercised


def test_cases_it_does_not_cover_take_vllms_method():
    rng = random.Random(7)
    hashes = [rng.randbytes(8) for _ in range(40)]
    pool = _random_pool(rng, 16, 64, hashes, [0])
    spec = _spec(64)
    # EAGLE's dropped block: vLLM's method answers
    args = (hashes, 40 * 16, [0], pool, spec, True, 16)
    assert AtomAttentionLookup.find_longest_cache_hit(*args) == \
        FullAttentionManager.find_longest_cache_hit(*args)


def test_install_switches_vllms_full_attention_groups_only():
    from collections import namedtuple
    Group = namedtuple("Group", "spec group_ids manager_cls use_eagle")

    class Other(FullAttentionManager):
        pass

    class Coordinator:
        attention_groups = [Group(None, [0], FullAttentionManager, False),
                            Group(None, [1], Other, False)]

    c = Coordinator()
    assert install(c) == 1
    assert [g.manager_cls for g in c.attention_groups] == [AtomAttentionLookup, Other]


def test_without_vllms_plain_index_dict_vllms_method_answers(monkeypatch):
    """Where the prefix index is not the dict the mirrors read, no mirror is
    kept and vLLM's walk answers."""
    from atom_hybrid_cache.vllm import prefix_index_watch, private_api
    monkeypatch.setattr(private_api, "prefix_index", lambda block_pool: None)
    rng = random.Random(11)
    hashes = [rng.randbytes(8) for _ in range(40)]
    pool = _random_pool(rng, 16, 64, hashes, [0])
    args = (hashes, 40 * 16, [0], pool, _spec(64), False, 16)
    assert AtomAttentionLookup.find_longest_cache_hit(*args) == \
        FullAttentionManager.find_longest_cache_hit(*args)
    assert prefix_index_watch.of_pool(pool).mirror(0) is None
