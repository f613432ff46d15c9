"""The store: LMCache's storage manager holding the connector's objects.

Configured by LMCache's own settings (`LMCACHE_*` variables or
`LMCACHE_CONFIG_FILE`): a CPU tier (the staging buffer every object passes
through), optionally local disk and a remote backend (`lmcache_server`,
Redis, ...), which instances share. Objects are flat uint8 buffers: a
header (`framing`) and the pages' bytes. The worker puts and gets; the
scheduler, where a remote backend is configured, asks the remote tier
whether it holds an object another instance stored.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
import xxhash

from ..vllm import private_api
from .framing import HEADER_BYTES, CorruptObject, check, header
from .keys import ObjectKey, StoreLayout
from ..vllm.llvmlite_guard import make_llvmlite_scan_safe

logger = logging.getLogger("atom_hybrid_cache")

GIB = 1 << 30
# How long a put waits for room in the staging buffer (objects in flight to
# disk or a remote tier hold theirs) before the spill is dropped.
ROOM_WAIT_S = 0.2
# How long `close` waits for puts in flight to disk or a remote tier.
DRAIN_WAIT_S = 10.0


class StoreConfigError(ValueError):
    """The store cannot hold what the connector stores; the message names
    the setting."""


class LoadFailed(RuntimeError):
    """A load found no object, a corrupt one, or an error; `reason` is the
    counter it goes to."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def lmcache_config(overrides: Optional[dict] = None):
    """LMCache's engine config from its file and variables (and
    `overrides`, for tests)."""
    from lmcache.v1.config import load_engine_config_with_overrides
    return load_engine_config_with_overrides(overrides=overrides)


def staging_bytes(config) -> int:
    """The CPU tier's size in bytes (0 where it is off)."""
    return int(config.max_local_cpu_size * GIB) if config.local_cpu else 0


def check_config(config, layout: StoreLayout) -> None:
    """Refuse a configuration in which no state object could pass: every
    object is staged in the CPU tier first."""
    need = HEADER_BYTES + layout.state_object_bytes
    have = staging_bytes(config)
    if have < need:
        raise StoreConfigError(
            f"LMCache's CPU tier (LMCACHE_LOCAL_CPU / LMCACHE_MAX_LOCAL_CPU_SIZE) holds {have:,} "
            f"bytes, less than one state object of this model ({need:,} bytes: every state "
            f"group's page and the attention pages covering its last token); give it at least "
            f"{need / GIB:.3f} GB")


# The scheduler's lookups in the remote tier: LMCache's own "scheduler" role
# cannot open a remote connection in 0.5.6 (its Redis and lmcache_server
# connectors read the CPU tier's config, which that role leaves out: every
# lookup answered "not held"), so the scheduler opens the remote tier as a
# worker does, with a CPU tier of 10 MB and no disk tier (the worker's
# process owns those).
LOOKUP_OVERRIDES = {"local_cpu": True, "max_local_cpu_size": 0.01, "local_disk": None,
                    "max_local_disk_size": 0}


def lookup_config():
    """LMCache's config for the scheduler's remote lookups."""
    return lmcache_config(LOOKUP_OVERRIDES)


class PageStore:
    def __init__(self, layout: StoreLayout, config, role: str = "worker") -> None:
        """`role` "lookup": the scheduler's view of the remote tier (what
        another instance stored); `config` from `lookup_config()`."""
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.storage_manager import StorageManager

        make_llvmlite_scan_safe()   # LMCache loaded numba: see llvmlite_guard
        if role == "worker":
            check_config(config, layout)
        self.layout = layout
        self.role = role
        metadata = LMCacheMetadata(
            model_name=layout.fingerprint, world_size=1, local_world_size=1, worker_id=0,
            local_worker_id=0, kv_dtype=torch.uint8, kv_shape=(1, 1, config.chunk_size, 1, 1),
            role="worker", chunk_size=config.chunk_size)
        self._manager = StorageManager(config, metadata, EventManager())
        self.remote = bool(config.remote_url)

    # -- keys ------------------------------------------------------------
    def _engine_key(self, key: ObjectKey):
        from lmcache.utils import CacheEngineKey
        chunk = xxhash.xxh3_64_intdigest(
            repr((key.kind, key.prefix, key.position, key.group)).encode())
        return CacheEngineKey(self.layout.fingerprint, 1, 0, chunk, torch.uint8,
                              request_configs={"lmcache.tag.kind": key.kind})

    # -- worker ----------------------------------------------------------
    def put(self, key: ObjectKey, size: int, fill: Callable[[torch.Tensor], None]) -> Optional[str]:
        """Store an object of `size` payload bytes that `fill(payload)`
        writes. Returns None when stored, else why it was dropped."""
        from lmcache.v1.memory_management import MemoryFormat

        obj = None
        deadline = time.monotonic() + ROOM_WAIT_S
        while obj is None:
            obj = self._manager.allocate(torch.Size([HEADER_BYTES + size]), torch.uint8,
                                         fmt=MemoryFormat.KV_2TD, busy_loop=False)
            if obj is None:
                if time.monotonic() > deadline:
                    return "no room"
                time.sleep(0.005)
        buf = obj.tensor
        payload = buf[HEADER_BYTES:]
        fill(payload)
        head = header(key, payload.numpy())
        buf[:HEADER_BYTES].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        try:
            self._manager.batched_put([self._engine_key(key)], [obj])
        except Exception as e:   # a tier refused it: the object is not stored
            logger.warning("atom_hybrid_cache connector: put failed: %s", e)
            return "put failed"
        return None

    @contextmanager
    def get(self, key: ObjectKey) -> Iterator[torch.Tensor]:
        """The payload of the object stored under `key`, checked against its
        header, for the time of the `with` block. Raises LoadFailed."""
        engine_key = self._engine_key(key)
        try:
            obj = self._manager.get(engine_key)
        except Exception as e:
            raise LoadFailed("error", str(e)) from None
        if obj is None:
            raise LoadFailed("missing")
        try:
            buf = obj.tensor
            payload = buf[HEADER_BYTES:]
            try:
                check(key, bytes(buf[:HEADER_BYTES].numpy()), payload.numpy())
            except CorruptObject as e:
                self.remove(key)
                raise LoadFailed("corrupt", str(e)) from None
            yield payload
        finally:
            obj.ref_count_down()

    def remove(self, key: ObjectKey) -> None:
        try:
            self._manager.remove(self._engine_key(key))
        except Exception:   # a tier without removal: the object stays, unread
            pass

    # -- both ------------------------------------------------------------
    def contains(self, key: ObjectKey) -> bool:
        try:
            return self._manager.contains(self._engine_key(key)) is not None
        except Exception:
            return False

    def close(self) -> None:
        """Wait for puts in flight (closing under them fails them, or sends
        freed memory), then close every tier."""
        deadline = time.monotonic() + DRAIN_WAIT_S
        while self._in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        for executor in self._remote_executors():
            if not private_api.instance_has(executor, private_api.STORE_REMOTE_DRAIN):
                continue
            # the remote tier's queued puts read the CPU tier's buffers,
            # which the CPU tier's close frees (it closes first)
            done = asyncio.run_coroutine_threadsafe(executor._queue.join(),
                                                    self._manager.loop)
            try:
                done.result(max(0.0, deadline - time.monotonic()))
            except Exception:
                done.cancel()
                logger.warning("atom_hybrid_cache connector: the remote tier's last puts did "
                               "not finish in %s s", DRAIN_WAIT_S)
            # LMCache 0.5.6's Redis/Valkey/S3/mock connectors never finish
            # closing: they call this executor's blocking `shutdown` on the
            # event loop's own thread (it waits for a coroutine that loop
            # must run), and its coroutine with wait=True cancels the
            # workers before they take their stop items, then waits for
            # those items. Its queue is empty now: stop without waiting.
            executor.shutdown = functools.partial(executor.shutdown_async, wait=False)
        self._manager.close()

    def _remote_executors(self) -> list:
        """The job executors of the remote tiers' connectors (those that
        have one)."""
        out = []
        for backend in self._manager.storage_backends.values():
            connection = getattr(backend, "connection", None)
            # (LMCache wraps a remote connector to time it)
            connection = getattr(connection, "_connector", connection)
            executor = getattr(connection, "pq_executor", None)
            if executor is not None and hasattr(executor, "shutdown_async"):
                out.append(executor)
        return out

    def _in_flight(self) -> bool:
        """Whether a disk or remote tier still has puts to finish (each
        keeps its set of keys in flight, `put_tasks`)."""
        return any(getattr(backend, "put_tasks", None)
                   for backend in self._manager.storage_backends.values())
