"""Request traces: the loaders.

Two formats are read (see ``/work/shared/traces/README.md`` for the data):

cc-traces (``*.json``, one conversation per file)
    ``{"id", "block_size", "hash_id_scope", "requests": [...]}``.  Each request
    has ``t`` (seconds since the trace start), ``type``, ``in``, ``out`` and
    ``hash_ids`` (one id per FULL ``block_size``-token block of the prompt,
    ``floor(in / block_size)`` ids).

    ``type`` is ``"n"`` or ``"s"``: a non-streaming or a streaming API call
    (kv-cache-tester's trace format; the streaming ones are the only requests
    that carry a ``ttft``).  Both are ordinary model calls of the same
    conversation, so both are loaded the same way; ``TraceRequest.streaming``
    records which it was.

    ``{"type": "subagent", "requests": [...]}`` items nest a sub-agent's calls
    (possibly nested again).  **Sub-agent ordering rule:** every nested list
    becomes its own :class:`Conversation`, id ``<trace id>/sub<k>`` with ``k``
    counting 1, 2, ... in document order over the whole file (nested ones
    included), listed after the parent, in document order.  Its requests are
    sorted by ``t`` (stable, so ties keep file order); their arrival times are
    their own ``t`` values on the trace's clock.  The parent blocks on the
    sub-agent call, so the sub-agent runs as a separate conversation
    *between* two parent requests: ``Conversation.parent_id`` names the
    enclosing conversation and ``Conversation.parent_index`` is the index of
    the first parent request that follows the ``subagent`` item (= the number
    of parent requests before it), i.e. the request that waits for it.  The
    parent's own requests are also sorted by ``t`` (stable).  A sub-agent
    shares the parent's hash-id space: token expansion is seeded by the trace
    id (``Conversation.space_id``), never by the conversation id.  With
    ``"hash_id_scope": "global"`` all such traces share one space,
    ``"cc-global"``.

Mooncake (``*.jsonl``, one request per line)
    ``{"timestamp" (ms), "input_length", "output_length", "hash_ids"}``; ids
    name 512-token blocks and are global across the file, and there are
    ``ceil(input_length / 512)`` of them: the last id names the partial last
    block.  By default every request is its own one-request conversation, all
    in the one id space ``"mooncake"``.  ``session_gap_s`` rebuilds sessions
    heuristically (see :func:`load_mooncake`).

Loaders: ``cc_traces.py``, ``mooncake.py``; the loaded form and the field
checks: ``trace_model.py``; token expansion: ``token_expander.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from .cc_traces import load_cc_trace
from .mooncake import load_mooncake
from .trace_model import (CC_GLOBAL_SPACE, DATA_DIR, MOONCAKE_BLOCK_SIZE, MOONCAKE_SPACE,
                          Conversation, PathLike, TraceRequest, request_continues)

__all__ = [
    "TraceRequest",
    "Conversation",
    "load_cc_trace",
    "load_mooncake",
    "load_traces",
    "default_sample_paths",
    "request_continues",
    "MOONCAKE_SPACE",
    "MOONCAKE_BLOCK_SIZE",
    "CC_GLOBAL_SPACE",
]


def _expand_paths(paths: Iterable[PathLike]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(
                (q for q in p.iterdir() if q.is_file() and q.suffix in (".json", ".jsonl")),
                key=lambda q: q.name,
            )
            if not found:
                raise ValueError(f"{p}: folder holds no *.json (cc-traces) or *.jsonl (Mooncake) files")
            files.extend(found)
        elif p.is_file():
            if p.suffix not in (".json", ".jsonl"):
                raise ValueError(
                    f"{p}: unknown trace format (expected *.json cc-traces or *.jsonl Mooncake)"
                )
            files.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such trace file or folder")
    return files


def load_traces(
    paths: Union[PathLike, Sequence[PathLike]],
    mooncake_session_gap_s: Optional[float] = None,
) -> list[Conversation]:
    """Load trace files and/or folders, in the order given.

    A folder contributes all its ``*.json`` (cc-traces) and ``*.jsonl``
    (Mooncake) files, sorted by name.  ``mooncake_session_gap_s`` is passed to
    :func:`load_mooncake`.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Conversation] = []
    for f in _expand_paths(paths):
        if f.suffix == ".jsonl":
            out.extend(load_mooncake(f, mooncake_session_gap_s))
        else:
            out.extend(load_cc_trace(f))
    return out


def default_sample_paths() -> list[str]:
    """The embedded sample traces (a few small cc traces and a Mooncake excerpt), sorted by name."""
    return [
        str(q)
        for q in sorted(DATA_DIR.iterdir(), key=lambda q: q.name)
        if q.is_file() and q.suffix in (".json", ".jsonl")
    ]
