"""What the store holds, as the scheduler sees it.

The worker holds the store (its CPU and disk tiers live in the worker's
process); the scheduler decides loads. So the scheduler keeps an index of
the objects its worker stored, least recently used first, trimmed to the
store's capacity the way its tiers evict, and asks a remote tier (shared
with other instances) for what it does not know. The index can be wrong
both ways: an object the store evicted first fails its load (the request
recomputes, and the key leaves the index); one it kept longer is a missed
hit.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from .keys import ObjectKey


class StoreIndex:
    def __init__(self, capacity_bytes: int, remote=None) -> None:
        """`remote`: a `PageStore` on the remote tier (role scheduler), or None."""
        self.capacity = capacity_bytes
        self.remote = remote
        self._sizes: OrderedDict[ObjectKey, int] = OrderedDict()
        self.held_bytes = 0

    def add(self, key: ObjectKey, nbytes: int) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)
            return
        self._sizes[key] = nbytes
        self.held_bytes += nbytes
        while self.held_bytes > self.capacity and self._sizes:
            _, size = self._sizes.popitem(last=False)
            self.held_bytes -= size

    def discard(self, key: ObjectKey) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.held_bytes -= size

    def __contains__(self, key: ObjectKey) -> bool:
        return key in self._sizes

    def held(self, key: ObjectKey, ask_remote: bool = True) -> bool:
        """Known to be stored here, or (asked) held by the remote tier."""
        if key in self._sizes:
            self._sizes.move_to_end(key)
            return True
        return ask_remote and self.remote is not None and self.remote.contains(key)

    def __len__(self) -> int:
        return len(self._sizes)

    def touch(self, key: ObjectKey) -> Optional[int]:
        """A load read it: it is the most recently used now."""
        if key in self._sizes:
            self._sizes.move_to_end(key)
            return self._sizes[key]
        return None
