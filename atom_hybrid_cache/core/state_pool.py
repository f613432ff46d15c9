"""State slots: working states of live requests and checkpoints.

A slot holds one full recurrent state (every linear-attention layer plus its
conv window). A live request owns `1 + num_spec` working slots; a checkpoint
owns exactly one slot and is indexed by the chained hash of the last KV block
it covers.

Eviction is reuse-aware LRU in two tiers. `_plain` holds ordinary
checkpoints: guesses (demand, ladder and decode rungs) are filed at its head,
so they go first unless a resume reads them; prompt-end anchors are filed at
its tail. `_protected` holds each live conversation's newest anchor and
newest cut checkpoint; it is touched only when `_plain` is empty, and its
size is capped so conversations that ended cannot pin slots forever. A read
promotes the checkpoint to the tail of its tier.

Invariants (checked by tests/test_core_properties.py):
- every slot is exactly one of: working (owned), checkpoint (indexed), vacant;
- `index[h] == s` iff `slot_key[s] == h`;
- a checkpoint slot sits in exactly one tier.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional


@dataclass
class CheckpointInfo:
    position: int  # tokens covered
    kind: str      # anchor | demand | ladder | cut | fallback | decode
    writer: object  # request id that wrote it (diagnostics only)


@dataclass
class CheckpointFates:
    kept: int = 0      # written into a slot
    dropped: int = 0   # wanted, but no slot could take it
    evicted: int = 0   # pushed out by slot pressure
    orphaned: int = 0  # the KV block under it left the index
    read: int = 0      # resumes that started from it
    duplicate: int = 0  # asked for again while already held (no write)

    def as_dict(self) -> dict:
        return dict(kept=self.kept, dropped=self.dropped, evicted=self.evicted,
                    orphaned=self.orphaned, read=self.read)


class StateSlotPool:
    def __init__(self, num_slots: int, protected_cap: int) -> None:
        if num_slots < 1:
            raise ValueError(f"state slots must be >= 1, got {num_slots}")
        if protected_cap < 0:
            raise ValueError(f"protected checkpoint cap must be >= 0, got {protected_cap}")
        self.num_slots = num_slots
        self.protected_cap = protected_cap
        self.slot_owner: list[object] = [None] * num_slots
        self.slot_key: list[Optional[int]] = [None] * num_slots
        self.slot_info: list[Optional[CheckpointInfo]] = [None] * num_slots
        self.index: dict[int, int] = {}
        self._vacant = list(range(num_slots))
        self._plain: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()
        self.fates = CheckpointFates()

    # -- queries -------------------------------------------------------
    @property
    def num_vacant(self) -> int:
        return len(self._vacant)

    @property
    def num_checkpoints(self) -> int:
        return len(self.index)

    @property
    def num_working(self) -> int:
        return self.num_slots - len(self._vacant) - len(self.index)

    def has(self, block_hash: int) -> bool:
        return block_hash in self.index

    def info(self, block_hash: int) -> Optional[CheckpointInfo]:
        s = self.index.get(block_hash)
        return None if s is None else self.slot_info[s]

    def is_protected(self, block_hash: int) -> bool:
        s = self.index.get(block_hash)
        return s is not None and s in self._protected

    # -- working slots -------------------------------------------------
    def take_working(self, owner: object, n: int) -> Optional[list[int]]:
        """n working slots for a live request, or None when only other
        requests' working slots are left. Checkpoints give way, plain first."""
        if n > len(self._vacant) + len(self.index):
            return None
        out = []
        for _ in range(n):
            s = self._take_slot(may_evict_protected=True)
            self.slot_owner[s] = owner
            out.append(s)
        return out

    def release_working(self, slots: list[int]) -> None:
        for s in slots:
            if self.slot_owner[s] is None:
                raise AssertionError(f"state slot {s} released twice")
            self.slot_owner[s] = None
            heapq.heappush(self._vacant, s)

    # -- checkpoints ---------------------------------------------------
    def store(self, block_hash: int, info: CheckpointInfo, *, at_head: bool,
              protect: bool = False) -> Optional[int]:
        """Keep a checkpoint; returns its slot, or None when dropped.

        A guess (`at_head`) never evicts a protected checkpoint: losing a
        live conversation's anchor to a speculative rung is the trade we
        refuse."""
        s = self.index.get(block_hash)
        if s is not None:
            self.fates.duplicate += 1
            if protect:
                self.protect(block_hash)
            return s
        may_evict_protected = protect or not at_head
        if not self._vacant and not self._plain and not (
                may_evict_protected and self._protected):
            self.fates.dropped += 1
            return None
        s = self._take_slot(may_evict_protected)
        self.slot_key[s] = block_hash
        self.slot_info[s] = info
        self.index[block_hash] = s
        if protect:
            self._file_protected(s)
        else:
            self._plain[s] = None
            if at_head:
                self._plain.move_to_end(s, last=False)
        self.fates.kept += 1
        return s

    def read(self, block_hash: int) -> Optional[int]:
        """Slot to resume from; promotes the checkpoint within its tier."""
        s = self.index.get(block_hash)
        if s is None:
            return None
        if s in self._protected:
            self._protected.move_to_end(s)
        else:
            self._plain.move_to_end(s)
        self.fates.read += 1
        return s

    def protect(self, block_hash: int) -> None:
        s = self.index.get(block_hash)
        if s is None or s in self._protected:
            return
        del self._plain[s]
        self._file_protected(s)

    def unprotect(self, block_hash: int) -> None:
        """Demote to plain, at the tail: it was recent when it lost its rank."""
        s = self.index.get(block_hash)
        if s is None or s not in self._protected:
            return
        del self._protected[s]
        self._plain[s] = None

    def invalidate(self, block_hash: int) -> bool:
        """The KV content under a checkpoint left the index: free its slot."""
        s = self.index.get(block_hash)
        if s is None:
            return False
        self._vacate(s)
        self.fates.orphaned += 1
        return True

    # -- internals -----------------------------------------------------
    def _file_protected(self, s: int) -> None:
        self._protected[s] = None
        while len(self._protected) > self.protected_cap:
            old, _ = self._protected.popitem(last=False)
            self._plain[old] = None

    def _take_slot(self, may_evict_protected: bool) -> int:
        if self._vacant:
            return heapq.heappop(self._vacant)
        if self._plain:
            s, _ = self._plain.popitem(last=False)
        elif may_evict_protected and self._protected:
            s, _ = self._protected.popitem(last=False)
        else:
            raise AssertionError("no state slot can be taken")
        self._forget(s)
        self.fates.evicted += 1
        return s

    def _vacate(self, s: int) -> None:
        if s in self._protected:
            del self._protected[s]
        else:
            del self._plain[s]
        self._forget(s)
        heapq.heappush(self._vacant, s)

    def _forget(self, s: int) -> None:
        del self.index[self.slot_key[s]]
        self.slot_key[s] = None
        self.slot_info[s] = None
