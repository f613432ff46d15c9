"""What the scheduler side asks of the worker each step, and what the worker
reports back: plain data, pickled between the two processes."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorMetadata,
                                                               KVConnectorWorkerMetadata)


@dataclass
class StepPlan(KVConnectorMetadata):
    """`spills`: objects (`objects.StoreObject`) to copy out of pages vLLM
    evicted this step, before the step writes them (the worker's first
    hook); `loads` (`objects.LoadJob`): requests to fill from the store
    (after the step's forward)."""

    spills: list = field(default_factory=list)
    loads: list = field(default_factory=list)


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """Per step: objects stored ([(key, bytes)]), dropped ([(key, reason)]),
    and loads ([(request id, failure reason or None, bytes, objects' keys)])."""

    stored: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    loads: list = field(default_factory=list)

    def aggregate(self, other: "WorkerReport") -> "WorkerReport":
        return WorkerReport(self.stored + other.stored, self.dropped + other.dropped,
                            self.loads + other.loads)

    def __bool__(self) -> bool:
        return bool(self.stored or self.dropped or self.loads)
