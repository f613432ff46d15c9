"""Each prompt's prefix hashes in the replay (`simulator.py`): the block
tuples a trace source gives, hashed in a chain, the previous prompt's
hashes of the same conversation reused as far as its tuples are the same
objects (a turn resends the previous prompt and continues it).
"""

from __future__ import annotations

from typing import Protocol

from ..core.hashing import ROOT_PARENT, hash_block


class BlockSource(Protocol):
    def prompt_block_tuples(self, conv, i: int, block_size: int) -> tuple[list, int]: ...


class PromptHasher:
    """Block hashes of each prompt, reusing the previous prompt's hashes of
    the same conversation as far as its block tuples are the same objects."""

    def __init__(self, source: BlockSource, block_size: int) -> None:
        self.source = source
        self.block_size = block_size
        self._prev: dict = {}

    def blocks(self, conv, i: int) -> tuple[list, list, int]:
        tuples, prompt_len = self.source.prompt_block_tuples(conv, i, self.block_size)
        prev_tuples, prev_hashes = self._prev.get(conv.conversation_id, ((), ()))
        n = min(len(prev_tuples), len(tuples))
        k = 0
        while k < n and prev_tuples[k] is tuples[k]:
            k += 1
        hashes = list(prev_hashes[:k])
        parent = hashes[-1] if hashes else ROOT_PARENT
        for t in tuples[k:]:
            parent = hash_block(parent, t)
            hashes.append(parent)
        self._prev[conv.conversation_id] = (tuples, hashes)
        return tuples, hashes, prompt_len

    def forget(self, conv) -> None:
        self._prev.pop(conv.conversation_id, None)
