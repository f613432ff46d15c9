"""Paged KV blocks: free order, reference counts, the prefix index.

Invariants (checked by tests/test_core_properties.py):
- block 0 is the null block: never handed out, never indexed;
- a block with ref_cnt > 0 is in no free structure;
- a free block sits in exactly one of the two free structures: `_vacant`
  (holds no indexed content) or `_cached_free` (indexed content, LRU order);
- `hash_to_block[h] == b` iff `block_hash[b] == h`.

Free order: vacant blocks first, lowest id first, so cached content survives
as long as possible; then cached blocks from the LRU head. Callers free a
request's blocks tail first, so under pressure a prefix loses its tail before
its head (a shorter prefix stays usable; a headless tail never is).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Callable, Iterable, Optional, Sequence

NULL_BLOCK = 0


class KVBlockPool:
    def __init__(self, num_blocks: int,
                 on_drop: Optional[Callable[[int], None]] = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[Optional[int]] = [None] * num_blocks
        # (parent hash, tokens) of each indexed block, for the collision check.
        self.block_content: list[Optional[tuple]] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self._vacant = list(range(1, num_blocks))  # a heap; already sorted
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        # Called with a hash when its content leaves the index (eviction or
        # retirement): state checkpoints filed under it become unreachable.
        self.on_drop = on_drop
        self.evicted = 0      # indexed content lost because the pool ran out
        self.retired = 0      # indexed content dropped because it went stale
        self.collisions = 0   # lookups whose hash matched but content did not

    # -- queries -------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._vacant) + len(self._cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - self.num_free

    @property
    def num_cached_free(self) -> int:
        return len(self._cached_free)

    @property
    def num_vacant(self) -> int:
        return len(self._vacant)

    @property
    def num_indexed(self) -> int:
        return len(self.hash_to_block)

    def lookup(self, block_hash: int, parent: int, tokens) -> Optional[int]:
        """The block holding exactly this content, or None."""
        b = self.hash_to_block.get(block_hash)
        if b is None:
            return None
        content = self.block_content[b]
        if content[0] != parent or (content[1] is not tokens and content[1] != tokens):
            self.collisions += 1
            return None
        return b

    def prefix_blocks(self, hashes: Sequence[int], contents: Sequence, limit: int,
                      parent0: int = 0) -> list[int]:
        """Blocks of the longest indexed prefix of `hashes`, at most `limit` long."""
        out: list[int] = []
        h2b = self.hash_to_block
        bc = self.block_content
        parent = parent0
        for i in range(min(limit, len(hashes))):
            h = hashes[i]
            b = h2b.get(h)
            if b is None:
                break
            content = bc[b]
            tokens = contents[i]
            if content[0] != parent or (content[1] is not tokens and content[1] != tokens):
                self.collisions += 1
                break
            out.append(b)
            parent = h
        return out

    # -- allocation ----------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n blocks with ref_cnt 1; evicts cached content when vacant runs out."""
        if n > self.num_free:
            raise MemoryError(f"KV pool: asked for {n} blocks, {self.num_free} free")
        out = []
        vacant = self._vacant
        for _ in range(n):
            if vacant:
                b = heapq.heappop(vacant)
            else:
                b, _ = self._cached_free.popitem(last=False)
                self._drop_content(b)
                self.evicted += 1
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def acquire(self, blocks: Iterable[int]) -> None:
        """Take a reference on cache hits (they may be free and cached)."""
        rc = self.ref_cnt
        cf = self._cached_free
        for b in blocks:
            if rc[b] == 0:
                del cf[b]
            rc[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop a reference; pass a request's blocks tail first."""
        rc = self.ref_cnt
        cf = self._cached_free
        bh = self.block_hash
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            n = rc[b] - 1
            rc[b] = n
            if n == 0:
                if bh[b] is None:
                    heapq.heappush(self._vacant, b)
                else:
                    cf[b] = None
            elif n < 0:
                raise AssertionError(f"KV block {b} freed more often than taken")

    # -- index ---------------------------------------------------------
    def commit(self, block: int, block_hash: int, parent: int, tokens) -> bool:
        """Index a full block. False when the content is already indexed
        elsewhere (two requests computed it at once); the block then stays
        unindexed and returns to the vacant list when freed."""
        if block == NULL_BLOCK:
            raise AssertionError("the null block is never indexed")
        if block_hash in self.hash_to_block or self.block_hash[block] is not None:
            return False
        self.block_hash[block] = block_hash
        self.block_content[block] = (parent, tokens)
        self.hash_to_block[block_hash] = block
        return True

    def retire(self, block: int) -> None:
        """Unindex a block whose content went stale (e.g. speculative tokens
        rolled back over it); the block itself stays with its owner."""
        if self.block_hash[block] is None:
            return
        if self.ref_cnt[block] == 0:
            del self._cached_free[block]
            heapq.heappush(self._vacant, block)
        self._drop_content(block)
        self.retired += 1

    def _drop_content(self, b: int) -> None:
        h = self.block_hash[b]
        if h is None:
            return
        del self.hash_to_block[h]
        self.block_hash[b] = None
        self.block_content[b] = None
        if self.on_drop is not None:
            self.on_drop(h)
