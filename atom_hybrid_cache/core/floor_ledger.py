"""Floor states: which states under its prefix each live request holds, and
the pool share all of them may take (`ATOM_STATE_CHECKPOINT_FLOOR`).

The vLLM adapter (`vllm/floor_states.py`) and the planner's model of the
plugin (`shared_pool_manager.py`) each find the states in their own pool and
take or give back the references; what a request asks for and whether it
may hold it is decided here. Pages are opaque handles.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from .stats import CacheStats

# With hundreds of requests in vLLM's window, floors could crowd out the
# prefixes they insure (no measured workload reaches the cap: 5.3% at most).
FLOOR_MAX_POOL_SHARE = 1 / 16


class FloorLedger:
    def __init__(self, fractions: Sequence[float], max_pages: int,
                 stats: Optional[CacheStats] = None,
                 on_first_refusal: Callable[[int], None] = lambda max_pages: None) -> None:
        """`max_pages`: what all floors together may hold (the pool's pages
        times FLOOR_MAX_POOL_SHARE, scaled by a request slot's share:
        `policy.CheckpointPolicy.floor_max_pages`; its owner resets it as
        the share moves); `stats`: where the requests that hold
        floors are counted (`floor_holds`); `on_first_refusal(max_pages)`:
        told once, when the share first refuses a request."""
        self.fractions = tuple(fractions)
        self.max_pages = max_pages
        self.stats = stats if stats is not None else CacheStats()
        self.on_first_refusal = on_first_refusal
        # request id -> [(position, pages of every state group)]; an empty
        # list: looked up, nothing found or no room (not looked up again
        # until the request is released)
        self.held: dict = {}
        self.held_pages = 0
        # requests that found floors but were refused them for the pool share
        self.refused = 0

    def tops(self, prompt_tokens: int) -> list[int]:
        """The positions whose highest state at or below a request holds."""
        return [int(prompt_tokens * f) for f in self.fractions]

    def take(self, request_id: str, found: list) -> list:
        """Record what the request holds of `found` ([(position, pages)], the
        states at or below its tops): all of it, or nothing where it would
        pass the share. The caller references what this returns."""
        pages = sum(len(p) for _, p in found)
        if found and self.held_pages + pages > self.max_pages:
            if not self.refused:
                self.on_first_refusal(self.max_pages)
            self.refused += 1
            found = []
        self.held_pages += pages if found else 0
        self.stats.floor_holds += bool(found)
        self.held[request_id] = found
        return found

    def release(self, request_id: str) -> list:
        """[(position, pages)] the request held, whose references the
        caller gives back (with the request's pages)."""
        found = self.held.pop(request_id, None) or []
        self.held_pages -= sum(len(p) for _, p in found)
        return found
