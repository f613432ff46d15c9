"""`atom-hybrid-cache advise`: which settings to serve a workload with.

Every candidate of a small grid runs through the replay planner's `default`
policy (the plugin as it runs in vLLM: `core/shared_pool_manager.py`, driven
by `replay.simulator` through `replay.runner.run_spec`, the code `replay`
runs) on the whole trace set and on its two halves. A candidate is
recommended only where it beats the plugin's defaults on the whole set by
more than the gains on the halves stray from it (so it wins on both
halves too); otherwise the defaults are.

The grid (`GRID`): the prefix-hash unit (the plugin's 64 tokens or vLLM's
page), a state ladder, the cold checkpoints and the states a release
retains: each setting the shared-pool model runs; then, around the best of
those, the admission gate and the floor states, where the planner runs them
(`planner_runs`; else they stay at the server's defaults and the output
says they are not modelled). The admission order is not modelled.

Each candidate's variables are parsed back through `config.load_settings`
over the server's defaults, so what is printed is what a server would read.
"""

from __future__ import annotations

import multiprocessing as mp
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from ..config import (ENV_VARS, MAX_HASH_UNIT_TOKENS, SERVER_ADMISSION_GATE,
                      SERVER_COLD_FRACTIONS, SERVER_FLOOR_FRACTIONS, Settings, load_settings,
                      server_defaults)
from ..core.pool_budget import MIN_SLOT_CHECKPOINTS, pool_checkpoints
from ..core.shared_pool_manager import SharedPoolShape, shared_pool_policy
from .policies import build_policies
from .simulator import SimSettings

GIB = 1 << 30

# The hash unit the plugin picks where `--prefix-match-unit` is unset
# (vllm/registration.py plugin_hash_unit: the largest unit up to 64 that
# divides the page, and the planner's pages are multiples of 64).
PLUGIN_HASH_UNIT = MAX_HASH_UNIT_TOKENS
PAGE_UNIT = "page"

# A rung every this many tokens: the ladder the replay's `ladder-8192` runs.
LADDER_TOKENS = 8192

# Gains under a tenth of a point are not worth a change of settings.
MIN_GAIN = 0.001

# Hugging Face names of the geometry presets, for the printed serve line.
SERVED_MODEL = {
    "qwen3.5-27b": "Qwen/Qwen3.5-27B",
    "qwen3-next-80b": "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "kimi-linear-48b": "moonshotai/Kimi-Linear-48B-A3B-Instruct",
}


def env_var(section: str, name: str) -> str:
    """The ATOM_* variable of one settings field (config.ENV_VARS is the
    one place that names them)."""
    for var, (sec, field_name, _, _) in ENV_VARS.items():
        if (sec, field_name) == (section, name):
            return var
    raise KeyError(f"no variable for {section}.{name}")


# One axis: (label, section, field, values); the first value is the
# server's default, which a candidate leaves unset.
PLACEMENT_AXES = (
    ("interval", "placement", "interval_tokens", (-1, LADDER_TOKENS)),
    ("cold", "placement", "cold_fractions", (SERVER_COLD_FRACTIONS, ())),
    ("retain", "placement", "retain_fractions", ((0.5, 0.75, 0.875, 0.94), ())),
)
HASH_UNITS = (PLUGIN_HASH_UNIT, PAGE_UNIT)
# The second stage, around the first stage's choice, where the planner runs
# them (each doubles the grid, and where a slot's share is under 32
# checkpoints' worth the floors are off, so part of it would repeat).
SERVER_AXES = (
    ("gate", "server", "admission_gate", (SERVER_ADMISSION_GATE, "on", "off")),
    ("floor", "server", "floor_fractions", (SERVER_FLOOR_FRACTIONS, ())),
)

# Server settings no stage sweeps: (section, field).
NEVER_SWEPT = (("server", "admission_order"),)


def planner_runs(section_field: tuple) -> bool:
    """Whether the planner's `default` runs this server setting. The floors
    and the gate are being added to it (issue 31), so this asks the code
    rather than a list: floors where the shared-pool model acts on vLLM's
    admission window (`open_step`), the gate where the policies carry its
    mode. The admission order is not modelled."""
    import inspect

    from ..core.shared_pool_manager import SharedPoolManager
    name = section_field[1]
    if name == "floor_fractions":
        return hasattr(SharedPoolManager, "open_step")
    if name == "admission_gate":
        return "admission_gate" in inspect.signature(build_policies).parameters
    return False

GRID_HELP = (
    f"(1) hash unit {{{PLUGIN_HASH_UNIT} (the plugin's), the page (--prefix-match-unit PAGE)}} x "
    f"{env_var('placement', 'interval_tokens')} {{-1 (no ladder), {LADDER_TOKENS}}} x "
    f"{env_var('placement', 'cold_fractions')} {{0.5,0.875, none}} x "
    f"{env_var('placement', 'retain_fractions')} {{0.5,0.75,0.875,0.94, none}}: 16 candidates; "
    f"(2) on the best of (1): {env_var('server', 'admission_gate')} {{auto, on, off}} x "
    f"{env_var('server', 'floor_fractions')} {{0.25,0.5, none}}, where the planner models "
    "them (else left at default, and said so). The first value of each is the default. Not "
    "modelled, left at default: " + ", ".join(env_var(*f) for f in NEVER_SWEPT) + ".")


def format_value(value) -> str:
    """A setting's value as its variable takes it."""
    if isinstance(value, tuple):
        return ",".join(f"{x:g}" for x in value)
    return str(value)


@dataclass(frozen=True)
class Candidate:
    """One point of the grid: a hash unit and the ATOM_* variables that
    differ from the server's defaults."""

    hash_unit: object                 # PLUGIN_HASH_UNIT or PAGE_UNIT
    env: tuple = ()                   # ((variable, value), ...)

    @property
    def is_default(self) -> bool:
        return self.hash_unit == PLUGIN_HASH_UNIT and not self.env

    def settings(self) -> Settings:
        """The server's settings with this candidate's variables, parsed
        and validated as a server parses them."""
        return load_settings(None, server_defaults(), environ=dict(self.env))

    def label(self) -> str:
        return "defaults" if self.is_default else " ".join(
            ([f"unit={self.hash_unit}"] if self.hash_unit != PLUGIN_HASH_UNIT else [])
            + [f"{v}={shlex.quote(val)}" for v, val in self.env])


def _combinations(axes) -> list:
    """Every combination of the axes' values as ((variable, value), ...),
    a default value left unset; all defaults first."""
    combos = [()]
    for _, section, name, values in axes:
        var = env_var(section, name)
        combos = [c + (() if i == 0 else ((var, format_value(v)),))
                  for c in combos for i, v in enumerate(values)]
    return combos


def grid() -> list[Candidate]:
    """The first stage: every hash unit and placement combination, the
    defaults first."""
    return [Candidate(unit, env) for unit in HASH_UNITS
            for env in _combinations(PLACEMENT_AXES)]


def server_axes() -> tuple:
    """The second stage's axes: those the planner runs."""
    return tuple(ax for ax in SERVER_AXES if planner_runs((ax[1], ax[2])))


def around(base: Candidate) -> list[Candidate]:
    """The second stage: `base` with each combination of the server axes
    the planner runs (`base` itself left out)."""
    return [Candidate(base.hash_unit, base.env + extra)
            for extra in _combinations(server_axes())[1:]]


@dataclass
class Outcome:
    """A candidate's hit rate (cached over prompt tokens) on the whole set
    and on each half; the choice is made on these, which no ceiling scales."""

    candidate: Candidate
    full: float
    halves: tuple

    def over(self, ceilings: tuple) -> tuple:
        """(hit over the ceiling on the whole set, (min, max) over the halves)."""
        ratios = [h / c if c else float("nan")
                  for h, c in zip((self.full, *self.halves), ceilings)]
        return ratios[0], (min(ratios[1:]), max(ratios[1:]))


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
           prefill_chunk: int = 8192, candidates: Optional[Sequence[Candidate]] = None,
           second_stage: bool = True, jobs: int = 2, progress=None) -> Advice:
    """Run every candidate (default: `grid()`; the defaults must be among
    them) on the whole set and its halves, then, with `second_stage`, the
    server axes the planner runs `around` the first stage's choice; choose
    over all. `progress(runs)`, if given, returns the callback each
    finished run calls with 1 (once per stage)."""
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
    _WORKLOADS.clear()
    for s, convs in enumerate(subsets):
        for unit in set(units.values()):
            _WORKLOADS[(s, unit)] = Workload(convs, TokenExpander(), SimSettings(
                concurrency=concurrency, prefill_chunk=prefill_chunk, block_size=unit,
                max_model_len=geometry.max_model_len))
    gate_runs = planner_runs(("server", "admission_gate"))

    def spec(name: str, unit: int, settings: Settings):
        gate = {"admission_gate": settings.server.admission_gate} if gate_runs else {}
        return build_policies(
            [name], kv_bytes_per_token=geometry.kv_bytes_per_token,
            state_slot_bytes=geometry.state_slot_bytes, budget_bytes=budget, block_size=unit,
            max_num_seqs=concurrency, num_spec=0, headroom_slots=default_headroom(concurrency),
            base_placement=load_settings(environ={}).placement, align_layout=layout,
            server_placement=settings.placement,
            floor_fractions=settings.server.floor_fractions, **gate)[0]

    def effective(c: Candidate) -> tuple:
        """What the pool makes of a candidate's settings: candidates equal
        here (the cold checkpoints and floors off where a request slot's
        share is under 32 checkpoints' worth, `core/pool_budget.py`) run
        once."""
        unit = units[c.hash_unit]
        settings = c.settings()
        shape = SharedPoolShape(num_pages=layout.num_pages, page_tokens=page, hash_unit=unit,
                                pages_per_state=layout.pages_per_state_slot,
                                max_num_seqs=concurrency)
        policy = shared_pool_policy(shape, settings.placement, settings.server.floor_fractions)
        gate = None
        if gate_runs:
            from ..core.gate_steps import gate_on
            gate = gate_on(settings.server.admission_gate)
        return unit, policy.placement, policy.floor_fractions, gate

    hits: dict = {}     # effective settings (or "ceiling") -> hit rate per subset

    def run(cands: list, with_ceiling: bool) -> list:
        tasks, seen = [], set()
        if with_ceiling:
            ceiling = spec("kv-only-ceiling", PLUGIN_HASH_UNIT, Candidate(PLUGIN_HASH_UNIT).settings())
            tasks += [((s, PLUGIN_HASH_UNIT), ceiling, ("ceiling", s)) for s in range(3)]
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
    if second_stage and server_axes():
        outcomes += run(around(best.candidate), with_ceiling=False)
    best, gain, noise = choose(outcomes)
    return Advice(outcomes, next(o for o in outcomes if o.candidate.is_default), best, gain,
                  noise, page, layout.num_pages, pool_checkpoints(pool_tokens, checkpoint_tokens),
                  tuple(hits["ceiling"]), tuple(len(x) for x in subsets))


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def serve_line(candidate: Candidate, model: str, page_tokens: int) -> str:
    """The `vllm serve` command that runs `candidate`."""
    env = " ".join(f"{var}={shlex.quote(value)}" for var, value in candidate.env)
    unit = f" --prefix-match-unit {page_tokens}" if candidate.hash_unit == PAGE_UNIT else ""
    return (f"VLLM_PLUGINS=atom_hybrid_cache {env + ' ' if env else ''}vllm serve "
            f"{SERVED_MODEL.get(model, model)} --enable-prefix-caching{unit}")


def describe(o: Outcome, ceilings: tuple) -> str:
    ratio, band = o.over(ceilings)
    return (f"{o.full:.2%} of prompt tokens, {ratio:.4f} of the ceiling (band "
            f"{band[0]:.4f}-{band[1]:.4f} over the halves)")


def format_advice(a: Advice, *, model: str, memory_gib: float, concurrency: int) -> str:
    n, n1, n2 = a.conversations
    lines = [
        f"advise: {n} conversations (halves of {n1} and {n2}: even- and odd-numbered traces), "
        f"model {model}, {memory_gib:g} GiB, concurrency {concurrency}",
        f"pool: {a.num_pages:,} pages of {a.page_tokens} tokens, {a.pool_checkpoints} "
        f"checkpoints' worth; ceiling (attention-only, same bytes): {a.ceilings[0]:.2%} of "
        f"prompt tokens (halves {a.ceilings[1]:.2%}, {a.ceilings[2]:.2%})",
        "",
    ]
    swept = {v for o in a.outcomes for v, _ in o.candidate.env}
    axes = PLACEMENT_AXES + tuple(ax for ax in SERVER_AXES if env_var(ax[1], ax[2]) in swept)
    header = ["unit", *(ax[0] for ax in axes), "hit", "hit/ceil", "band (halves)",
              "vs defaults"]
    rows = []
    for o in a.outcomes:
        env = dict(o.candidate.env)
        cells = [str(a.page_tokens) if o.candidate.hash_unit == PAGE_UNIT
                 else f"{PLUGIN_HASH_UNIT} *"]
        for _, section, name, values in axes:
            raw = env.get(env_var(section, name))
            cells.append(("none" if raw == "" else raw) if raw is not None
                         else format_value(values[0]) + " *")
        gain = o.full - a.default.full
        mark = " <- recommended" if o is a.recommended and not o.candidate.is_default else ""
        ratio, band = o.over(a.ceilings)
        cells += [f"{o.full:.2%}", f"{ratio:.4f}", f"{band[0]:.4f}-{band[1]:.4f}",
                  ("(defaults)" if o.candidate.is_default else f"{gain:+.4f}") + mark]
        rows.append(cells)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append("(* the default; hit: cached / prompt tokens of the whole set; hit/ceil: over "
                 "the ceiling; band: hit/ceil's min-max over the halves; vs defaults: hit)")
    if any(o.over(a.ceilings)[0] > 1 for o in a.outcomes):
        lines.append("(hit/ceil above 1: the ceiling, an attention-only run in the planner's "
                     "separate-pools model, thrashes at this pool; read the hit column)")
    lines.append("")
    defaults = server_defaults().server

    def listed(fields) -> str:
        return ", ".join(f"{env_var(*f)} ({format_value(getattr(defaults, f[1])) or 'none'})"
                         for f in fields)
    unswept = [(ax[1], ax[2]) for ax in SERVER_AXES if env_var(ax[1], ax[2]) not in swept]
    modelled = [f for f in unswept if planner_runs(f)]
    missing = [f for f in unswept if not planner_runs(f)] + list(NEVER_SWEPT)
    if modelled:
        lines.append(f"not swept, run by the planner at default: {listed(modelled)}")
    switched = {"admission_gate", "floor_fractions"} & {f[1] for f in missing}
    where = ""
    if "admission_gate" in switched:
        where += "; the server gates at every pool size, so its figure may differ"
    if "floor_fractions" in switched:
        slot = a.pool_checkpoints // concurrency
        where += (f"; the server holds floors where a request slot's share is at least "
                  f"{MIN_SLOT_CHECKPOINTS} checkpoints' worth (here {slot}), "
                  + ("so its figure may differ" if slot >= MIN_SLOT_CHECKPOINTS
                     else "and keeps them off here, as the planner does"))
    lines.append(f"not modelled, left at default: {listed(missing)}{where}")
    d = a.default
    if a.recommended is d:
        lines.append(f"recommended: the defaults (no candidate beats them by at least "
                     f"{MIN_GAIN} and by more than its gains on the halves stray from it)")
    else:
        lines.append(f"recommended: {a.recommended.candidate.label()}")
        lines.append(f"  expect {describe(a.recommended, a.ceilings)}; {a.gain:+.4f} of "
                     f"prompt tokens over the defaults (noise {a.noise:.4f})")
    lines.append(f"  {serve_line(a.recommended.candidate, model, a.page_tokens)}")
    lines.append(f"defaults: {describe(d, a.ceilings)}")
    return "\n".join(lines)


def run_advise(args) -> int:
    """The `advise` subcommand (arguments validated by cli.py)."""
    import os

    from .geometry import geometry_from_args
    from .traces import default_sample_paths, load_traces

    t0 = time.perf_counter()
    geometry = geometry_from_args(args.model)
    paths = list(args.traces) or [p for p in default_sample_paths() if p.endswith(".json")]
    conversations = load_traces(paths)
    exported = sorted(v for v in os.environ if v in ENV_VARS)
    if exported:
        print(f"note: ignoring the exported {', '.join(exported)}: the advice starts from the "
              "plugin's defaults", file=sys.stderr)
    from .runner import _bar
    bars = []

    def progress(runs: int):
        bars.append(_bar(runs, "advise runs", not args.no_progress))
        return bars[-1].update
    try:
        advice = advise(conversations, geometry, memory_gib=args.memory_gib,
                        concurrency=args.concurrency, prefill_chunk=args.prefill_chunk,
                        jobs=args.jobs, progress=progress)
    finally:
        for bar in bars:
            bar.close()
    print(format_advice(advice, model=geometry.name, memory_gib=args.memory_gib,
                        concurrency=args.concurrency))
    print(f"elapsed: {time.perf_counter() - t0:.1f} s")
    return 0
