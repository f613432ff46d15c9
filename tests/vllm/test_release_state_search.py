"""The release's search for kept states (`StateSearch.highest_at_or_below`)
against a plain statement of what it looks at, on random pools (real vLLM
BlockPool and prefix index; no scheduler, no model).

For each top: every hash unit from the top down to one page below it, then
the page boundaries below that, at most `max_pages` pages under the top; the
answer is the first of these where every state group indexes a state of
exactly that length. Each answer once, highest first."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402

from atom_hybrid_cache.vllm.state_search import StateSearch  # noqa: E402

GROUPS = [1, 2, 3]
H = 64


def pool_with_states(rng, hashes, num_states: int,
                     filed_as_vllm: bool = False) -> tuple[BlockPool, set]:
    """States at random unit boundaries of `hashes`; some in only part of
    the groups (evicted from the others), some filed under a length that
    is not their position (another prompt's page under the same hash), some
    filed under one key twice (vLLM's index then holds a dict of pages, and
    its first is read). Returns the pool and the positions every group
    holds correctly. `filed_as_vllm`: each page holds its key as its own
    (`set_block_hash`, as vLLM files a page), so the watcher knows every
    key's position and the walks ask only the kept positions; else only
    the page's length is set (no key of its own: the walks scan the
    ranges)."""
    pool = BlockPool(num_gpu_blocks=8 * num_states + 8, enable_caching=True, hash_block_size=H)
    full = set()
    for i in rng.sample(range(len(hashes)), num_states):
        pos = (i + 1) * H
        roll = rng.random()
        groups = GROUPS if roll < 0.8 else rng.sample(GROUPS, rng.randint(1, 2))
        length = pos if roll < 0.7 or roll >= 0.8 else pos + H
        copies = 2 if rng.random() < 0.2 else 1
        for g in groups:
            for block in pool.get_new_blocks(copies):
                key = make_block_hash_with_group_id(hashes[i], g)
                if filed_as_vllm:
                    block.set_block_hash(key, num_tokens=length)
                else:
                    block._block_hash_num_tokens = length
                pool.cached_block_hash_to_block.insert(key, block)
        if groups == GROUPS and length == pos:
            full.add(pos)
    return pool, full


def stated(tops, full: set, page: int, max_pages: int) -> list[int]:
    answers = set()
    for top in tops:
        if top < H:
            continue
        top = top // H * H
        units = range(top, max(0, top - page) - 1, -H)
        pages = range((top - page - 1) // page * page, max(0, top - max_pages * page) - 1, -page)
        looked = [p for p in [*units, *pages] if 0 < p and p >= top - max_pages * page]
        answers.update(next(([p] for p in looked if p in full), []))
    return sorted(answers, reverse=True)


@pytest.mark.parametrize("filed_as_vllm", [False, True])
@pytest.mark.parametrize("page", [448, 128, 64])
def test_the_search_finds_what_it_says_on_random_pools(page, filed_as_vllm, monkeypatch):
    from atom_hybrid_cache.core import eviction

    kept_walks = []
    real = eviction._highest_at_kept
    monkeypatch.setattr(eviction, "_highest_at_kept",
                        lambda *a: kept_walks.append(1) or real(*a))
    rng = random.Random(page)
    complete = 0
    for case in range(400):
        hashes = [rng.randbytes(32) for _ in range(rng.randint(1, 150))]
        pool, full = pool_with_states(rng, hashes, rng.randint(0, min(len(hashes), 20)),
                                      filed_as_vllm)
        end = H * len(hashes) + rng.randint(0, H - 1)
        # a top may lie past the prefix's last hash (none is indexed there)
        tops = [rng.randint(0, end + 3 * H) for _ in range(rng.randint(0, 6))]
        max_pages = rng.choice([0, 1, 3, 64])
        search = StateSearch(pool, GROUPS, H, page)
        complete += search.hashes.positions().complete()
        got = search.highest_at_or_below(hashes, tops, max_pages)
        assert [pos for pos, _ in got] == stated(tops, full, page, max_pages), case
        for pos, blocks in got:
            assert sorted(b.block_hash_num_tokens for b in blocks) == [pos] * len(GROUPS)
        # the diagnostics' whole-prefix walk finds exactly the full states
        assert search.positions(hashes, end) == sorted(p for p in full if p < end), case
    # every walk asked the kept positions alone where the watcher knew them
    # (without keys of their own: only the pools with no state)
    assert len(kept_walks) == complete
    assert complete == 400 if filed_as_vllm else complete < 40


def test_an_anchor_between_pages_is_found_below_its_top():
    # pages of 448, a state at 8,384 (= 448 * 18 + 320) and one at the
    # page boundary 8,064 under it: a top of 8,400 gets 8,384
    hashes = [bytes([i % 256, i // 256]) * 16 for i in range(200)]
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=H)
    for pos in (8064, 8384):
        for g, block in zip(GROUPS, pool.get_new_blocks(3)):
            block._block_hash_num_tokens = pos
            pool.cached_block_hash_to_block.insert(
                make_block_hash_with_group_id(hashes[pos // H - 1], g), block)
    search = StateSearch(pool, GROUPS, H, 448)
    assert [p for p, _ in search.highest_at_or_below(hashes, [8400])] == [8384]
    # a top more than a page above the anchor sees page boundaries only
    assert [p for p, _ in search.highest_at_or_below(hashes, [8900])] == [8064]
    assert [p for p, _ in search.highest_at_or_below(hashes, [8400, 8900])] == [8384, 8064]


def test_one_search_follows_the_pool_through_changes_and_a_reset():
    """A search keeps what it read of the pool's watcher (its kept hashes,
    their positions, its reader) from walk to walk: states filed and
    evicted between walks, and a reset's new index, are each seen by the
    next walk."""
    rng = random.Random(11)
    page = 128
    hashes = [rng.randbytes(32) for _ in range(60)]
    pool = BlockPool(num_gpu_blocks=400, enable_caching=True, hash_block_size=H)
    search = StateSearch(pool, GROUPS, H, page)
    filed: dict = {}   # position -> the pages of every group

    def file(pos):
        blocks = pool.get_new_blocks(len(GROUPS))
        for g, block in zip(GROUPS, blocks):
            key = make_block_hash_with_group_id(hashes[pos // H - 1], g)
            block.set_block_hash(key, num_tokens=pos)
            pool.cached_block_hash_to_block.insert(key, block)
        filed[pos] = blocks

    def evict(pos):
        blocks = filed.pop(pos)
        pool.evict_blocks({b.block_id for b in blocks})
        pool.free_blocks(blocks)

    tops = [H * len(hashes)]
    for step in range(300):
        if filed and rng.random() < 0.4:
            evict(rng.choice(sorted(filed)))
        else:
            pos = H * rng.randint(1, len(hashes))
            if pos not in filed:
                file(pos)
        got = search.highest_at_or_below(hashes, tops, max_pages=64)
        assert [p for p, _ in got] == stated(tops, set(filed), page, 64), step
    pool.free_blocks([b for blocks in filed.values() for b in blocks])
    assert pool.reset_prefix_cache()
    filed.clear()
    assert search.highest_at_or_below(hashes, tops, max_pages=64) == []
    file(5 * page)
    got = search.highest_at_or_below(hashes, tops, max_pages=64)
    assert got == [(5 * page, filed[5 * page])]
    assert search.hashes.positions().complete()
