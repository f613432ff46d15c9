"""`atom-hybrid-cache advise`: which settings to serve a workload with.

Every candidate of a small grid (`advise_grid.py`) runs through the replay
planner's `default` policy (the plugin as it runs in vLLM:
`core/shared_pool_manager.py`, driven by `replay.simulator` through
`replay.runner.run_spec`, the code `replay` runs) on the whole trace set
and on its two halves. A candidate is recommended only where it beats the
plugin's defaults on the whole set by more than the gains on the halves
stray from it (so it wins on both halves too); otherwise the defaults are.
vLLM's own caching without the plugin (`vllm-align`, on its page and with
`--prefix-match-unit` at the plugin's unit) runs beside them, and where it
beats the recommendation by the same rule, vLLM alone is recommended.
Server settings the planner does not run stay at their defaults, and the
output (`advise_output.py`) says so.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
from dataclasses import dataclass
from typing import Optional, Sequence

from ..config import Settings, load_settings
from ..core.gate_steps import gate_on
from ..core.pool_budget import pool_checkpoints
from ..core.shared_pool_shape import SharedPoolShape, shared_pool_policy
from .advise_grid import (LIGHTER_ENV, ORDER_AXES, PAGE_UNIT, PLUGIN_HASH_UNIT, Candidate, around,
                          grid)
from .client_clock import ClientClock
from .policies import build_policies
from .simulator import SimSettings

GIB = 1 << 30

# Gains under a tenth of a point are not worth a change of settings.
MIN_GAIN = 0.001


class HitRates:
    """A run's hit rate (cached over prompt tokens) on the whole set
    (`full`) and on each half (`halves`); choices are made on these, which
    no ceiling scales."""

    full: float
    halves: tuple

    def over(self, ceilings: tuple) -> tuple:
        """(hit over the ceiling on the whole set, (min, max) over the halves)."""
        ratios = [h / c if c else float("nan")
                  for h, c in zip((self.full, *self.halves), ceilings)]
        return ratios[0], (min(ratios[1:]), max(ratios[1:]))


@dataclass
class Outcome(HitRates):
    """A candidate's hit rates."""

    candidate: Candidate
    full: float
    halves: tuple


@dataclass
class NativeOutcome(HitRates):
    """vLLM's own caching without the plugin (the planner's `vllm-align`),
    hashing on `unit` tokens (`--prefix-match-unit`; the page is vLLM's
    default)."""

    unit: int
    full: float
    halves: tuple


@dataclass
class Advice:
    outcomes: list                     # Outcome per candidate, grid order
    default: Outcome
    recommended: Outcome               # `default` where nothing beats it
    gain: float                        # recommended.full - default.full
    noise: float                       # half the halves' disagreement on the gain
    page_tokens: int
    num_pages: int
    pool_checkpoints: int
    ceilings: tuple                    # the ceiling's hit rate: whole set, halves
    conversations: tuple               # conversations: whole set, halves
    client: str = ""                   # the client clock (`ClientClock.describe`)
    # vLLM without the plugin: on the page, and on the plugin's unit
    native: tuple = ()
    # the better of `native` where it beats `recommended` (`native_wins`)
    native_better: Optional[NativeOutcome] = None
    # `recommended` without the gate, floors and prices, where it does as
    # well (`lighter_of`)
    lighter: Optional[Outcome] = None


def split_halves(conversations: list) -> tuple[list, list]:
    """The conversations of the even- and odd-numbered traces (a trace
    keeps its sub-agents, which share its prefixes)."""
    order: dict = {}
    for c in conversations:
        order.setdefault(c.source, len(order))
    return ([c for c in conversations if order[c.source] % 2 == 0],
            [c for c in conversations if order[c.source] % 2 == 1])


def paired_gain(c: Outcome, d: Outcome) -> tuple[float, float]:
    """(gain of `c` over `d` on the whole set, the noise on it: how far the
    gains on the two halves stray from it). A gain the halves do not both
    show (the whole set's interleaving alone) is noise."""
    gain = c.full - d.full
    return gain, max(abs((a - b) - gain) for a, b in zip(c.halves, d.halves))


def choose(outcomes: list) -> tuple[Outcome, float, float]:
    """(the recommendation, its gain, its noise): the best on the whole set
    of the candidates whose gain over the defaults is at least MIN_GAIN and
    more than its noise (so it also wins on both halves); the
    defaults where none does. Ties go to fewer changed settings."""
    default = next(o for o in outcomes if o.candidate.is_default)
    best, best_key = default, None
    for o in outcomes:
        if o is default:
            continue
        gain, noise = paired_gain(o, default)
        if gain < MIN_GAIN or gain <= noise:
            continue
        changes = len(o.candidate.env) + (o.candidate.hash_unit != PLUGIN_HASH_UNIT)
        key = (round(o.full, 9), -changes)
        if best_key is None or key > best_key:
            best, best_key = o, key
    gain, noise = paired_gain(best, default)
    return best, gain, noise


def best_native(native: Sequence[NativeOutcome]) -> Optional[NativeOutcome]:
    """The better of vLLM's own runs (a tie: the larger unit, its
    default the page), None without any."""
    return max(native, key=lambda n: (round(n.full, 9), n.unit), default=None)


def native_wins(native: Sequence[NativeOutcome], recommended: Outcome) -> Optional[NativeOutcome]:
    """The better of vLLM's own runs where it beats the plugin's
    recommendation by the rule a candidate beats the defaults by (at least
    MIN_GAIN, more than the halves stray from it: it wins on both), else
    None. A workload that the plugin serves worse than vLLM alone is told
    so rather than given the plugin's least bad settings."""
    best = best_native(native)
    if best is None:
        return None
    gain, noise = paired_gain(best, recommended)
    return best if gain >= MIN_GAIN and gain > noise else None


def lighter_of(recommended: Outcome, outcomes: Sequence[Outcome]) -> Optional[Outcome]:
    """`recommended` with the admission gate, the floor states and priced
    eviction off (`advise_grid.LIGHTER_ENV`), where the planner ran it and
    it loses under MIN_GAIN to the recommendation on the whole set and on
    each half: the same hit, and a scheduler step without their work
    (where they buy no hit they still cost step time: BENCHMARKS.md, "What
    each admission part costs"). Not the rule a candidate beats the
    defaults by: where the halves disagree, a loss inside their noise may
    still be a large one. None where the recommendation has them off
    already or that candidate was not run."""
    base = dict(recommended.candidate.env)
    want = {**base, **dict(LIGHTER_ENV)}
    if want == base:
        return None
    unit = recommended.candidate.hash_unit
    light = next((o for o in outcomes
                  if o.candidate.hash_unit == unit and dict(o.candidate.env) == want), None)
    if light is None:
        return None
    pairs = [(light.full, recommended.full), *zip(light.halves, recommended.halves)]
    return light if all(lit > rec - MIN_GAIN for lit, rec in pairs) else None


# --------------------------------------------------------------------------
# Running: the replay's own runner over every (candidate, subset)
# --------------------------------------------------------------------------

_WORKLOADS: dict = {}   # (subset, hash unit) -> runner.Workload; shared with forked workers


def _run_task(task) -> tuple:
    from .runner import run_spec
    key, spec, slot = task
    _, totals, _ = run_spec(spec, _WORKLOADS[key])
    return slot, totals.cached_tokens / totals.prompt_tokens if totals.prompt_tokens else 0.0


def _map(tasks: list, jobs: int, progress) -> dict:
    out = {}
    if jobs > 1 and len(tasks) > 1 and "fork" in mp.get_all_start_methods():
        with mp.get_context("fork").Pool(min(jobs, len(tasks))) as pool:
            for slot, hit in pool.imap_unordered(_run_task, tasks):
                out[slot] = hit
                progress(1)
        return out
    for task in tasks:
        slot, hit = _run_task(task)
        out[slot] = hit
        progress(1)
    return out


def advise(conversations: list, geometry, *, memory_gib: float, concurrency: int,
           prefill_chunk: int = 8192, time_scale: float = 0.0,
           candidates: Optional[Sequence[Candidate]] = None,
           second_stage: bool = True, jobs: int = 2, progress=None) -> Advice:
    """Run every candidate (default: `grid()`; the defaults must be among
    them) on the whole set and its halves, then, with `second_stage`, the
    server axes `around` the first stage's choice, and the admission order
    around the best of those; choose over all. `time_scale`: the replay's
    client clock (0: saturated).
    `progress(runs)`, if given, returns the callback each finished run
    calls with 1 (once per stage)."""
    from .memory_split import shared_pool_layout
    from .runner import Workload, default_headroom
    from .token_expander import TokenExpander

    candidates = list(grid() if candidates is None else candidates)
    if not any(c.is_default for c in candidates):
        raise ValueError("the candidates must include the defaults")
    subsets = (conversations, *split_halves(conversations))
    if not all(subsets[1:]):
        traces = len({c.source for c in conversations})
        raise ValueError(f"TRACE: {traces} trace(s) cannot be split into two halves; "
                         "give at least 2")
    budget = int(memory_gib * GIB)
    layout = shared_pool_layout(geometry, budget, page_tokens_multiple=PLUGIN_HASH_UNIT)
    page = layout.block_size_tokens
    pool_tokens = (layout.num_pages - 1) * page
    checkpoint_tokens = layout.pages_per_state_slot * page
    units = {PLUGIN_HASH_UNIT: PLUGIN_HASH_UNIT, PAGE_UNIT: page}
    native_units = sorted(set(units.values()), reverse=True)
    # the replay's client clock (`--time-scale`; 0: saturated)
    clock = ClientClock(time_scale=time_scale)
    _WORKLOADS.clear()
    for s, convs in enumerate(subsets):
        for unit in set(units.values()):
            _WORKLOADS[(s, unit)] = Workload(convs, TokenExpander(), SimSettings(
                concurrency=concurrency, prefill_chunk=prefill_chunk, block_size=unit,
                max_model_len=geometry.max_model_len, clock=clock))

    def spec(name: str, unit: int, settings: Settings):
        return build_policies(
            [name], kv_bytes_per_token=geometry.kv_bytes_per_token,
            state_slot_bytes=geometry.state_slot_bytes, budget_bytes=budget, block_size=unit,
            max_num_seqs=concurrency, num_spec=0, headroom_slots=default_headroom(concurrency),
            base_placement=load_settings(environ={}).placement, align_layout=layout,
            server_placement=settings.placement,
            floor_fractions=settings.server.floor_fractions,
            admission_gate=settings.server.admission_gate,
            admission_order=settings.server.admission_order)[0]

    def effective(c: Candidate) -> tuple:
        """What the pool makes of a candidate's settings: candidates equal
        here (the cold checkpoints and floors off where a request slot's
        share is under 32 checkpoints' worth, the floors also where their
        pool share holds no whole checkpoint, `core/pool_budget.py`) run
        once."""
        unit = units[c.hash_unit]
        settings = c.settings()
        shape = SharedPoolShape(num_pages=layout.num_pages, page_tokens=page, hash_unit=unit,
                                pages_per_state=layout.pages_per_state_slot,
                                max_num_seqs=concurrency)
        policy = shared_pool_policy(shape, settings.placement, settings.server.floor_fractions,
                                    in_flight=concurrency)
        return (unit, policy.placement, policy.floor_fractions,
                gate_on(settings.server.admission_gate), settings.server.admission_order)

    hits: dict = {}     # effective settings (or "ceiling") -> hit rate per subset

    def run(cands: list, with_ceiling: bool) -> list:
        tasks, seen = [], set()
        if with_ceiling:
            ceiling = spec("kv-only-ceiling", PLUGIN_HASH_UNIT, Candidate(PLUGIN_HASH_UNIT).settings())
            tasks += [((s, PLUGIN_HASH_UNIT), ceiling, ("ceiling", s)) for s in range(3)]
            # vLLM without the plugin, on the page and on the plugin's unit
            for unit in native_units:
                native = spec("vllm-align", unit, Candidate(PLUGIN_HASH_UNIT).settings())
                native = dataclasses.replace(native, hash_unit=unit)
                tasks += [((s, unit), native, (("native", unit), s)) for s in range(3)]
        keys = [effective(c) for c in cands]
        for c, key in zip(cands, keys):
            if key in hits or key in seen:
                continue
            seen.add(key)
            one = spec("default", key[0], c.settings())
            tasks += [((s, key[0]), one, (key, s)) for s in range(3)]
        # the whole set's runs are the longest: first, so the workers end together
        tasks.sort(key=lambda t: t[2][1] != 0)
        done = _map(tasks, jobs, progress(len(tasks)) if progress and tasks else (lambda n: None))
        for (key, s), hit in done.items():
            hits.setdefault(key, [None] * 3)[s] = hit
        return [Outcome(c, hits[k][0], (hits[k][1], hits[k][2])) for c, k in zip(cands, keys)]

    outcomes = run(candidates, with_ceiling=True)
    best, _, _ = choose(outcomes)
    if second_stage:
        outcomes += run(around(best.candidate), with_ceiling=False)
        best, _, _ = choose(outcomes)
        outcomes += run(around(best.candidate, ORDER_AXES), with_ceiling=False)
    best, gain, noise = choose(outcomes)
    native = tuple(NativeOutcome(u, hits[("native", u)][0], tuple(hits[("native", u)][1:]))
                   for u in native_units)
    return Advice(outcomes, next(o for o in outcomes if o.candidate.is_default), best, gain,
                  noise, page, layout.num_pages, pool_checkpoints(pool_tokens, checkpoint_tokens),
                  tuple(hits["ceiling"]), tuple(len(x) for x in subsets), clock.describe(),
                  native, native_wins(native, best), lighter_of(best, outcomes))
