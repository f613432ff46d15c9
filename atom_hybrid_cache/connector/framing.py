"""Each stored object carries its own identity and digest.

LMCache returns whatever bytes a tier holds: a flipped bit on disk or a
remote server's stale object comes back as valid-looking pages, and a state
page read as another prefix's state is silently wrong output. So every
object starts with a header naming what it is (kind, position, the prefix
hash, the group) and the xxh3 digest of its payload; a load whose header or
digest does not match is a failed load, and the request recomputes.
"""

from __future__ import annotations

import struct

import xxhash

from .keys import ObjectKey

MAGIC = b"ATOMHC01"
_HEADER = struct.Struct("<8s8sqQiqQ")   # magic, kind, position, prefix, group, length, digest
HEADER_BYTES = 64
assert _HEADER.size <= HEADER_BYTES


class CorruptObject(ValueError):
    """A stored object's header or digest does not match the key it was
    read under."""


def header(key: ObjectKey, payload) -> bytes:
    """The header of `payload` (a buffer: numpy array, bytes) stored
    under `key`, padded to HEADER_BYTES."""
    digest = xxhash.xxh3_64_intdigest(payload)
    raw = _HEADER.pack(MAGIC, key.kind.encode().ljust(8, b"\0"), key.position,
                       key.prefix & 0xFFFFFFFFFFFFFFFF, key.group, len(payload), digest)
    return raw.ljust(HEADER_BYTES, b"\0")


def check(key: ObjectKey, head: bytes, payload) -> None:
    """Raise CorruptObject unless `head` is `key`'s header for `payload`."""
    magic, kind, position, prefix, group, length, digest = _HEADER.unpack(head[:_HEADER.size])
    if magic != MAGIC:
        raise CorruptObject("not an object of this connector (bad magic)")
    expected = (key.kind.encode().ljust(8, b"\0"), key.position,
                key.prefix & 0xFFFFFFFFFFFFFFFF, key.group)
    if (kind, position, prefix, group) != expected:
        raise CorruptObject("the object names another prefix than its key")
    if length != len(payload):
        raise CorruptObject(f"payload of {len(payload)} bytes, header says {length}")
    if xxhash.xxh3_64_intdigest(payload) != digest:
        raise CorruptObject("payload digest mismatch")
