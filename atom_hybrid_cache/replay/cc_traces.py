"""The cc-traces loader (``*.json``, one conversation per file, its
sub-agents as conversations of their own; the format is in ``traces.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from .trace_model import (CC_GLOBAL_SPACE, Conversation, PathLike, TraceRequest, check_counts,
                          count, int_list, is_int, number, required_field)


def load_cc_trace(path: PathLike) -> list[Conversation]:
    """Load one cc-traces JSON file: the parent conversation, then one
    conversation per nested sub-agent list (document order).

    Raises ValueError naming the file and the request (as a JSON path, e.g.
    ``requests[3].requests[5]``) for malformed input.  Conversations without
    requests are left out.
    """
    p = Path(path)
    src = str(p)
    try:
        with open(p, encoding="utf-8") as f:
            doc = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{src}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        raise ValueError(f"{src}: expected a JSON object with a 'requests' list (cc-traces format)")
    trace_id = doc.get("id", p.stem)
    if not isinstance(trace_id, str) or not trace_id:
        raise ValueError(f"{src}: 'id' must be a non-empty string, got {trace_id!r}")
    bs = doc.get("block_size", 64)
    if not is_int(bs) or bs <= 0:
        raise ValueError(f"{src}: 'block_size' must be a positive integer, got {bs!r}")
    scope = doc.get("hash_id_scope", "local")
    if scope not in ("local", "global"):
        raise ValueError(f"{src}: 'hash_id_scope' must be 'local' or 'global', got {scope!r}")
    space = trace_id if scope == "local" else CC_GLOBAL_SPACE

    out: list[Conversation] = []
    sub_counter = [0]
    pool: dict[int, int] = {}

    def build(items: list, conv_id: str, prefix: str, parent_id, parent_index) -> None:
        raw: list[tuple[float, int, dict, str]] = []  # (t, file position, item, where)
        subs: list[tuple[list, str, int]] = []  # (items, where, parent_index)
        for pos, item in enumerate(items):
            where = f"{src}: {prefix}[{pos}]"
            if not isinstance(item, dict):
                raise ValueError(f"{where}: expected a JSON object")
            if item.get("type") == "subagent":
                nested = item.get("requests")
                if not isinstance(nested, list):
                    raise ValueError(f"{where}: subagent item needs a 'requests' list")
                subs.append((nested, f"{prefix}[{pos}].requests", len(raw)))
                continue
            raw.append((number(required_field(item, "t", where), where, "t"), pos, item, where))
        # Stable sort by t: ties keep file order.
        order = sorted(range(len(raw)), key=lambda j: raw[j][0])
        # Map "number of parent requests before the subagent item" through the sort:
        # the waiting request is the first one (in sorted order) among those after it.
        rank = {j: r for r, j in enumerate(order)}
        reqs: list[TraceRequest] = []
        for r, j in enumerate(order):
            t, _, item, where = raw[j]
            prompt_len = count(required_field(item, "in", where), where, "in")
            out_len = count(item.get("out", 0), where, "out")
            ids = int_list(required_field(item, "hash_ids", where), where, "hash_ids", pool)
            check_counts(prompt_len, len(ids), bs, where, "'in'")
            typ = item.get("type", "n")
            if typ not in ("n", "s"):
                raise ValueError(f"{where}: unknown request type {typ!r} (expected 'n', 's' or 'subagent')")
            think = max(0.0, number(item.get("think_time", 0), where, "think_time"))
            reqs.append(TraceRequest(conv_id, r, prompt_len, out_len, ids, t, typ == "s", think))
        if reqs:
            out.append(Conversation(conv_id, reqs, src, space, bs, parent_id, parent_index))
        for nested, nprefix, n_before in subs:
            sub_counter[0] += 1
            sub_id = f"{trace_id}/sub{sub_counter[0]}"
            after = [rank[j] for j in range(n_before, len(raw))]
            waiting = min(after) if after else len(raw)
            build(nested, sub_id, nprefix, conv_id if reqs else parent_id,
                  waiting if reqs else parent_index)

    build(doc["requests"], trace_id, "requests", None, None)
    return out


# ---------------------------------------------------------------------------
# Mooncake
# ---------------------------------------------------------------------------
