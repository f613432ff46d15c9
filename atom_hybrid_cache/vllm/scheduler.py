"""vLLM's scheduler with the plugin's hooks: a map of where each part acts.

vLLM builds it where the plugin is enabled and `--scheduler-cls` is unset
(`registration.default_scheduler_class`); naming it in `--scheduler-cls`
also selects it without the plugin (the admission gate for an
attention-only model). It overrides five methods and nothing else:
- `__init__`: set-up (`scheduler_setup.build_parts`);
- `schedule`: admission. Before vLLM's step, the share the requests in
  flight leave each (`admission.size_share`), floor states
  (`floor_states`), hits-first (`admission_order`) and the admission gate
  (`admission_gate`); after it, the step's accounting
  (`admission.after_schedule`), and in a step without prefill the
  oracle's queued learning and a slice of the released requests' token
  lists freed;
- `_mamba_block_aligned_split`: chunk stops (`admission.chunk_tokens`);
- `_free_request_blocks`: release in units (`release`), and the request's
  token lists kept to be freed a slice a step (`finished_token_lists`);
- `reset_prefix_cache`: the plugin's references go first.
Without our state groups it is vLLM's scheduler (plus the gate, if asked).
The lookups the gate and hits-first make answer vLLM's lookups of the same
step, and theirs of the steps after, while they stand (`step_lookups`);
the attention half of every lookup
is the plugin's walk (`attention_lookup`), vLLM's answer; a running
request's settled attention tail is not filed again each step
(`attention_tail`), and vLLM's page-size view of a request's hashes slices
in C (`block_hash_view`).
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from . import (admission, attention_lookup, attention_tail, block_hash_view,
               cached_tokens_estimate, release)
from .admission_order import order_waiting
from .scheduler_setup import SchedulerParts, build_parts
from .step_lookups import StepLookups


class AtomSchedulerMixin:
    # the parts (`build_parts`); all off until the constructor has built them
    atom: SchedulerParts = SchedulerParts()
    # what the store connector checks the scheduler class for
    atom_scheduler = True
    # the gate's and hits-first's lookups, kept for vLLM's (None: neither runs)
    atom_lookups: StepLookups | None = None

    def _atom_setup(self) -> None:
        self.atom = build_parts(self)
        attention_lookup.install(self.kv_cache_manager.coordinator)
        attention_tail.install(self.kv_cache_manager.coordinator,
                               getattr(self.kv_cache_manager.block_pool, "hash_block_size", 0))
        block_hash_view.install()
        cached_tokens_estimate.install(self.kv_cache_manager)
        if self.atom.gate is not None or self.atom.hits_first:
            kvm = self.kv_cache_manager
            self.atom_lookups = StepLookups(kvm.coordinator, kvm.block_pool)

    def _mamba_block_aligned_split(self, request, num_new_tokens: int,
                                   num_new_local_computed_tokens: int = 0,
                                   num_external_computed_tokens: int = 0) -> int:
        n = super()._mamba_block_aligned_split(request, num_new_tokens,
                                               num_new_local_computed_tokens,
                                               num_external_computed_tokens)
        start = (request.num_computed_tokens + num_new_local_computed_tokens
                 + num_external_computed_tokens)
        page = self.atom.verify_window_page_tokens
        if page and n > 0 and start >= max(request.num_prompt_tokens, request.num_tokens - 1):
            # a ReplaySSM verify window (sampled token + drafts) stops at the
            # end of the page it starts in; drafts past it wait a step
            n = min(n, (start // page + 1) * page - start)
        # decode steps (most calls) have nothing planned
        if self.atom.planner is None or n <= 0 or start >= request.num_prompt_tokens:
            return n
        return admission.chunk_tokens(self, self.atom, request, n, start,
                                      num_new_local_computed_tokens)

    def schedule(self, *args, **kwargs):
        parts = self.atom
        gate = parts.gate
        hits = {} if gate is not None else None
        lookups = self.atom_lookups
        if lookups is not None:
            lookups.begin_step()
        if parts.planner is not None:
            admission.size_share(self, parts)
        if parts.floors is not None and parts.planner.policy.floor_fractions:
            # before the gate counts the free pages: a floor is not free
            parts.floors.hold_window(self)
        if parts.hits_first:
            order_waiting(self, parts.passed_over, hits)
        if parts.store is not None:
            parts.store.open_step()
        gated = gate.open(self, hits) if gate is not None else None
        out = None
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            if lookups is not None:
                lookups.end_step()
            if gated is not None:
                gate.close(self, gated, out)
        # a step with a prefill chunk is the slowest kind: what can wait
        # (the oracle's learning, freeing released lists) waits for one without
        quiet = not parts.step_prefills
        if parts.planner is not None:
            admission.after_schedule(self, parts, out)
            parts.planner.catch_up(quiet)
        if parts.finished_lists is not None:
            parts.finished_lists.free_slice(quiet)
        return out

    def reset_prefix_cache(self, *args, **kwargs) -> bool:
        """vLLM's reset needs every page free; the floors of waiting requests
        are references no preemption gives back, so they go first (those
        of running requests go with their preemption, or keep the reset
        failing as the requests themselves do)."""
        parts = self.atom
        if parts.floors is not None:
            parts.floors.release_all_but({r.request_id for r in self.running})
        if parts.gate is not None:
            parts.gate.forget_lookups()
        return super().reset_prefix_cache(*args, **kwargs)

    def _free_request_blocks(self, request) -> None:
        parts = self.atom
        if parts.planner is None:
            return super()._free_request_blocks(request)
        parts.passed_over.pop(request.request_id, None)
        if parts.finished_lists is not None:
            parts.finished_lists.keep(request)
        if parts.units_on_release:
            return release.free_in_units(self, parts, request)
        release.give_back_held(self, parts, request)
        return super()._free_request_blocks(request)


class AtomScheduler(AtomSchedulerMixin, Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._atom_setup()


class AtomAsyncScheduler(AtomSchedulerMixin, AsyncScheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._atom_setup()
