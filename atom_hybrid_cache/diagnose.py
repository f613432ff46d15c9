"""Read the core's cache stats lines from a log and say which pool binds.

The core prints a set of lines like these (any prefix before the tag, such as
vLLM's ``INFO 11-29 14:00:00 [file.py:12]``, is ignored)::

    [Cache Stats] admissions=1200 reusable=5000000 cached=4700000 hit=0.9400 lost_to_checkpoint=200000 lost_unrecoverable=100000
    [Cache Pools] paged_hit=0.9800 state_hit=0.9592 combined=0.9400 binds=state
    [Cache Freq] requests=1200 full_reuse=1100 paged_match_state_miss=60 checkpoint_would_fix=55 paged_miss=40
    [Checkpoint Fates] written=1500 kept=1500 dropped=10 evicted=900 orphaned=300 read=1150 num_slots=40
    [Pool Pressure] kv_used=1000 kv_reusable_free=500 kv_vacant=20 kv_indexed=1400 kv_total=1521 state_used=8 state_reusable_free=30 state_vacant=2 state_indexed=30 state_total=40

A hit needs two things: the KV prefix (paged pool) and a recurrent state
checkpoint at exactly that boundary (state pool). ``hit = paged_hit x
state_hit``. Which factor is low, and why checkpoints were lost, tells which
pool to grow.

Checkpoint losses are ``evicted + orphaned``: ``evicted`` were pushed out of
the state pool by LRU pressure, ``orphaned`` were invalidated because the KV
block under them was evicted. ``dropped`` (no slot could take a new one) is
reported but is not the evidence of a small pool: a pool that evicts freely
never drops.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# --------------------------------------------------------------------------
# Thresholds
# --------------------------------------------------------------------------

# A pool of num_slots slots that kept `kept` checkpoints must have lost at
# least kept - num_slots of them. If evictions account for at least half of
# that unavoidable minimum, slot pressure (not KV eviction or placement) is
# what removed the checkpoints: the state pool binds. Half, not all, because
# orphaning and end-of-run residue also take their share of the minimum.
STATE_EVICTION_SHARE_BINDS = 0.5

# When at least a quarter of the checkpoint losses are orphans, KV eviction
# is a material cause of state misses: adding state slots would not save
# those checkpoints, adding KV memory would. A quarter is large enough to be
# worth acting on and small enough to be flagged before it dominates.
ORPHAN_SHARE_NOTE = 0.25

# --------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------

TAG_STATS = "Cache Stats"
TAG_POOLS = "Cache Pools"
TAG_FREQ = "Cache Freq"
TAG_FATES = "Checkpoint Fates"
TAG_PRESSURE = "Pool Pressure"
ALL_TAGS = (TAG_STATS, TAG_POOLS, TAG_FREQ, TAG_FATES, TAG_PRESSURE)

# The diagnosis needs these tags and keys; the other two lines only add detail.
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    TAG_STATS: ("reusable", "cached", "hit", "lost_to_checkpoint", "lost_unrecoverable"),
    TAG_POOLS: ("paged_hit", "state_hit"),
    TAG_FATES: ("kept", "dropped", "evicted", "orphaned", "num_slots"),
}
REQUIRED_TAGS = tuple(REQUIRED_KEYS)

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
    """Split the stats lines into sets, in log order.

    A set is the run of lines up to the first repeated tag: a tag seen again
    means the core has started printing the next set. This holds whatever
    order the core prints the five lines in, and a set cut short (a crash, a
    truncated log) simply stays incomplete.
    """
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


def last_complete_set(text: str) -> dict[str, dict[str, Any]]:
    """The last set holding every required line with every required key.

    Raises ValueError naming the missing line(s) or key(s).
    """
    sets = _sets(text)
    for s in reversed(sets):
        if all(tag in s for tag in REQUIRED_TAGS) and not _missing_keys(s):
            return s

    seen = {tag for s in sets for tag in s}
    never = [t for t in REQUIRED_TAGS if t not in seen]
    if never:
        raise ValueError(
            "log has no " + ", ".join(f"[{t}]" for t in never) + " line"
            + ("s" if len(never) > 1 else "")
            + "; the diagnosis needs "
            + ", ".join(f"[{t}]" for t in REQUIRED_TAGS)
        )
    last = sets[-1]
    absent = [t for t in REQUIRED_TAGS if t not in last]
    if absent:
        raise ValueError(
            "no complete set of cache stats lines: the last set lacks "
            + ", ".join(f"[{t}]" for t in absent)
        )
    raise ValueError(
        "no complete set of cache stats lines: missing "
        + "; ".join(f"[{t}] {', '.join(keys)}" for t, keys in _missing_keys(last).items())
    )


def _missing_keys(s: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for tag, keys in REQUIRED_KEYS.items():
        values = s.get(tag, {})
        lacking = [k for k in keys if not isinstance(values.get(k), (int, float))]
        if lacking:
            out[tag] = lacking
    return out


# --------------------------------------------------------------------------
# Diagnosis
# --------------------------------------------------------------------------


@dataclass
class Diagnosis:
    """Which pool binds, and why.

    binds              "state", "kv" or "neither"
    state_ceiling_hit  the hit rate a much bigger state pool could buy:
                       (cached + lost_to_checkpoint) / reusable
    orphan_note        set when KV eviction takes a large share of checkpoints
    lines              the explanation, one sentence a line
    values             the parsed set the diagnosis was made from
    """

    binds: str
    state_ceiling_hit: float
    orphan_note: str | None
    lines: list[str]
    values: dict[str, dict[str, Any]] = field(default_factory=dict)


def _pct(x: float) -> str:
    return f"{100.0 * x:.2f}%"


def _n(x: float) -> str:
    return f"{int(x):,}"


def diagnose(text: str) -> Diagnosis:
    """Diagnose the last complete set of stats lines in ``text``."""
    s = last_complete_set(text)
    stats, pools, fates = s[TAG_STATS], s[TAG_POOLS], s[TAG_FATES]

    reusable = stats["reusable"]
    cached = stats["cached"]
    lost_ckpt = stats["lost_to_checkpoint"]
    lost_kv = stats["lost_unrecoverable"]
    paged_hit = float(pools["paged_hit"])
    state_hit = float(pools["state_hit"])

    kept = fates["kept"]
    dropped = fates["dropped"]
    evicted = fates["evicted"]
    orphaned = fates["orphaned"]
    num_slots = fates["num_slots"]

    state_ceiling = (cached + lost_ckpt) / reusable if reusable > 0 else 0.0
    forced_losses = max(1, kept - num_slots)
    evicted_share = evicted / forced_losses
    losses = evicted + orphaned
    orphan_share = orphaned / losses if losses > 0 else 0.0

    lines: list[str] = []
    admissions = stats.get("admissions")
    lines.append(
        f"hit {_pct(float(stats['hit']))} of {_n(reusable)} reusable tokens"
        + (f" over {_n(admissions)} admissions" if isinstance(admissions, int) else "")
        + f" = paged_hit {_pct(paged_hit)} x state_hit {_pct(state_hit)}"
    )
    lines.append(
        f"lost {_n(lost_ckpt)} tokens with the KV prefix present but no checkpoint at a "
        f"usable boundary, and {_n(lost_kv)} with the KV prefix gone"
    )
    lines.append(
        f"a much bigger state pool could reach about {_pct(state_ceiling)} "
        f"((cached + lost_to_checkpoint) / reusable)"
    )
    lines.append(
        f"state pool: {_n(num_slots)} slots kept {_n(kept)} checkpoints, so at least "
        f"{_n(max(0, kept - num_slots))} had to go; {_n(evicted)} were evicted by slot "
        f"pressure ({_pct(evicted_share)} of max(1, kept - num_slots)) and "
        f"{_n(orphaned)} orphaned by KV eviction"
    )
    lines.append(
        f"dropped={_n(dropped)}: drops alone cannot show a small pool (a pool that "
        f"evicts freely never drops); evictions against the slot count are the evidence"
    )

    state_pressure = evicted_share >= STATE_EVICTION_SHARE_BINDS and state_hit < paged_hit
    orphan_dominated = orphaned > evicted
    if state_pressure and not orphan_dominated:
        binds = "state"
        verdict = (
            "binds: state - slot pressure evicts checkpoints that later requests needed; "
            "more state checkpoint slots (or fewer, better-placed checkpoints) is the lever"
        )
    elif orphan_dominated or paged_hit < state_hit:
        binds = "kv"
        reason = (
            "orphans outnumber evictions, so checkpoints die with their KV blocks"
            if orphan_dominated
            else "paged_hit is the lower factor, so KV prefixes are missing first"
        )
        verdict = f"binds: kv - {reason}; more KV memory is the lever"
    else:
        binds = "neither"
        if state_hit < paged_hit:
            verdict = (
                "binds: neither - state misses are not from slot pressure or KV eviction; "
                "look at where checkpoints are placed (resume boundary, interval)"
            )
        else:
            verdict = "binds: neither - neither pool shows pressure at this load"
    lines.append(verdict)

    core_binds = pools.get("binds")
    if isinstance(core_binds, str) and core_binds != binds:
        lines.append(f"(the core's own lower-factor label says binds={core_binds})")

    orphan_note = None
    if losses > 0 and orphan_share >= ORPHAN_SHARE_NOTE:
        orphan_note = (
            f"{_n(orphaned)} of {_n(losses)} checkpoint losses ({_pct(orphan_share)}) are "
            f"orphans: KV eviction is taking checkpoints with it, so more KV memory "
            f"(not more state slots) is the lever for those"
        )
        lines.append(orphan_note)

    freq = s.get(TAG_FREQ)
    if freq and all(k in freq for k in ("requests", "full_reuse", "paged_match_state_miss")):
        lines.append(
            f"requests: {_n(freq['full_reuse'])} of {_n(freq['requests'])} reused fully; "
            f"{_n(freq['paged_match_state_miss'])} matched KV but missed state"
            + (
                f" ({_n(freq['checkpoint_would_fix'])} of them a checkpoint would fix)"
                if "checkpoint_would_fix" in freq
                else ""
            )
            + (f"; {_n(freq['paged_miss'])} missed KV" if "paged_miss" in freq else "")
        )
    pressure = s.get(TAG_PRESSURE)
    if pressure:
        parts = []
        for pool in ("kv", "state"):
            keys = [f"{pool}_{k}" for k in ("used", "reusable_free", "vacant", "total")]
            if all(k in pressure for k in keys):
                used, free, vacant, total = (pressure[k] for k in keys)
                parts.append(
                    f"{pool} {_n(used)} used / {_n(free)} reusable free / "
                    f"{_n(vacant)} vacant of {_n(total)}"
                )
        if parts:
            lines.append("pools at the last report: " + "; ".join(parts))

    return Diagnosis(
        binds=binds,
        state_ceiling_hit=state_ceiling,
        orphan_note=orphan_note,
        lines=lines,
        values=s,
    )
