"""Why a state checkpoint exists: the kind of each one the code places.

One enum for the replay's manager, the vLLM adapter and the stats, so each
kind is counted apart (`CacheStats.written_by_kind`, the `[Checkpoint
Kinds]` log line, `vllm:atom_checkpoints_written{kind=...}`).
"""

from __future__ import annotations

from enum import Enum


class CheckpointKind(str, Enum):
    """A kind compares and hashes as its name (`CheckpointKind.CUT == "cut"`),
    so counters keyed by either agree and JSON holds the plain name."""

    # the last block boundary before a prompt's end: the next turn resumes there
    ANCHOR = "anchor"
    # where a request's KV prefix outran its states: it wanted to resume there
    DEMAND = "demand"
    # below a KV tail cut, so the next similar cut still finds a state
    CUT = "cut"
    # fixed fractions of a request's pool share, in prompts longer than it
    FALLBACK = "fallback"
    # fractions of a prompt computed from scratch (a conversation's start)
    COLD = "cold"
    # fractions of a prompt inside the span its prefill computes
    SPAN = "span"
    # a little below the anchor of a long recompute
    INSURANCE = "insurance"
    # every N tokens of a prompt (`ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS`)
    LADDER = "ladder"
    # every N tokens of decoded output (the replay planner's ladder)
    DECODE = "decode"
    # vLLM's own state at a shared-prefix junction
    JUNCTION = "junction"
    # Not placed: a state a live request holds under its prefix
    # (`ATOM_STATE_CHECKPOINT_FLOOR`); counted as holds.
    FLOOR = "floor"
    # Not a position rule: a planned checkpoint written from inside a
    # prefill forward (`ATOM_INTERIOR_CHECKPOINTS=on`) instead of at a
    # chunk's end; counted besides its placement kind.
    INTERIOR = "interior"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


# The kinds the stats count as written, in the log line's order.
WRITTEN_KINDS = (CheckpointKind.ANCHOR, CheckpointKind.DEMAND, CheckpointKind.CUT,
                 CheckpointKind.FALLBACK, CheckpointKind.COLD, CheckpointKind.SPAN,
                 CheckpointKind.INSURANCE, CheckpointKind.LADDER, CheckpointKind.DECODE,
                 CheckpointKind.JUNCTION)

# The replay manager's protected tier: a live conversation's resume points
# and the states that insure them.
PROTECTED_KINDS = frozenset({CheckpointKind.ANCHOR, CheckpointKind.CUT, CheckpointKind.DEMAND,
                             CheckpointKind.FALLBACK, CheckpointKind.COLD, CheckpointKind.SPAN,
                             CheckpointKind.INSURANCE})

# Filed at the head of the replay manager's LRU: placed on a guess, they
# must earn their slot by being read.
GUESS_KINDS = frozenset({CheckpointKind.DEMAND, CheckpointKind.LADDER, CheckpointKind.DECODE})
