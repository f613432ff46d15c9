"""The store connector in vLLM's scheduler: lookups, load plans, spills.

A waiting request is looked up once its GPU hit is known
(`get_num_new_matched_tokens`): the joint boundary over what the store
holds (`joint_boundary`). A load is planned once vLLM has allocated its
pages (`update_state_after_alloc`): the state object into each state
group's page at column (J - 1) // block_size and the attention pages of the
state's last token, the full KV pages below. The step's plan
(`build_connector_meta`) carries those loads and the spills the release's
units gave (`SpillRegistry`); the worker's report (`update_connector_output`)
says what was stored, dropped, loaded or failed.
"""

from __future__ import annotations

import logging
from typing import Optional

from .counters import ConnectorCounters
from .joint_boundary import MAX_STATE_PROBES, JointBoundary, joint_boundary
from .keys import StoreLayout, kv_key, state_key, unit_hashes
from .objects import LoadJob, StoreObject
from .plan import StepPlan, WorkerReport
from .spill_registry import SpillRegistry
from .store_index import StoreIndex

logger = logging.getLogger("atom_hybrid_cache")


class ConnectorScheduler:
    def __init__(self, layout: StoreLayout, state_groups: list, kv_groups: list,
                 capacity_bytes: int, remote=None) -> None:
        self.layout = layout
        self.state_groups = list(state_groups)
        self.kv_groups = list(kv_groups)
        self.counters = ConnectorCounters()
        self.index = StoreIndex(capacity_bytes, remote)
        self.unit = 0              # the hash unit, once the block pool is bound
        self.registry: Optional[SpillRegistry] = None
        self._hashes: dict = {}    # request id -> its prompt's unit hashes
        self._planned: dict = {}   # request id -> JointBoundary (looked up, not loaded yet)
        self._loads: list = []     # this step's LoadJobs
        self._loading: dict = {}   # request id -> the keys of its load in flight
        self._declined: set = set()   # requests a lookup counted a decline for
        self._failed: set = set()  # requests whose load failed: they recompute
        self._remote_seen: dict = {}   # request id -> (GPU hit, the remote tier's answer)

    def bind(self, unit: int) -> None:
        self.unit = unit
        self.registry = SpillRegistry(self.layout, unit, self.state_groups, self.kv_groups,
                                      self.index, self.counters)

    def hashes(self, request) -> list:
        """The unit hashes of the request's tokens so far (kept while it
        lives, extended as it grows)."""
        known = self._hashes.get(request.request_id, ())
        tokens = request.all_token_ids
        if len(known) < len(tokens) // self.unit:
            known = unit_hashes(tokens, self.unit, known)
            self._hashes[request.request_id] = known
        return known

    def final_hashes(self, request) -> list:
        """The unit hashes of a request being freed; its entry goes (vLLM
        tells the connector a request finished before it frees the pages,
        whose units need them)."""
        known = self._hashes.pop(request.request_id, ())
        return unit_hashes(request.all_token_ids, self.unit, known)

    # -- lookup ------------------------------------------------------------
    def lookup(self, request, local: int) -> tuple[int, bool]:
        rid = request.request_id
        if rid in self._failed or self.unit == 0:
            return 0, False
        hashes = self.hashes(request)
        B = self.layout.block_size

        def search(ask_remote: bool) -> JointBoundary:
            def kv_pages_held(first: int, last: int) -> int:
                last = min(last, len(hashes) * self.unit // B - 1)   # full pages only
                n = 0
                while first + n <= last and all(
                        self.index.held(kv_key(hashes, self.unit, B, g, first + n), ask_remote)
                        for g in self.kv_groups):
                    n += 1
                return n

            return joint_boundary(
                local=local, num_tokens=request.num_tokens, unit=self.unit, block_size=B,
                kv_pages_held=kv_pages_held,
                state_held=lambda p: self.index.held(state_key(hashes, self.unit, p), ask_remote),
                # the index is a dict: every unit; a remote tier answers in
                # round trips: a few probes
                every_unit=not ask_remote,
                max_probes=request.num_tokens // self.unit if not ask_remote else MAX_STATE_PROBES)

        jb = search(ask_remote=False)
        if self.index.remote is not None:
            # round trips: once per request and GPU hit, not at every step
            # it waits (vLLM asks again until it is admitted)
            seen = self._remote_seen.get(rid)
            if seen is None or seen[0] != local:
                seen = self._remote_seen[rid] = (local, search(ask_remote=True))
            shared = seen[1]
            if shared.position is not None and (jb.position or 0) < shared.position:
                jb = shared
        if jb.position is None:
            if rid not in self._declined:
                self._declined.add(rid)
                self.counters.bump(self.counters.declines, jb.reason)
            return 0, False
        self._planned[rid] = jb
        return jb.position - local, True

    def plan_load(self, request, blocks, num_external: int) -> None:
        """vLLM allocated the request's pages: `blocks` per KV cache group
        (page i of the prompt at index i)."""
        jb: Optional[JointBoundary] = self._planned.pop(request.request_id, None)
        if num_external <= 0 or jb is None:
            return
        hashes = self._hashes[request.request_id]
        B = self.layout.block_size
        column = (jb.position - 1) // B
        objects = [StoreObject(state_key(hashes, self.unit, jb.position),
                               [(g, blocks[g][column]) for g in self.state_groups]
                               + [(g, blocks[g][column]) for g in self.kv_groups])]
        for page in jb.kv_pages:
            objects += [StoreObject(kv_key(hashes, self.unit, B, g, page), [(g, blocks[g][page])])
                        for g in self.kv_groups]
        self._loads.append(LoadJob(request.request_id, objects))
        self._loading[request.request_id] = [o.key for o in objects]
        self.counters.joint_boundaries += 1
        self.counters.loads_attempted += 1
        self.counters.loaded_tokens += num_external
        for o in objects:
            self.index.touch(o.key)

    def build_plan(self) -> StepPlan:
        plan = StepPlan(self.registry.take() if self.registry else [], self._loads)
        self._loads = []
        return plan

    def open_step(self) -> None:
        if self.registry is not None:
            self.registry.open_step()

    # -- the worker's report ---------------------------------------------
    def update(self, report: Optional[WorkerReport]) -> None:
        if not report:
            return
        c = self.counters
        for key, nbytes in report.stored:
            c.spills_stored += 1
            c.bytes_spilled += nbytes
        for key, reason in report.dropped:
            self.index.discard(key)
            c.bump(c.spills_dropped, reason)
        for rid, failure, nbytes, bad_keys in report.loads:
            self._loading.pop(rid, None)
            if failure is None:
                c.loads_completed += 1
                c.bytes_loaded += nbytes
            else:
                c.bump(c.loads_failed, failure)
                self._failed.add(rid)
                for key in bad_keys:
                    self.index.discard(key)

    def finished(self, request_id: str) -> None:
        for table in (self._hashes, self._planned, self._loading, self._remote_seen):
            table.pop(request_id, None)
        self._declined.discard(request_id)
        self._failed.discard(request_id)
