"""What the store connector did: counters for its log line and /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

# Why a spill or a load did not happen (the by-reason counters' labels).
SPILL_DROPS = ("no room", "put failed", "page gone", "late")
# a load's failures name the leg: "state missing", "kv corrupt", ...
LOAD_FAILURES = ("missing", "corrupt", "error", "size")


@dataclass
class ConnectorCounters:
    spills_requested: int = 0      # objects the scheduler asked the worker to store
    spills_stored: int = 0
    spills_dropped: dict = field(default_factory=dict)   # by reason
    loads_attempted: int = 0       # requests sent to load
    loads_completed: int = 0
    loads_failed: dict = field(default_factory=dict)     # by reason
    joint_boundaries: int = 0      # loads planned, one boundary each
    loaded_tokens: int = 0         # tokens those loads resume past the GPU's hit
    declines: dict = field(default_factory=dict)         # lookups without a load, by reason
    bytes_spilled: int = 0
    bytes_loaded: int = 0

    @staticmethod
    def bump(counts: dict, reason: str, n: int = 1) -> None:
        counts[reason] = counts.get(reason, 0) + n

    def line(self) -> str:
        """The `[Store Connector]` log line."""
        def by(counts: dict) -> str:
            return ",".join(f"{k.replace(' ', '_')}:{v}" for k, v in sorted(counts.items())) or "-"
        return (f"[Store Connector] spills_requested={self.spills_requested} "
                f"spills_stored={self.spills_stored} "
                f"spills_dropped={sum(self.spills_dropped.values())} ({by(self.spills_dropped)}) "
                f"loads_attempted={self.loads_attempted} loads_completed={self.loads_completed} "
                f"loads_failed={sum(self.loads_failed.values())} ({by(self.loads_failed)}) "
                f"joint_boundaries={self.joint_boundaries} loaded_tokens={self.loaded_tokens} "
                f"declines={sum(self.declines.values())} ({by(self.declines)}) "
                f"bytes_spilled={self.bytes_spilled} bytes_loaded={self.bytes_loaded}")
