"""Chained block hashes for the prefix index.

A block's identity is the hash of (parent block's hash, this block's tokens),
so equal hashes mean equal prefixes up to a 64-bit collision. The pools keep
each indexed block's (parent, tokens) and compare them on lookup, so a
collision can cost a miss but never a wrong hit.
"""

from __future__ import annotations

from array import array
from typing import Sequence

import xxhash

# Parent of the first block. Any fixed value works; 0 keeps logs readable.
ROOT_PARENT = 0

_SEED = 0x61746F6D  # "atom": keeps our hashes apart from other xxh3 users.


def hash_block(parent: int, tokens: Sequence[int]) -> int:
    """Chained hash of one full block of token ids."""
    data = parent.to_bytes(8, "little") + array("q", tokens).tobytes()
    return xxhash.xxh3_64_intdigest(data, seed=_SEED)


def hash_blocks(blocks: Sequence[Sequence[int]], parent: int = ROOT_PARENT) -> list[int]:
    """Hashes of consecutive full blocks, each chained on the one before."""
    out = []
    for tokens in blocks:
        parent = hash_block(parent, tokens)
        out.append(parent)
    return out


def split_full_blocks(token_ids: Sequence[int], block_size: int) -> list[tuple[int, ...]]:
    """The prompt's full blocks as tuples; a trailing partial block is left out."""
    n = len(token_ids) // block_size
    return [tuple(token_ids[i * block_size:(i + 1) * block_size]) for i in range(n)]
