"""What moves between the store and the pages: an object and the pages it
fills or is filled from (plain data; the step's plan carries them)."""

from __future__ import annotations

from dataclasses import dataclass

from .keys import ObjectKey


@dataclass
class StoreObject:
    """One object and its pages: (KV cache group id, block id), in payload
    order (a state object: every state group's page, then every attention
    group's page covering the state's last token; a KV object: one page)."""

    key: ObjectKey
    pages: list


@dataclass
class LoadJob:
    """The objects a request resumes from, written into its pages."""

    request_id: str
    objects: list
