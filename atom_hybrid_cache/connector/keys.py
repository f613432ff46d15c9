"""What an object in the store is called: the content of the prefix it follows.

vLLM's own block hashes start from a random seed per process, so two
instances name the same prefix differently. The store's keys are chained
hashes of the prompt's token ids instead, one per hash unit
(`core.hashing`), so any instance with the same model and page layout finds
what another one spilled. The layout's fingerprint goes into every key: a
page of another model, dtype or block size is never read as ours.

Two kinds of object:
- `state@p`: the state of every state group after p tokens, with the
  attention groups' page that covers token p - 1 (so a load of the state
  brings the KV up to p with it, and never more);
- `kv@g,i`: page i of attention group g, full (tokens [i*B, (i+1)*B)),
  named by the chained hash at its end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import xxhash

from ..core.hashing import ROOT_PARENT, hash_block


def unit_hashes(token_ids: Sequence[int], unit: int, known: Sequence[int] = ()) -> list[int]:
    """The chained hash after each full `unit` of `token_ids`; `known`: the
    hashes of a prefix already computed (extended, not recomputed)."""
    out = list(known)
    parent = out[-1] if out else ROOT_PARENT
    for i in range(len(out), len(token_ids) // unit):
        parent = hash_block(parent, token_ids[i * unit:(i + 1) * unit])
        out.append(parent)
    return out


@dataclass(frozen=True)
class StoreLayout:
    """The page layout of one engine: a store object is ours only under the
    same model, block size and page bytes (the hash unit only decides where
    states may sit, not what an object holds)."""

    model: str
    block_size: int
    state_page_bytes: tuple      # per state group, in group order
    kv_page_bytes: tuple         # per attention group

    @property
    def fingerprint(self) -> str:
        digest = xxhash.xxh3_64_hexdigest(repr((self.model, self.block_size,
                                                self.state_page_bytes,
                                                self.kv_page_bytes)).encode())
        return f"atomhc-{digest}"

    @property
    def state_object_bytes(self) -> int:
        """A state object's payload: every state group's page and every
        attention group's page covering p - 1."""
        return sum(self.state_page_bytes) + sum(self.kv_page_bytes)


@dataclass(frozen=True)
class ObjectKey:
    """`kind` "state" (position p) or "kv" (`group`, page index); `prefix` is
    the chained hash of the tokens the object follows (p, or the page's end)."""

    kind: str
    prefix: int
    position: int
    group: int = -1


def state_key(hashes: Sequence[int], unit: int, position: int) -> ObjectKey:
    return ObjectKey("state", hashes[position // unit - 1], position)


def kv_key(hashes: Sequence[int], unit: int, block_size: int, group: int, page: int) -> ObjectKey:
    end = (page + 1) * block_size
    return ObjectKey("kv", hashes[end // unit - 1], end, group)
