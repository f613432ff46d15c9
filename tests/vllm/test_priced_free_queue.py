"""vLLM's BlockPool with the priced free queue (vllm/priced_free_queue.py)
hands out blocks in the order the planner's page pool (core/page_pool.py)
does for the same calls: random allocations, hits, and frees of cached and
uncached blocks with prices, on a real vLLM BlockPool (no scheduler, no
model). Without the swap vLLM's FIFO hands them out otherwise."""

from __future__ import annotations

import logging
import random

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402

from atom_hybrid_cache.core.page_pool import PagePool  # noqa: E402
from atom_hybrid_cache.vllm.priced_free_queue import PricedFreeBlockQueue  # noqa: E402
from atom_hybrid_cache.vllm.priced_free_queue import install_priced_queue as _priced_queue  # noqa: E402

N = 40


def _replay(seed: int, pool: BlockPool, pages: PagePool, swap_at=None, swap=None) -> list:
    """The same random calls on vLLM's pool and the planner's; returns the
    block ids vLLM handed out (checked against the planner's as it goes).
    `swap()` runs before call `swap_at`."""
    rng = random.Random(seed)
    held: list = []
    handed = []
    key = 0
    for step in range(300):
        if step == swap_at:
            swap()
        op = rng.random()
        if op < 0.4 and pool.get_num_free_blocks():
            n = rng.randint(1, min(5, pool.get_num_free_blocks()))
            got = [b.block_id for b in pool.get_new_blocks(n)]
            assert got == pages.allocate(n)
            handed += got
            for b in got:
                if rng.random() < 0.7:          # the block fills: indexed
                    key += 1
                    pool.blocks[b].set_block_hash(
                        make_block_hash_with_group_id(key.to_bytes(8, "little"), 0))
                    pages.index_page(b, key)
            held += got
        elif op < 0.5:
            free = [b for b in range(1, N) if pool.blocks[b].ref_cnt == 0
                    and pool.blocks[b].block_hash is not None]
            if free:                            # a hit on a free cached block
                b = rng.choice(free)
                pool.touch([pool.blocks[b]])
                pages.touch([b])
                held.append(b)
        elif held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            out, held = held[:k], held[k:]
            spans = [(0, k, rng.choice([0.0, 3.0, 9.6, 40.0]))]
            if isinstance(pool.free_block_queue, PricedFreeBlockQueue):
                pool.free_block_queue.set_prices([pool.blocks[b] for b in out], spans)
            pages.free_order.set_prices(out, spans)
            pool.free_blocks([pool.blocks[b] for b in out])
            pages.free(out)
        assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == \
            pages.free_order.in_order()
    return handed


@pytest.mark.parametrize("seed", range(6))
def test_vllms_pool_with_the_priced_queue_is_the_planners(seed, caplog):
    pool = BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=16)
    with caplog.at_level(logging.INFO, logger="atom_hybrid_cache"):
        # 1 x the pool of 40 pages for a page of 40 tokens: 1 page of life
        # a token of price, as the planner's pool below
        queue = _priced_queue(pool, 1.0, page_tokens=N)
    assert pool.free_block_queue is queue
    assert ("a freed unit whose loss would cost a resume every token of its pages stays 40 "
            "pages (1 x the pool, at the share now) longer") in caplog.text
    assert ("auto: 0.25 where a request slot's share of the pool holds up to 32 checkpoints' "
            "worth, fading to vLLM's FIFO at 120") in caplog.text
    priced = _replay(seed, pool, PagePool(N, price_weight=1.0))
    # vLLM's own queue gives the FIFO: another order for the same calls
    fifo = _replay(seed, BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=16),
                   PagePool(N))
    assert priced != fifo


@pytest.mark.parametrize("seed", range(4))
def test_a_swap_mid_run_keeps_the_free_blocks_their_order_and_their_hashes(seed):
    """The queue turns priced at the step whose requests in flight fall
    under the line, mid-run: the blocks free then (cached ones among them)
    keep vLLM's FIFO order at the head of the priced queue and their
    hashes (later calls hit them), and from there vLLM's pool and the
    planner's, turned at the same call, hand out the same blocks."""
    pool = BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=16)
    pages = PagePool(N)
    seen = {}

    def swap():
        before = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        cached = {b: pool.blocks[b].block_hash for b in before
                  if pool.blocks[b].block_hash is not None}
        assert _priced_queue(pool, None, page_tokens=N, weight_now=1.0) is not None
        pages.set_price_weight(1.0)
        assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == before
        assert {b: pool.blocks[b].block_hash for b in cached} == cached
        seen.update(free=len(before), cached=len(cached))
    late = _replay(seed, pool, pages, swap_at=150, swap=swap)
    assert isinstance(pool.free_block_queue, PricedFreeBlockQueue)
    # the swap found cached free blocks, and it changed what was handed out
    assert seen["cached"] > 0
    fifo = _replay(seed, BlockPool(num_gpu_blocks=N, enable_caching=True, hash_block_size=16),
                   PagePool(N))
    assert late[:len(late) // 4] == fifo[:len(late) // 4] and late != fifo


def test_the_queue_answers_vllms_other_calls():
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    queue = _priced_queue(pool, 1.0, page_tokens=8)
    first = queue.popleft()
    assert first.block_id == 1 and queue.num_free_blocks == 6
    queue.append(first)
    assert [b.block_id for b in queue.iter_blocks_after(None)] == [2, 3, 4, 5, 6, 7, 1]
    assert [b.block_id for b in queue.iter_blocks_after(pool.blocks[5])] == [6, 7, 1]
    assert queue.popleft_n(0) == []
    queue.popleft_n(7)
    with pytest.raises(ValueError):
        queue.popleft()
