"""The verdict on the replay planner's lines: KV blocks and state slots apart.

A hit needs two things: the KV prefix (paged pool) and a recurrent state
checkpoint at exactly that boundary (state pool); ``hit = paged_hit x
state_hit``. Which factor is low, and why checkpoints were lost, tells which
pool to grow. Checkpoint losses are ``evicted + orphaned``: ``evicted`` were
pushed out of the state pool by LRU pressure, ``orphaned`` were invalidated
because the KV block under them was evicted. ``dropped`` (no slot could take
a new one) is reported but is not the evidence of a small pool: a pool that
evicts freely never drops.
"""

from __future__ import annotations

from .log_lines import TAG_FATES, TAG_POOLS, TAG_PRESSURE
from .verdict import Diagnosis, count, detail_lines, hit_lines, pct

# A pool of num_slots slots that kept `kept` checkpoints must have lost at
# least kept - num_slots of them. If evictions account for at least half of
# that unavoidable minimum, slot pressure (not KV eviction or placement) is
# what removed the checkpoints: the state pool binds. Half, not all, because
# orphaning and end-of-run residue also take their share of the minimum.
STATE_EVICTION_SHARE_BINDS = 0.5

# When at least a quarter of the checkpoint losses are orphans, KV eviction
# is a material cause of state misses: adding state slots would not save
# those checkpoints, adding KV memory would.
ORPHAN_SHARE_NOTE = 0.25


def diagnose_separate_pools(s: dict) -> Diagnosis:
    pools, fates = s[TAG_POOLS], s[TAG_FATES]
    paged_hit, state_hit = float(pools["paged_hit"]), float(pools["state_hit"])
    kept, dropped, evicted = fates["kept"], fates["dropped"], fates["evicted"]
    orphaned, num_slots = fates["orphaned"], fates["num_slots"]
    evicted_share = evicted / max(1, kept - num_slots)
    losses = evicted + orphaned
    orphan_share = orphaned / losses if losses > 0 else 0.0

    lines, state_ceiling = hit_lines(s)
    lines += [
        f"a much bigger state pool could reach about {pct(state_ceiling)} "
        f"((cached + lost_to_checkpoint) / reusable)",
        f"state pool: {count(num_slots)} slots kept {count(kept)} checkpoints, so at least "
        f"{count(max(0, kept - num_slots))} had to go; {count(evicted)} were evicted by slot "
        f"pressure ({pct(evicted_share)} of max(1, kept - num_slots)) and "
        f"{count(orphaned)} orphaned by KV eviction",
        f"dropped={count(dropped)}: drops alone cannot show a small pool (a pool that "
        f"evicts freely never drops); evictions against the slot count are the evidence",
    ]
    state_pressure = evicted_share >= STATE_EVICTION_SHARE_BINDS and state_hit < paged_hit
    orphan_dominated = orphaned > evicted
    if state_pressure and not orphan_dominated:
        binds = "state"
        verdict = ("binds: state - slot pressure evicts checkpoints that later requests needed; "
                   "more state checkpoint slots (or fewer, better-placed checkpoints) is the "
                   "lever")
    elif orphan_dominated or paged_hit < state_hit:
        binds = "kv"
        reason = ("orphans outnumber evictions, so checkpoints die with their KV blocks"
                  if orphan_dominated
                  else "paged_hit is the lower factor, so KV prefixes are missing first")
        verdict = f"binds: kv - {reason}; more KV memory is the lever"
    else:
        binds = "neither"
        verdict = ("binds: neither - state misses are not from slot pressure or KV eviction; "
                   "look at where checkpoints are placed (resume boundary, interval)"
                   if state_hit < paged_hit
                   else "binds: neither - neither pool shows pressure at this load")
    lines.append(verdict)
    core_binds = pools.get("binds")
    if isinstance(core_binds, str) and core_binds != binds:
        lines.append(f"(the core's own lower-factor label says binds={core_binds})")

    orphan_note = None
    if losses > 0 and orphan_share >= ORPHAN_SHARE_NOTE:
        orphan_note = (f"{count(orphaned)} of {count(losses)} checkpoint losses "
                       f"({pct(orphan_share)}) are orphans: KV eviction is taking checkpoints "
                       f"with it, so more KV memory (not more state slots) is the lever for "
                       f"those")
        lines.append(orphan_note)
    lines += detail_lines(s)
    pressure = s.get(TAG_PRESSURE)
    if pressure:
        parts = []
        for pool in ("kv", "state"):
            keys = [f"{pool}_{k}" for k in ("used", "reusable_free", "vacant", "total")]
            if all(k in pressure for k in keys):
                used, free, vacant, total = (pressure[k] for k in keys)
                parts.append(f"{pool} {count(used)} used / {count(free)} reusable free / "
                             f"{count(vacant)} vacant of {count(total)}")
        if parts:
            lines.append("pools at the last report: " + "; ".join(parts))
    return Diagnosis(binds, state_ceiling, orphan_note, lines, s, "replay")
