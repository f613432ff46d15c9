"""The plugin's work on vLLM's admission window before each step, in the
planner's model of the shared pool (`shared_pool_manager.py`): the floor
states the waiting requests take, hits first's order, then the admission
gate's pins and holds.

The same decisions as the vLLM adapter's (`vllm/floor_states.py`,
`vllm/admission_order.py`, `vllm/admission_gate.py`), from the same core
code (`floor_ledger`, `admission_order`, `gate_steps`); what this file adds
is the lookups in the model's pool:
- a window is the first `max_num_seqs - running` waiting requests (hits
  first's, as vLLM's adapter, the first `max_num_seqs` where a seat is free);
- a request's hit pages are vLLM's `find_longest_cache_hit` answer in group
  order (the state groups, then the attention group), its need
  `admission.pages_to_admit`, and the running requests' reserve
  `admission.pages_to_finish` over their block tables;
- the pins are references through the step, given back in the gate's order
  after it (so they join the LRU's tail), the held requests wait in front.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..config import ADMISSION_GATE_MAX_HOLD_STEPS
from .admission import PageGroup, pages_to_admit, pages_to_finish
from .admission_order import hits_first
from .floor_ledger import FloorLedger
from .gate_steps import GateDecision, GateLookup, GateSteps


class SharedPoolWindow:
    def __init__(self, manager, *, gate: bool, floor_fractions: tuple, hits_first: bool = False,
                 max_hold_steps: int = ADMISSION_GATE_MAX_HOLD_STEPS) -> None:
        """`manager`: the SharedPoolManager whose pool and requests these
        act on; `gate`: whether the admission gate runs; `floor_fractions`:
        the floors (empty: none); `hits_first`: the admission order."""
        self.manager = manager
        # {request id: times hits first moved it back} (None: arrival order)
        self.passed_over: Optional[dict] = {} if hits_first else None
        stats = manager.planner.stats
        self.gate = GateSteps(stats) if gate else None
        self.floors = (FloorLedger(floor_fractions,
                                   manager.policy.floor_max_pages(manager.shape.num_pages),
                                   stats)
                       if floor_fractions else None)
        self.max_hold_steps = max_hold_steps
        P = manager.page
        self.groups = ([PageGroup(True, P, manager.shape.speculative_state_pages)] * manager.pps
                       + [PageGroup(False, P)])
        self._decision: Optional[GateDecision] = None

    def open(self, waiting: list, running: Sequence) -> list:
        """Before a step: the floors of the window's requests not holding
        any yet, hits first (`waiting` reordered in place), then the gate.
        The waiting requests (in queue order) the gate holds out of this
        step."""
        limit = self.manager.shape.max_num_seqs - len(running)
        window = waiting[:max(0, limit)]
        if self.floors is not None and self.manager.policy.floor_fractions:
            for req in window:
                if req.request_id not in self.floors.held:
                    self._hold_floors(req)
        if self.passed_over is not None and self._order(waiting, len(running)):
            window = waiting[:max(0, limit)]
        if self.gate is None:
            return []
        # (the gate forgets its remembered lookups at every step it is asked)
        remembered = self.gate.begin()
        if remembered is None or not window:
            return []
        candidates = [self._look_up(req, remembered.get(req.request_id))
                      for req in window if not req.num_computed]
        if not candidates:
            return []
        decision = self.gate.decide(candidates, self.manager.pool.num_free,
                                    self._running_reserve(running),
                                    self._token_budget(running), bool(running),
                                    self.max_hold_steps)
        self.manager.pool.touch(decision.pinned)
        self._decision = decision
        held_ids = {candidates[i].request_id for i in decision.held}
        return [req for req in window if req.request_id in held_ids]

    def close(self, scheduled_tokens: int) -> None:
        """After the step: the pins given back, in the gate's order."""
        decision, self._decision = self._decision, None
        if decision is None:
            return
        self.manager.pool.free(decision.pinned)
        self.gate.end(decision, scheduled_tokens)

    def forget_passed_over(self, request_id) -> None:
        """A request admitted or freed: hits first counts it afresh."""
        if self.passed_over is not None:
            self.passed_over.pop(request_id, None)

    def gated(self) -> bool:
        """Whether this step's gate pinned or held anything."""
        d = self._decision
        return d is not None and bool(d.pinned or d.held)

    def leave(self, request_id) -> list:
        """A request leaves for good (released, given up): hits first
        forgets it; the floors it held, to free."""
        self.forget_passed_over(request_id)
        return self.floors.release(request_id) if self.floors is not None else []

    def _order(self, waiting: list, running: int) -> bool:
        """Hits first over the first `max_num_seqs` waiting requests where a
        seat is free (as `vllm/admission_order.py`); whether it moved any."""
        limit = self.manager.shape.max_num_seqs
        if len(waiting) < 2 or running >= limit:
            return False
        window = waiting[:limit]
        order = hits_first([r.request_id for r in window],
                           [not r.num_computed for r in window],
                           lambda i: self.manager.lookup(window[i])[0], self.passed_over, limit)
        if order is None:
            return False
        waiting[:limit] = [window[i] for i in order]
        return True

    # -- lookups in the model's pool --------------------------------------
    def _hold_floors(self, req) -> None:
        m = self.manager
        found = m.index.highest_states_at_or_below(req.block_hashes,
                                                   self.floors.tops(req.prompt_len),
                                                   max_pages=-(-req.prompt_len // m.page))
        for _, pages in self.floors.take(req.request_id, found):
            m.pool.touch(pages)

    def _look_up(self, req, remembered: Optional[tuple]) -> GateLookup:
        m = self.manager
        if remembered is None:
            hit, kv_pages, state_pages = m.lookup(req)
            remembered = (tuple([p] for p in state_pages or ()) + (tuple(kv_pages),)
                          if hit else (), hit)
        hit_pages, hit = remembered
        ref = m.pool.ref_cnt
        evictable = [p for group in hit_pages for p in group if ref[p] == 0]
        return GateLookup(req.request_id, hit_pages, hit,
                          pages_to_admit(self.groups, req.num_tokens, hit),
                          req.num_tokens - hit, evictable)

    def _running_reserve(self, running: Sequence) -> int:
        held = self.manager.held_kv_pages
        kv = len(self.groups) - 1
        return sum(pages_to_finish(self.groups, r.prompt_len, r.num_computed,
                                   lambda g, r=r: held(r.request_id) if g == kv else 0)
                   for r in running)

    def _token_budget(self, running: Sequence) -> int:
        return self.manager.shape.step_tokens - sum(max(0, r.prompt_len - r.num_computed)
                                                    for r in running)
