"""Spills: which pages go to the store when vLLM evicts them.

vLLM evicts a cached page silently, when `BlockPool.get_new_blocks` hands
it to a new owner. The plugin's release gives a freed request's pages back
with `BlockPool.unpin_blocks(..., on_reuse)`, whose watcher fires in
`get_new_blocks` before the page's hashes are dropped; so the release
registers each unit of the request here (a state, its KV pages down to the
next lower state, and the keys of their content) and the watcher tells
which unit lost a page.

At the first page of a unit to go, the whole unit is spilled while every
page of it still holds its content (the worker copies at the start of the
step, before the step zeroes, copies or computes into any page): the state
object (every state group's page and the attention pages covering the
state's last token) and the unit's full KV pages the store lacks. KV above
every state is never registered: no resume can read it (a resume needs a
state at its boundary), so storing it would cost bandwidth for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..core.eviction import FreedUnits
from .counters import ConnectorCounters
from .keys import ObjectKey, StoreLayout, kv_key, state_key
from .objects import StoreObject
from .store_index import StoreIndex


@dataclass
class _Unit:
    state: Optional[ObjectKey]
    # [(group id, block)] in payload order: state groups, then the
    # attention pages covering the state's last token
    state_pages: list
    # [(key, group id, block)]: the unit's full KV pages
    kv_pages: list
    # block id -> the hash it held when registered (a page reused since
    # holds another)
    expected: dict = field(default_factory=dict)
    spilled: bool = False


class SpillRegistry:
    def __init__(self, layout: StoreLayout, unit: int, state_groups: list, kv_groups: list,
                 index: StoreIndex, counters: ConnectorCounters) -> None:
        """`state_groups`, `kv_groups`: KV cache group ids (the freed units'
        KV group indices map into `kv_groups`)."""
        self.layout = layout
        self.unit = unit
        self.block_size = layout.block_size
        self.state_groups = list(state_groups)
        self.kv_groups = list(kv_groups)
        self.index = index
        self.counters = counters
        self._by_block: dict = {}
        self._pending: list[StoreObject] = []
        # the step's plan has been built: a page reused after that is
        # already being written by the step, too late to copy
        self._closed = False

    # -- release ---------------------------------------------------------
    def register(self, hashes: list, freed: FreedUnits) -> None:
        """The units of a freed request; `hashes`: the chained hashes of its
        tokens per hash unit (`keys.unit_hashes`)."""
        B = self.block_size
        for u in freed.units:
            p = u.position
            top_end = -(-p // B) * B
            if p // self.unit > len(hashes) or set(u.state_groups) != set(self.state_groups):
                continue   # a state without all its groups cannot be resumed on
            by_group = dict(zip(u.state_groups, u.states))
            tops = {self.kv_groups[g]: h for g, end, h in u.kv if end == top_end}
            if len(tops) != len(self.kv_groups):
                continue   # the KV under the state's last token is not cached
            pages = ([(g, by_group[g]) for g in self.state_groups]
                     + [(g, tops[g]) for g in self.kv_groups])
            # every full page (the top one too, where the request filled it:
            # a higher boundary reads it as a plain KV page)
            kv = [(kv_key(hashes, self.unit, B, self.kv_groups[g], end // B - 1),
                   self.kv_groups[g], h) for g, end, h in u.kv if end // self.unit <= len(hashes)]
            record = _Unit(state_key(hashes, self.unit, p), pages, kv)
            for _, block in pages + [(g, h) for _, g, h in kv]:
                record.expected[block.block_id] = block.block_hash
                self._by_block[block.block_id] = record

    # -- eviction ----------------------------------------------------------
    def on_reuse(self, block) -> None:
        """vLLM is handing `block` to a new owner (its watcher, called
        before its hashes are dropped)."""
        record = self._by_block.pop(block.block_id, None)
        if record is None or record.spilled or record.expected.get(block.block_id) != \
                block.block_hash:
            return   # not ours, spilled already, or reused since we registered it
        record.spilled = True
        for block_id in record.expected:
            if self._by_block.get(block_id) is record:
                del self._by_block[block_id]
        if self._closed:
            self.counters.bump(self.counters.spills_dropped, "late")
            return
        live = [b for _, b in record.state_pages if record.expected[b.block_id] == b.block_hash]
        state_readable = record.state in self.index
        if len(live) == len(record.state_pages) and not state_readable:
            self._emit(record.state, [(g, b.block_id) for g, b in record.state_pages],
                       self.layout.state_object_bytes)
            state_readable = True
        elif not state_readable:
            self.counters.bump(self.counters.spills_dropped, "page gone")
        if not state_readable:
            return   # its KV alone can never be resumed on
        for key, g, b in record.kv_pages:
            if key not in self.index and record.expected[b.block_id] == b.block_hash:
                self._emit(key, [(g, b.block_id)], self.layout.kv_page_bytes[
                    self.kv_groups.index(g)])

    def _emit(self, key: ObjectKey, pages: list, nbytes: int) -> None:
        self._pending.append(StoreObject(key, pages))
        # held from now on: a lookup may plan a load of it; the worker
        # stores it before that load runs, or reports it dropped
        self.index.add(key, nbytes)
        self.counters.spills_requested += 1

    # -- the step --------------------------------------------------------
    def open_step(self) -> None:
        self._closed = False

    def take(self) -> list[StoreObject]:
        """The step's spills, for its plan; pages reused after this are not
        spilled (the step writes them)."""
        out, self._pending = self._pending, []
        self._closed = True
        return out

    def reset(self) -> None:
        """vLLM's prefix cache was reset: no registered page holds its
        content any more."""
        self._by_block.clear()
        self._pending.clear()
