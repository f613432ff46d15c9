"""The prompt-end state of a live request is held until its release.

vLLM keeps that state (the anchor the next turn resumes on) in a page of
its own and gives it back to the LRU two steps later, while the request
still decodes; under pressure it was evicted before the request's release.
So a request whose prefill was scheduled to its end takes a reference on it,
given back in its units (`release.free_in_units`).
"""

from __future__ import annotations

from typing import Optional

from .state_search import StateSearch


class PromptEndAnchors:
    def __init__(self, pool, states: StateSearch, hash_unit: int) -> None:
        self.pool = pool
        self.states = states
        self.hash_unit = hash_unit
        # request id -> (prompt end, pages) of the state each live request holds
        self.held: dict = {}
        # requests whose last prefill chunk is being scheduled
        self.pending: set = set()

    def prompt_end(self, request) -> int:
        """Where vLLM keeps a prompt's end state: its last hash boundary
        before the prompt's last token."""
        unit = self.hash_unit
        return (request.num_prompt_tokens - 1) // unit * unit

    def states_at(self, request, pos: int) -> Optional[list]:
        """Every state group's page of the state after `pos` tokens of this
        request's prefix, or None."""
        return self.states.states_at(request.block_hashes, pos)

    def hold_pending(self, requests: dict) -> None:
        """After a step: each pending request whose prompt is now scheduled
        to its end takes its reference (`requests`: the scheduler's)."""
        for rid in list(self.pending):
            request = requests.get(rid)
            if request is not None and request.num_computed_tokens < request.num_prompt_tokens:
                continue   # not admitted this step: asked again when it is
            self.pending.discard(rid)
            if request is None or rid in self.held:
                continue
            # vLLM indexed it when it scheduled the chunk; a prompt under one
            # hash unit has none
            end = self.prompt_end(request)
            pages = self.states_at(request, end) if end else None
            if pages is not None:
                self.pool.touch(pages)
                self.held[rid] = (end, pages)

    def release(self, request_id: str):
        """(position, pages) the request held, or None; the caller gives the
        reference back with the request's pages."""
        self.pending.discard(request_id)
        return self.held.pop(request_id, None)
