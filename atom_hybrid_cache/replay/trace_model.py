"""What a trace holds once loaded: conversations of requests, and the
checks every loader applies to its fields (each error names the file, the
request and the field). Formats and loaders: ``traces.py``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

MOONCAKE_SPACE = "mooncake"
MOONCAKE_BLOCK_SIZE = 512
CC_GLOBAL_SPACE = "cc-global"

DATA_DIR = Path(__file__).resolve().parent / "data"

PathLike = Union[str, "os.PathLike[str]"]


# ---------------------------------------------------------------------------
# Data model
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRequest:
    """One model call of a conversation."""

    conversation_id: str
    index: int  # position within its conversation
    prompt_len: int
    output_len: int
    trace_block_ids: tuple[int, ...]  # the trace's hash ids
    arrival_s: float
    streaming: bool = False  # cc "type": "s" (streaming) vs "n"
    # the client's time between the previous request's completion and this
    # one (cc "think_time"; 0 where the trace has none)
    think_s: float = 0.0


@dataclass
class Conversation:
    """Requests that form one conversation (a cc trace, a sub-agent, a Mooncake session).

    ``space_id`` is the hash-id space used to expand ids into tokens (the trace
    id for cc traces and their sub-agents, ``"mooncake"`` for Mooncake);
    it defaults to ``conversation_id``.  ``trace_block_size`` is the number of
    tokens one trace id stands for.  ``parent_id`` / ``parent_index`` are set
    for sub-agents (see the module docstring).
    """

    conversation_id: str
    requests: list[TraceRequest]
    source: str
    space_id: str = ""
    trace_block_size: int = 64
    parent_id: Optional[str] = None
    parent_index: Optional[int] = None

    def __post_init__(self) -> None:
        if not self.space_id:
            self.space_id = self.conversation_id
        if not isinstance(self.trace_block_size, int) or self.trace_block_size <= 0:
            raise ValueError(
                f"{self.source}: trace block size must be a positive integer, "
                f"got {self.trace_block_size!r}"
            )


def request_continues(prev: TraceRequest, nxt: TraceRequest) -> bool:
    """True when ``nxt`` continues ``prev`` (the partial-block rule's test).

    The first ``len(prev ids) - 1`` ids agree and ``nxt`` has an id at index
    ``len(prev ids)``.
    """
    a = prev.trace_block_ids
    b = nxt.trace_block_ids
    n = len(a)
    if len(b) <= n:
        return False
    k = n - 1 if n > 0 else 0
    return b[:k] == a[:k]


# ---------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def required_field(obj: dict, key: str, where: str) -> Any:
    if key not in obj:
        raise ValueError(f"{where}: missing field {key!r}")
    return obj[key]


def check_counts(prompt_len: int, n_ids: int, bs: int, where: str, fmt: str,
                  partial_last: bool = False) -> None:
    """cc traces: exactly floor(in/bs) ids.  Mooncake (``partial_last``): exactly
    ceil(in/bs) ids, the last one naming the partial block."""
    expected = -(-prompt_len // bs) if partial_last else prompt_len // bs
    if n_ids == expected:
        return
    if n_ids > expected:
        need = (n_ids - 1) * bs + 1 if partial_last else n_ids * bs
        raise ValueError(
            f"{where}: {fmt} ({prompt_len}) is smaller than {n_ids} hash ids of {bs} "
            f"tokens need ({need}); expected {expected} ids"
        )
    raise ValueError(
        f"{where}: {n_ids} hash ids are too few for {fmt} ({prompt_len}) at {bs} tokens "
        f"per id; expected {expected}"
    )


INT_ONLY = {int}


def int_list(value: Any, where: str, key: str, pool: Optional[dict] = None) -> tuple[int, ...]:
    """The list as a tuple of ints.  ``pool`` interns equal ids to one int object
    (JSON parsing makes a new object per occurrence; a trace repeats each id
    in every later request, so this saves most of the ids' memory)."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: {key!r} must be a list of integers")
    if not set(map(type, value)) <= INT_ONLY:
        bad = next(x for x in value if type(x) is not int)
        raise ValueError(f"{where}: {key!r} holds a non-integer id {bad!r}")
    if pool is None:
        return tuple(value)
    return tuple(map(pool.setdefault, value, value))


def number(value: Any, where: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: {key!r} must be a finite number, got {value!r}")
    return float(value)


def count(value: Any, where: str, key: str) -> int:
    if not is_int(value) or value < 0:
        raise ValueError(f"{where}: {key!r} must be a non-negative integer, got {value!r}")
    return value


# ---------------------------------------------------------------------------
# cc-traces
# ---------------------------------------------------------------------------
