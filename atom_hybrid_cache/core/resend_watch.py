"""Whether the traffic resends earlier prompts: the admission parts idle
where it does not.

The admission gate, the floor states and priced eviction keep the states a
resume lands on: an agentic client resends its previous prompt whole and
continues it, so a resume starts at an earlier prompt's end, where the
plugin left a state. Traffic that shares prefixes without resending (a
system prompt or a document under many one-off questions, as in the
Mooncake trace) resumes inside earlier prompts; there the three bought at
most 0.04 point of hit and cost 0.1-0.35 of native's p99 step
(BENCHMARKS.md, "The Mooncake trace").

The watch counts, over the last WINDOW prompts that share a first hash
unit with an earlier prompt, those that hold an earlier prompt's last whole
unit (so the whole earlier prompt, rounded down to the unit: a resend).
Measured at 64-token units over every ordering tried of the shared traces:
the Claude Code traces never fewer than 55 of 64, the Mooncake trace never
more than 23. The parts idle under IDLE_BELOW of the window and run again
from RUN_FROM; they run until the window is full.

Both the vLLM adapter and the planner's model feed it from
`CheckpointPlanner.plan`, a request's first plan, so the planner predicts
the switch.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

WINDOW = 64
IDLE_BELOW = 16       # resends in the window under which the parts idle
RUN_FROM = 32         # ... and from which they run again
# first and last hashes remembered (the oldest forgotten first)
REMEMBERED_PROMPTS = 1 << 16


class ResendWatch:
    def __init__(self, window: int = WINDOW, idle_below: int = IDLE_BELOW,
                 run_from: int = RUN_FROM, remembered: int = REMEMBERED_PROMPTS) -> None:
        if not 0 < idle_below <= run_from <= window:
            raise ValueError("the watch needs 0 < idle_below <= run_from <= window, got "
                             f"{idle_below}, {run_from}, {window}")
        self.window, self.idle_below, self.run_from = window, idle_below, run_from
        self.remembered = remembered
        # (dicts as insertion-ordered sets: the oldest is forgotten first)
        self._firsts: dict = {}
        self._ends: dict = {}
        self._recent: deque = deque(maxlen=window)
        self.resends = 0          # in the window
        self.idle = False

    def observe(self, block_hashes: Sequence, units: int) -> bool:
        """A prompt of `units` whole hash units (`block_hashes` holds at
        least those) is planned for the first time: whether the parts just
        went idle or came back."""
        if units <= 0:
            return False
        hashes = block_hashes[:units]
        first, end = hashes[0], hashes[-1]
        shares = first in self._firsts
        if shares:
            resend = not self._ends.keys().isdisjoint(hashes)
            recent = self._recent
            if len(recent) == self.window:
                self.resends -= recent[0]
            recent.append(resend)
            self.resends += resend
        self._remember(self._firsts, first)
        self._remember(self._ends, end)
        if not shares or len(self._recent) < self.window:
            return False
        idle = self.resends < self.idle_below if not self.idle else self.resends < self.run_from
        if idle == self.idle:
            return False
        self.idle = idle
        return True

    def _remember(self, seen: dict, key) -> None:
        if key in seen:
            return
        if len(seen) >= self.remembered:
            del seen[next(iter(seen))]
        seen[key] = None

    def describe(self) -> str:
        """The log's account of the window now."""
        return (f"{self.resends} of the last {len(self._recent)} prompts that share a "
                f"prefix with an earlier one resend an earlier prompt whole")
