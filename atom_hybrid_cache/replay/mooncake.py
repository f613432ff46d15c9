"""The Mooncake loader (``*.jsonl``, one request per line; the format is
in ``traces.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from .trace_model import (MOONCAKE_BLOCK_SIZE, MOONCAKE_SPACE, Conversation, PathLike,
                          TraceRequest, check_counts, count, int_list, number, required_field)


def load_mooncake(path: PathLike, session_gap_s: Optional[float] = None) -> list[Conversation]:
    """Load a Mooncake JSONL trace (512-token blocks, global ids, space ``"mooncake"``).

    Without ``session_gap_s`` each request is its own conversation
    ``<file stem>/<line index>``.  With it, sessions are rebuilt: a request
    joins the conversation whose latest request it continues (at least one
    full block agrees: the latest request's ids except its last, partial one
    are a prefix of this request's, and this prompt is longer) and arrived
    at most ``session_gap_s`` seconds after it; among
    several, the one with the longest matched prefix, then the most recent,
    wins.  Otherwise it starts a new conversation.  Requests are taken in
    timestamp order (stable).
    """
    p = Path(path)
    src = str(p)
    if session_gap_s is not None:
        if isinstance(session_gap_s, bool) or not isinstance(session_gap_s, (int, float)) \
                or not session_gap_s >= 0:
            raise ValueError(f"session_gap_s must be a non-negative number, got {session_gap_s!r}")
    rows: list[tuple[float, int, int, int, tuple[int, ...]]] = []
    pool: dict[int, int] = {}
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{src}: line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object")
            ts = number(required_field(obj, "timestamp", where), where, "timestamp") / 1000.0
            prompt_len = count(required_field(obj, "input_length", where), where, "input_length")
            out_len = count(obj.get("output_length", 0), where, "output_length")
            ids = int_list(required_field(obj, "hash_ids", where), where, "hash_ids", pool)
            check_counts(prompt_len, len(ids), MOONCAKE_BLOCK_SIZE, where, "'input_length'", True)
            rows.append((ts, len(rows), prompt_len, out_len, ids))
    rows.sort(key=lambda r: r[0])
    stem = p.stem

    if session_gap_s is None:
        return [
            Conversation(
                f"{stem}/{n}",
                [TraceRequest(f"{stem}/{n}", 0, pl, ol, ids, ts)],
                src, MOONCAKE_SPACE, MOONCAKE_BLOCK_SIZE,
            )
            for n, (ts, _, pl, ol, ids) in enumerate(rows)
        ]

    # Session rebuild.  Index each open conversation by the chained hash of its
    # latest request's ids minus the last one; a new request walks its own
    # prefixes and looks each up (O(total ids)).
    convs: list[list[tuple[float, int, int, tuple[int, ...]]]] = []
    index: dict[tuple[int, int], list[int]] = {}  # (prefix len, chain hash) -> conv numbers
    open_key: list[Optional[tuple[int, int]]] = []
    lengths: set[int] = set()

    def key_of(ids: tuple[int, ...]) -> Optional[tuple[int, int]]:
        k = len(ids) - 1
        if k < 1:
            return None
        h = 0
        for x in ids[:k]:
            h = hash((h, x))
        return (k, h)

    for ts, _, pl, ol, ids in rows:
        best = None  # (prefix len, last arrival, conv number)
        if lengths:
            h = 0
            for k in range(1, len(ids)):  # need an id at index k
                h = hash((h, ids[k - 1]))
                if k not in lengths:
                    continue
                for c in index.get((k, h), ()):
                    last_ts, last_pl, _, last_ids = convs[c][-1]
                    if (ts - last_ts > session_gap_s or pl <= last_pl
                            or last_ids[:k] != ids[:k]):
                        continue
                    cand = (k, last_ts, c)
                    if best is None or cand[:2] > best[:2]:
                        best = cand
        if best is None:
            c = len(convs)
            convs.append([])
            open_key.append(None)
        else:
            c = best[2]
        old = open_key[c]
        if old is not None:
            lst = index[old]
            lst.remove(c)
            if not lst:
                del index[old]
        convs[c].append((ts, pl, ol, ids))
        new = key_of(ids)
        open_key[c] = new
        if new is not None:
            index.setdefault(new, []).append(c)
            lengths.add(new[0])

    out = []
    for n, reqs in enumerate(convs):
        cid = f"{stem}/s{n}"
        out.append(Conversation(
            cid,
            [TraceRequest(cid, i, pl, ol, ids, ts) for i, (ts, pl, ol, ids) in enumerate(reqs)],
            src, MOONCAKE_SPACE, MOONCAKE_BLOCK_SIZE,
        ))
    return out


# ---------------------------------------------------------------------------
# Files and folders
# ---------------------------------------------------------------------------
