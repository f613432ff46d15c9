"""What a diagnosis says, and the lines both kinds of stats set share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .log_lines import TAG_FREQ, TAG_KINDS, TAG_POOLS, TAG_STATS


@dataclass
class Diagnosis:
    """Which pool binds, and why.

    source             "replay" (separate KV and state pools) or "plugin"
                       (vLLM's one shared pool)
    binds              "state", "kv" or "neither"
    state_ceiling_hit  the hit rate states at every usable boundary could
                       buy: (cached + lost_to_checkpoint) / reusable
    orphan_note        set when KV eviction takes a large share of checkpoints
    lines              the explanation, one sentence a line
    values             the parsed set the diagnosis was made from
    """

    binds: str
    state_ceiling_hit: float
    orphan_note: str | None
    lines: list[str]
    values: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: str = "replay"


def pct(x: float) -> str:
    return f"{100.0 * x:.2f}%"


def count(x: float) -> str:
    return f"{int(x):,}"


def hit_lines(s: dict) -> tuple[list[str], float]:
    """The hit and what was lost, and the state ceiling."""
    stats, pools = s[TAG_STATS], s[TAG_POOLS]
    reusable, cached = stats["reusable"], stats["cached"]
    lost_ckpt, lost_kv = stats["lost_to_checkpoint"], stats["lost_unrecoverable"]
    ceiling = (cached + lost_ckpt) / reusable if reusable > 0 else 0.0
    admissions = stats.get("admissions")
    return [
        f"hit {pct(float(stats['hit']))} of {count(reusable)} reusable tokens"
        + (f" over {count(admissions)} admissions" if isinstance(admissions, int) else "")
        + f" = paged_hit {pct(float(pools['paged_hit']))} x state_hit "
        f"{pct(float(pools['state_hit']))}",
        f"lost {count(lost_ckpt)} tokens with the KV prefix present but no checkpoint at a "
        f"usable boundary, and {count(lost_kv)} with the KV prefix gone",
    ], ceiling


def detail_lines(s: dict) -> list[str]:
    """The requests' buckets and the checkpoints by kind, where logged."""
    out = []
    freq = s.get(TAG_FREQ)
    if freq and all(k in freq for k in ("requests", "full_reuse", "paged_match_state_miss")):
        out.append(
            f"requests: {count(freq['full_reuse'])} of {count(freq['requests'])} reused fully; "
            f"{count(freq['paged_match_state_miss'])} matched KV but missed state"
            + (f" ({count(freq['checkpoint_would_fix'])} of them a checkpoint would fix)"
               if "checkpoint_would_fix" in freq else "")
            + (f"; {count(freq['paged_miss'])} missed KV" if "paged_miss" in freq else ""))
    kinds = s.get(TAG_KINDS)
    if kinds:
        written = [f"{k} {count(v)}" for k, v in kinds.items()
                   if isinstance(v, int) and v and k not in ("interior", "floor_holds")]
        if written:
            out.append("checkpoints written by kind: " + ", ".join(written)
                       + (f" ({count(kinds['interior'])} of them inside a forward)"
                          if kinds.get("interior") else ""))
    return out
