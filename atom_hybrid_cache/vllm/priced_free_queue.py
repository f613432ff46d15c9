"""vLLM's free block queue, priced: `BlockPool.free_block_queue` replaced by
one that hands out blocks in the core's priced order
(`core/priced_eviction.py`), where the plugin's release frees in units.

It answers every call `BlockPool` makes on vLLM's `FreeKVCacheBlockQueue`
(`popleft`, `popleft_n`, `remove`, `append`, `append_n`, `prepend_n`,
`get_all_free_blocks`, `iter_blocks_after`, `num_free_blocks`), over block
ids; the blocks' own `prev_free_block` / `next_free_block` links stay None.
The release (`release.py`) sets the prices of what it frees
(`set_prices`) before vLLM's `free_blocks` appends them.
"""

from __future__ import annotations

import logging
from typing import Iterator, Optional, Sequence

from ..core.pool_budget import MIN_SLOT_CHECKPOINTS
from ..core.priced_eviction import (AUTO_PRICE_WEIGHT, PRICE_FADE_END_CHECKPOINTS,
                                    PricedFreeOrder, pages_per_token)

logger = logging.getLogger("atom_hybrid_cache")


class PricedFreeBlockQueue:
    def __init__(self, blocks: list, free_blocks: Sequence, weight: float) -> None:
        """`blocks`: the pool's blocks, by id; `free_blocks`: vLLM's queue's
        blocks at the swap, in its order (handed out first, in that order)."""
        self._blocks = blocks
        for b in free_blocks:
            b.prev_free_block = b.next_free_block = None
        self.order = PricedFreeOrder(len(blocks), [b.block_id for b in free_blocks], weight)

    @property
    def num_free_blocks(self) -> int:
        return len(self.order)

    def set_prices(self, blocks: Sequence, priced_spans) -> None:
        """`priced_spans`: (start, stop, price) over `blocks`
        (`core.priced_eviction.span_prices`)."""
        self.order.set_prices([b.block_id for b in blocks], priced_spans)

    def popleft(self):
        if not len(self.order):
            raise ValueError("No free blocks available")
        return self._blocks[self.order.pop_n(1)[0]]

    def popleft_n(self, n: int) -> list:
        blocks = self._blocks
        return [blocks[i] for i in self.order.pop_n(n)] if n else []

    def remove(self, block) -> None:
        self.order.remove(block.block_id)

    def append(self, block) -> None:
        self.order.push_back([block.block_id])

    def append_n(self, blocks: Sequence) -> None:
        if blocks:
            self.order.push_back([b.block_id for b in blocks])

    def prepend_n(self, blocks: Sequence) -> None:
        if blocks:
            self.order.push_front([b.block_id for b in blocks])

    def get_all_free_blocks(self) -> list:
        return [self._blocks[i] for i in self.order.in_order()]

    def iter_blocks_after(self, cursor: Optional[object]) -> Iterator:
        """The free blocks after `cursor` (from the first if None or no longer
        free) in eviction order; sorts the queue (vLLM's CPU offload walk)."""
        ids = self.order.in_order()
        start = 0
        if cursor is not None and cursor.block_id in self.order:
            start = ids.index(cursor.block_id) + 1
        for i in ids[start:]:
            yield self._blocks[i]


def install_priced_queue(pool, setting: Optional[float], page_tokens: int,
                         weight_now: Optional[float] = None) -> Optional[PricedFreeBlockQueue]:
    """vLLM's free queue replaced by the priced one, at `weight_now` (None:
    `setting`'s), at set-up or at the step whose requests in flight price
    it: the blocks free then are handed out first, in vLLM's order. None
    where vLLM's pool has another queue (public names, so not in
    `private_api`; the class is checked instead)."""
    queue = getattr(pool, "free_block_queue", None)
    if type(queue).__name__ != "FreeKVCacheBlockQueue" or not hasattr(pool, "blocks"):
        logger.warning("atom_hybrid_cache: vLLM's free block queue is a %s, not the "
                       "FreeKVCacheBlockQueue this knows: priced eviction is off "
                       "(vLLM's order runs)", type(queue).__name__)
        return None
    if weight_now is None:
        weight_now = setting or 0.0
    weight_pages = pages_per_token(weight_now, pool.num_gpu_blocks, page_tokens)
    priced = PricedFreeBlockQueue(pool.blocks, queue.get_all_free_blocks(), weight_pages)
    pool.free_block_queue = priced
    logger.info("atom_hybrid_cache: priced eviction: a freed unit whose loss would cost a "
                "resume every token of its pages stays %g pages (%g x the pool, at the share now) "
                "longer in the free queue, cheaper units less, KV above every state none "
                "(ATOM_EVICTION_PRICE_WEIGHT=%s; auto: %g where a request slot's share of the "
                "pool holds up to %d checkpoints' worth, fading to vLLM's FIFO at %d; 0: "
                "vLLM's FIFO)",
                round(weight_pages * page_tokens),
                weight_now, "auto" if setting is None else f"{setting:g}", AUTO_PRICE_WEIGHT,
                MIN_SLOT_CHECKPOINTS, PRICE_FADE_END_CHECKPOINTS)
    return priced


def queue_at_weight(pool, policy, queue: Optional[PricedFreeBlockQueue]
                    ) -> Optional[PricedFreeBlockQueue]:
    """The free queue for `policy`'s price weight now (`queue`: the priced
    one installed before, or None): vLLM's own while the weight is 0, the
    priced one from the first weight > 0 on (at set-up, or at the step
    whose requests in flight price it), its weight following the policy's."""
    weight = policy.eviction_price_weight
    if queue is None:
        if weight <= 0:
            return None
        return install_priced_queue(pool, policy.configured.eviction_price_weight,
                                    policy.block_size, weight)
    queue.order.weight = pages_per_token(weight, pool.num_gpu_blocks, policy.block_size)
    return queue
