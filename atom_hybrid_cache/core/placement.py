"""Where state checkpoints go: the positions rule of one admitted prompt.

Positions are token counts (the state after that many tokens) and always
multiples of the KV block size, because a checkpoint is filed under the hash
of the last block it covers. `plan_checkpoints` places every kind of
`kinds.CheckpointKind` a prompt can get at admission:

- anchor: agentic clients resend the whole previous prompt and continue it,
  so the next turn resumes where this prompt ends;
- insurance: a little below the anchor of a long recompute (clients rewrite
  the last few blocks now and then);
- demand: where the request's KV prefix outran its checkpoints;
- cut: some way below a KV tail cut, for the next similar cut;
- fallback: fixed fractions of the request's pool share, in prompts longer
  than that share;
- cold: fractions of a prompt computed from scratch;
- span: fractions of a prompt inside the span its prefill computes;
- ladder: a rung every N tokens (N > 0), none for N == -1, and no
  checkpoints at all for N == 0.
"""

from __future__ import annotations

import bisect
from typing import Callable, Optional

from .kinds import CheckpointKind

# interval values with a meaning of their own
INTERVAL_OFF = 0
INTERVAL_NO_LADDER = -1


def snap_interval(interval: int, block_size: int,
                  warn: Callable[[str], None] = lambda msg: None) -> int:
    """The interval the ladder really uses.

    A positive interval that is not a multiple of the block size snaps down,
    since rungs must sit on block boundaries; one that snaps to 0 turns
    checkpointing off rather than placing a rung at every position."""
    if interval in (INTERVAL_OFF, INTERVAL_NO_LADDER):
        return interval
    if interval < INTERVAL_NO_LADDER:
        raise ValueError(
            f"state_checkpoint_interval_tokens must be > 0, 0 (off) or -1 (no ladder), got {interval}")
    snapped = interval // block_size * block_size
    if snapped != interval:
        if snapped == 0:
            warn(f"state_checkpoint_interval_tokens={interval} is below the block size "
                 f"{block_size}: state checkpointing is OFF")
        else:
            warn(f"state_checkpoint_interval_tokens={interval} is not a multiple of the "
                 f"block size {block_size}: using {snapped}")
    return snapped


def is_rung(position: int, interval: int) -> bool:
    """True when `position` is on the ladder. Never true without a ladder:
    `position % -1 == 0` holds for every position."""
    return interval > 0 and position > 0 and position % interval == 0


def ladder_positions(lo: int, hi: int, interval: int) -> list[int]:
    """Rungs strictly above lo and at most hi."""
    if interval <= 0 or hi <= lo:
        return []
    first = (lo // interval + 1) * interval
    return list(range(first, hi + 1, interval))


def anchor_position(prompt_len: int, block_size: int, successor_room: int,
                    margin_tokens: int) -> int:
    """Last block boundary a continuation of this prompt can resume from.

    The next forward must carry `successor_room` tokens, and the last
    `margin_tokens` tokens of a prompt often change when a client appends
    to it (a BPE merge across the boundary, a closing marker rewritten)."""
    return max(0, (prompt_len - successor_room - margin_tokens) // block_size * block_size)


def resume_cap_blocks(prompt_len: int, block_size: int, successor_room: int) -> int:
    """Most blocks a request may reuse: prefill must still run at least
    `successor_room` tokens to produce logits."""
    return max(0, (prompt_len - successor_room) // block_size)


class CheckpointTargets:
    """Pending checkpoint positions of one request, kept sorted."""

    __slots__ = ("positions", "kinds")

    def __init__(self) -> None:
        self.positions: list[int] = []
        self.kinds: dict[int, str] = {}

    def add(self, position: int, kind: CheckpointKind) -> None:
        if position <= 0 or position in self.kinds:
            return
        bisect.insort(self.positions, position)
        self.kinds[position] = kind

    def __len__(self) -> int:
        return len(self.positions)

    def earliest_in(self, lo: int, hi: int) -> Optional[int]:
        """Earliest pending target in (lo, hi]."""
        i = bisect.bisect_right(self.positions, lo)
        if i < len(self.positions) and self.positions[i] <= hi:
            return self.positions[i]
        return None

    def pop_through(self, hi: int) -> list[tuple[int, CheckpointKind]]:
        """Remove and return targets at or below hi, in order."""
        i = bisect.bisect_right(self.positions, hi)
        done = self.positions[:i]
        del self.positions[:i]
        return [(p, self.kinds.pop(p)) for p in done]


# Fallback rungs of long prompts sit on this grid, so consecutive turns of a
# conversation ask for the same positions instead of writing new ones.
FALLBACK_GRID_TOKENS = 4096

# A prompt resumed below this fraction of its length counts as cold for
# `PlacementConfig.cold_fractions`.
COLD_PROMPT_MAX_HIT_FRACTION = 0.5

# A cold checkpoint sits at least this many times its own cost (the KV its
# bytes would hold) into the prompt: a state can save at most its position,
# and only some of them are ever read (about one conversation in two
# rewrites into its first prompt in the shared traces).
COLD_MIN_SAVING = 4

def plan_checkpoints(prompt_len: int, block_size: int, *, hit: int, kv_reach: int,
                     reusable: int, kv_share_tokens: int, placement, successor_room: int,
                     interval: int, checkpoint_kv_tokens: int = 0) -> CheckpointTargets:
    """The checkpoints one admitted prompt should leave behind.

    All lengths are tokens, multiples of `block_size` except `prompt_len`:
    `hit` is where the request resumes (KV and state), `kv_reach` how far
    its KV prefix alone reached, `reusable` how far an unbounded cache would
    have reached (the excess over `kv_reach` is a KV tail cut), and
    `kv_share_tokens` one request slot's share of the KV pool, and
    `checkpoint_kv_tokens` how many tokens of KV one checkpoint's bytes
    would hold (0: unknown). The replay manager and the vLLM scheduler both
    place checkpoints with this rule.
    """
    p = placement
    B = block_size
    L = prompt_len
    t = CheckpointTargets()
    anchor = anchor_position(L, B, successor_room, p.anchor_margin_tokens) if p.anchor else 0
    if anchor > hit:
        t.add(anchor, CheckpointKind.ANCHOR)
        below = anchor - max(B, -(-p.insure_distance_tokens // B) * B)
        if p.insure_recompute_tokens and L - hit >= p.insure_recompute_tokens and below > hit:
            # A lost anchor costs this whole recompute again; the usual
            # loss is the client rewriting the last few blocks, so insure
            # a little lower.
            t.add(below, CheckpointKind.INSURANCE)
    if p.demand and kv_reach > hit:
        t.add(kv_reach, CheckpointKind.DEMAND)
    if hit < kv_reach < reusable:
        # The KV pool cut this conversation's tail. The next turn will
        # most likely find a similar cut, so keep states some way below.
        for f in p.cut_backoffs:
            pos = int(kv_reach // B * (1.0 - f)) * B
            if pos > hit:
                t.add(pos, CheckpointKind.CUT)
    if L > kv_share_tokens:
        # Longer than its share of the pool: its tail will be cut. Rungs
        # at fixed fractions of the share (snapped to a coarse grid so
        # later turns find them already kept) survive the usual cut. The
        # grid is at most a quarter of the share, so small pools (or large
        # blocks) still get rungs below the share.
        grid = max(B, min(FALLBACK_GRID_TOKENS, kv_share_tokens // 4) // B * B)
        for f in p.fallback_fractions:
            pos = int(kv_share_tokens * f) // grid * grid
            if hit < pos < (anchor or L - successor_room):
                t.add(pos, CheckpointKind.FALLBACK)
    if hit < L * COLD_PROMPT_MAX_HIT_FRACTION:
        # A conversation's start: until it grows, a cut needs a state lower
        # than its next turns' anchors, and a client that rewrites it later
        # (a compaction keeping the system prompt and tools, a retry) keeps
        # part of it. Positions start at COLD_MIN_SAVING checkpoints' worth.
        lowest = COLD_MIN_SAVING * checkpoint_kv_tokens
        _add_prompt_fractions(t, L, B, p.cold_fractions, max(hit, lowest - 1), L - successor_room,
                              CheckpointKind.COLD)
    # A conversation's states sit at its turns' prompt ends: a turn that
    # appends much (a large file read, a conversation's start) leaves a gap
    # as wide as what it appended, and a cut inside it under pressure costs
    # all of it. A state at each fraction the span covers gives the
    # release's retain fractions (`retain_fractions`) a state near each of its
    # fractions.
    _add_prompt_fractions(t, L, B, p.span_fractions, hit, anchor or L - successor_room,
                          CheckpointKind.SPAN)
    for pos in ladder_positions(hit, L - successor_room, interval):
        t.add(pos, CheckpointKind.LADDER)
    return t


def _add_prompt_fractions(t: CheckpointTargets, prompt_len: int, block_size: int,
                          fractions, lo: int, hi: int, kind: CheckpointKind) -> None:
    """A checkpoint of `kind` at each fraction of the prompt, floored to a
    block, that lies strictly between `lo` and `hi`."""
    for f in fractions:
        pos = int(prompt_len * f) // block_size * block_size
        if lo < pos < hi:
            t.add(pos, kind)


def chunk_end(computed: int, budget: int, total: int, targets: CheckpointTargets,
              interior_readable: bool) -> tuple[int, Optional[CheckpointKind]]:
    """Where this step's prefill chunk ends, and the kind of target it was
    cut for (None when not cut).

    A backend that cannot read interior states only sees the state at the
    end of a forward, so the chunk ends on the EARLIEST pending target in
    it: ending on a later one would skip the earlier target for good."""
    end = min(total, computed + budget)
    if interior_readable:
        return end, None
    t = targets.earliest_in(computed, end)
    if t is None or t == end:
        return end, None
    return t, targets.kinds[t]
