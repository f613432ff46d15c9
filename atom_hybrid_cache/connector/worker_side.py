"""The store connector in vLLM's worker: copies between pages and the store.

Each step, in the order vLLM's model runner calls its hooks:
- `spill` (`handle_preemptions`, the step's first hook, before the step
  zeroes new pages, copies states or computes): the evicted pages the plan
  names are copied into store objects while they still hold what they held;
- `load` (`start_load_kv`, after the step's forward: the requests it loads
  are not in the step): each request's objects are read, checked and
  written into its pages. Either leg failing fails the request, which
  recomputes from its GPU hit (its pages are not cached until the load is
  reported done, and are freed);
- `finished` and `report`: which loads are done or failed, and what was
  stored or dropped, for the scheduler.
"""

from __future__ import annotations

import logging
from typing import Optional

from .page_io import PageLayout
from .plan import StepPlan, WorkerReport
from .store import LoadFailed, PageStore

logger = logging.getLogger("atom_hybrid_cache")


class ConnectorWorker:
    def __init__(self, store: PageStore, group_layers: list) -> None:
        self.store = store
        self.group_layers = group_layers
        self.pages: Optional[PageLayout] = None
        self._report = WorkerReport()
        self._done: set = set()
        self._failed: set = set()

    def register(self, kv_caches: dict) -> None:
        self.pages = PageLayout(kv_caches, self.group_layers)

    def spill(self, plan: StepPlan) -> None:
        for obj in plan.spills:
            size = self.pages.size(obj.pages)
            def fill(payload, pages=obj.pages):
                self.pages.read(pages, payload)
            reason = self.store.put(obj.key, size, fill)
            if reason is None:
                self._report.stored.append((obj.key, size))
            else:
                self._report.dropped.append((obj.key, reason))

    def load(self, plan: StepPlan) -> None:
        for job in plan.loads:
            loaded, failure, bad = 0, None, []
            for obj in job.objects:
                try:
                    with self.store.get(obj.key) as payload:
                        if payload.numel() != self.pages.size(obj.pages):
                            raise LoadFailed("size", f"{payload.numel()} bytes, pages take "
                                                     f"{self.pages.size(obj.pages)}")
                        loaded += self.pages.write(obj.pages, payload)
                except LoadFailed as e:
                    failure = f"{obj.key.kind} {e.reason}"   # which leg, and why
                    bad.append(obj.key)
                    logger.warning("atom_hybrid_cache connector: load of %s failed (%s); it "
                                   "recomputes", job.request_id, e)
                    break
            self._report.loads.append((job.request_id, failure, loaded, bad))
            (self._done if failure is None else self._failed).add(job.request_id)

    def finished(self) -> tuple[set, set]:
        """(loads finished, loads failed) since the last call; a failed one
        is in both (vLLM's rule)."""
        failed = self._failed
        done = self._done | failed
        self._done, self._failed = set(), set()
        return done, failed

    def report(self) -> Optional[WorkerReport]:
        out, self._report = self._report, WorkerReport()
        return out or None

    def close(self) -> None:
        self.store.close()
