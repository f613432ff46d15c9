"""The admission gate's arithmetic: which waiting prefills fit beside the
prefixes of the others (the vLLM adapter's `AdmissionGate` looks the
requests up and pins the pages; what goes and what waits is decided here).

Pages are counted per KV cache group: an attention group needs a page per
block of tokens beyond what the request holds, a state group a fixed number
of pages per prefill (and, with speculative decoding's 1 + k states, the k
scratch pages an admitted request takes with its first chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

# Pages of each state group an admitted prefill takes: the state it writes
# and the prompt-end copy vLLM keeps. A running prefill already has the
# first and still takes the second.
STATE_PAGES_PER_ADMISSION = 2
STATE_PAGES_TO_FINISH = 1


@dataclass(frozen=True)
class PageGroup:
    """One KV cache group: `state` for a group of recurrent-state pages,
    else attention pages of `block_size` tokens."""

    state: bool
    block_size: int
    # a state group's scratch pages for speculative decoding (vLLM's
    # `num_speculative_blocks` in align mode), taken at admission
    speculative_pages: int = 0


def prefill_pages(groups: Sequence[PageGroup], tokens: int, held: Callable[[int], int],
                  state_pages: int, admitting: bool = False) -> int:
    """Pages a prefill to `tokens` still takes: in each attention group those
    beyond the `held(group index)` it has, in each state group
    `state_pages` (and its scratch pages where `admitting`)."""
    return sum(state_pages + admitting * g.speculative_pages if g.state
               else max(0, -(-tokens // g.block_size) - held(i))
               for i, g in enumerate(groups))


def pages_to_finish(groups: Sequence[PageGroup], prompt_len: int, computed: int,
                    held: Callable[[int], int]) -> int:
    """Pages a running request still takes to finish its prefill: none once
    it decodes (it has its prompt's pages; counting a state page for it
    kept a request waiting beside free room while decodes grew into its
    prefix)."""
    if computed >= prompt_len:
        return 0
    return prefill_pages(groups, prompt_len, held, STATE_PAGES_TO_FINISH)


def pages_to_admit(groups: Sequence[PageGroup], tokens: int, hit: int) -> int:
    """Pages the whole prefill of a `tokens`-long request takes beyond its
    `hit` tokens."""
    return prefill_pages(groups, tokens, lambda i: hit // groups[i].block_size,
                         STATE_PAGES_PER_ADMISSION, admitting=True)


@dataclass
class GateCandidate:
    """A waiting request the gate may hold: `need` pages to admit it,
    `tokens` it computes, `overdue` when held too long to be held again."""

    need: int
    tokens: int
    overdue: bool = False


def decide(candidates: Sequence[GateCandidate], room: int, token_budget: int,
           anything_running: bool) -> tuple[list[int], bool, int]:
    """(indices of the candidates held this step, whether a lone one goes
    and evicts what it must, the room left).

    In queue order, a candidate that fits the `room` (evictable pages
    outside the protected prefixes, less the running requests' reserve)
    goes and takes its pages from it; one that does not is held, unless it
    is overdue: it goes all the same, and a room left below zero is what
    the held candidates' prefixes must give up for it. Those past the
    step's `token_budget` are not reached by vLLM this step. With nothing
    running and nothing fitting, the one needing the fewest pages (the
    first overdue one, if any) goes alone, so the queue always moves."""
    if not anything_running and all(c.need > room for c in candidates):
        late = [i for i, c in enumerate(candidates) if c.overdue]
        first = late[0] if late else min(range(len(candidates)),
                                         key=lambda i: candidates[i].need)
        return [i for i in range(len(candidates)) if i != first], True, room
    held = []
    for i, c in enumerate(candidates):
        if token_budget <= 0:
            break   # vLLM does not reach it this step
        if c.need > room and not c.overdue:
            held.append(i)
            continue
        room -= c.need
        token_budget -= c.tokens
    return held, False, room
