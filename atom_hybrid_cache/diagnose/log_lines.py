"""The stats lines in a log: parsing, and the last complete set of them.

Two sets exist. The replay planner's manager keeps KV blocks and state
slots apart and prints::

    [Cache Stats] admissions=1200 reusable=5000000 cached=4700000 hit=0.9400 lost_to_checkpoint=200000 lost_unrecoverable=100000
    [Cache Pools] paged_hit=0.9800 state_hit=0.9592 combined=0.9400 binds=state
    [Cache Freq] requests=1200 full_reuse=1100 paged_match_state_miss=60 checkpoint_would_fix=55 paged_miss=40
    [Checkpoint Fates] written=1500 kept=1500 dropped=10 evicted=900 orphaned=300 read=1150 num_slots=40
    [Pool Pressure] kv_used=1000 kv_reusable_free=500 kv_vacant=20 kv_indexed=1400 kv_total=1521 state_used=8 ...
    [Checkpoint Kinds] anchor=900 demand=40 cut=20 ... interior=0 floor_holds=0

The vLLM plugin keeps states as pages of vLLM's one pool, which evicts
silently, and prints the same first three lines, then::

    [Shared Pool] pages=1413 used=1200 free=213 states_written=1500 states_read=1150
    [Checkpoint Kinds] ...
    [Admission Gate] held_steps=12 holds=30 longest_hold=4      (with the gate on)

Any prefix before a tag (vLLM's ``INFO 11-29 14:00:00 [file.py:12]``) is
ignored.
"""

from __future__ import annotations

import re
from typing import Any

TAG_STATS = "Cache Stats"
TAG_POOLS = "Cache Pools"
TAG_FREQ = "Cache Freq"
TAG_FATES = "Checkpoint Fates"
TAG_PRESSURE = "Pool Pressure"
TAG_SHARED = "Shared Pool"
TAG_KINDS = "Checkpoint Kinds"
TAG_GATE = "Admission Gate"
ALL_TAGS = (TAG_STATS, TAG_POOLS, TAG_FREQ, TAG_FATES, TAG_PRESSURE, TAG_SHARED, TAG_KINDS,
            TAG_GATE)

_HEAD_KEYS = {
    TAG_STATS: ("reusable", "cached", "hit", "lost_to_checkpoint", "lost_unrecoverable"),
    TAG_POOLS: ("paged_hit", "state_hit"),
}
# What each diagnosis needs; the other lines only add detail.
REPLAY_KEYS: dict[str, tuple[str, ...]] = {
    **_HEAD_KEYS, TAG_FATES: ("kept", "dropped", "evicted", "orphaned", "num_slots")}
PLUGIN_KEYS: dict[str, tuple[str, ...]] = {
    **_HEAD_KEYS, TAG_SHARED: ("pages", "used", "free")}
REQUIRED_KEYS = REPLAY_KEYS
REQUIRED_TAGS = tuple(REPLAY_KEYS)

_TAG_RE = re.compile(r"\[(" + "|".join(re.escape(t) for t in ALL_TAGS) + r")\]")
_KV_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(\S+)")


def _value(text: str) -> Any:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_line(line: str) -> tuple[str, dict[str, Any]] | None:
    """``(tag, {key: value})`` for a stats line, else None. Prefixes are ignored."""
    m = _TAG_RE.search(line)
    if m is None:
        return None
    return m.group(1), {k: _value(v) for k, v in _KV_RE.findall(line[m.end():])}


def _sets(text: str) -> list[dict[str, dict[str, Any]]]:
    """Split the stats lines into sets, in log order: a set is the run of
    lines up to the first repeated tag (a tag seen again means the next set
    has started), whatever order its lines come in; a set cut short stays
    incomplete."""
    sets: list[dict[str, dict[str, Any]]] = []
    current: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        parsed = parse_line(line)
        if parsed is None:
            continue
        tag, values = parsed
        if tag in current:
            sets.append(current)
            current = {}
        current[tag] = values
    if current:
        sets.append(current)
    return sets


def kind_of(s: dict) -> str:
    """"plugin" for the vLLM plugin's set, "replay" for the replay's."""
    return "plugin" if TAG_SHARED in s else "replay"


def _required(s: dict) -> dict[str, tuple[str, ...]]:
    return PLUGIN_KEYS if kind_of(s) == "plugin" else REPLAY_KEYS


def _missing_keys(s: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for tag, keys in _required(s).items():
        values = s.get(tag, {})
        lacking = [k for k in keys if not isinstance(values.get(k), (int, float))]
        if lacking:
            out[tag] = lacking
    return out


def _names(tags) -> str:
    return ", ".join(f"[{t}]" for t in tags)


def last_complete_set(text: str) -> dict[str, dict[str, Any]]:
    """The last set holding every line its diagnosis needs, with every key.

    Raises ValueError naming the missing line(s) or key(s)."""
    sets = _sets(text)
    for s in reversed(sets):
        if all(tag in s for tag in _required(s)) and not _missing_keys(s):
            return s
    seen = {tag for s in sets for tag in s}
    if TAG_SHARED not in seen:
        never = [t for t in REPLAY_KEYS if t not in seen]
        if never:
            raise ValueError(
                f"log has no {_names(never)} line{'s' if len(never) > 1 else ''}; the "
                f"diagnosis needs {_names(REPLAY_KEYS)} (the replay planner's lines) or "
                f"{_names(PLUGIN_KEYS)} (the vLLM plugin's)")
    last = sets[-1]
    absent = [t for t in _required(last) if t not in last]
    if absent:
        raise ValueError(f"no complete set of cache stats lines: the last set lacks "
                         f"{_names(absent)}")
    raise ValueError("no complete set of cache stats lines: missing " + "; ".join(
        f"[{t}] {', '.join(keys)}" for t, keys in _missing_keys(last).items()))
