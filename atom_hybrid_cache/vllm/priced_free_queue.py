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

from typing import Iterator, Optional, Sequence

from ..core.priced_eviction import PricedFreeOrder


class PricedFreeBlockQueue:
    def __init__(self, blocks: list, free_blocks: Sequence, weight: float) -> None:
        """`blocks`: the pool's blocks, by id; `free_blocks`: vLLM's queue's
        blocks at the swap, in its order (none holds indexed content yet)."""
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
