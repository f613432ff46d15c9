#!/usr/bin/env python3
"""Where the slowest scheduler steps spend their time, part by part.

`scheduler_bench.py --profile-slowest` runs the steps under cProfile, which
inflates every Python call (vLLM's per-block calls most) and so picks other
steps as the slowest. Here each part of a step gets a thread-CPU timer
instead (a few hundred nanoseconds a call), the policies run interleaved
step by step as in `scheduler_bench.py --interleave`, and for each policy
the steps whose total lies between two percentiles (default p98.5 and
p99.5: the steps that set p99) are averaged part by part.

A part's time includes the parts it calls (the release includes the
refreshed-state walk, the planner's bookkeeping and vLLM's free). Timers
sit in both policies wherever the code is shared, so their own cost is in
both columns.

    python3 benchmarks/slow_step_parts.py --max-traces 30 --point c4:40

`--by-kind` adds, for each kind of step (decode only; a full prefill chunk
without an admission; one with), every step of that kind averaged part by
part: where the policies' steps of the same work differ.

`--without` adds, for each part, the p99 of the steps with that part's time
taken out: how far p99 would fall if the part cost nothing (an upper
bound of what making it faster could give; where the plugin's part stands
in for vLLM's own work, as the gate's lookups do for vLLM's, vLLM's cost
would come back).
"""

from __future__ import annotations

import argparse
import array
import collections
import functools
import inspect
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scheduler_bench as bench  # noqa: E402

cpu = time.thread_time_ns


def _parts() -> list[tuple[object, str, str]]:
    """(owner, attribute, label) of every timed part: vLLM's, then the
    plugin's."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    from atom_hybrid_cache.core.gate_steps import GateSteps
    from atom_hybrid_cache.core.planner import CheckpointPlanner
    from atom_hybrid_cache.vllm import admission, admission_gate, cached_tokens_estimate, release
    from atom_hybrid_cache.vllm.attention_lookup import AtomAttentionLookup
    from atom_hybrid_cache.vllm.finished_token_lists import FinishedTokenLists
    from atom_hybrid_cache.vllm.floor_states import FloorStates
    from atom_hybrid_cache.vllm.state_manager import AtomStateManager
    return [
        (KVCacheManager, "get_computed_blocks", "vLLM prefix lookup (get_computed_blocks)"),
        (KVCacheManager, "allocate_slots", "vLLM allocate_slots"),
        (Scheduler, "_free_request", "release: vLLM _free_request, all of it"),
        (BlockPool, "free_blocks", "BlockPool.free_blocks (releases, unpins)"),
        (BlockPool, "touch", "BlockPool.touch (pins)"),
        (Scheduler, "_update_request_with_output", "update: a request's new tokens"),
        (KVCacheManager, "estimate_cached_tokens", "update: vLLM's cached-tokens estimate"),
        (cached_tokens_estimate, "estimate_cached_tokens", "update: the plugin's cached-tokens estimate"),
        (release, "free_in_units", "release: the plugin's free_in_units"),
        (release, "_refreshed_states", "release: refreshed-state walk"),
        (CheckpointPlanner, "finished", "release: planner bookkeeping"),
        (release, "freed_order", "release: unit order"),
        (release, "_held_states_back", "release: held states back"),
        (admission_gate.AdmissionGate, "open", "gate: open (lookups, decision, pins)"),
        (admission_gate, "_look_up", "gate: lookups"),
        (GateSteps, "decide", "gate: decision"),
        (admission_gate.AdmissionGate, "close", "gate: close (unpins)"),
        (FloorStates, "hold_window", "floors"),
        (admission, "chunk_tokens", "chunk stops"),
        (admission, "after_schedule", "after schedule"),
        (FinishedTokenLists, "free_slice", "finished requests' lists, a slice"),
        (AtomAttentionLookup, "find_longest_cache_hit", "lookup: attention half"),
        (AtomStateManager, "find_longest_cache_hit", "lookup: state half"),
    ]


class StepRecord:
    """The timed steps of one scheduler: a column of nanoseconds a part.

    Why columns: a record kept per step (a Counter) is a tracked object
    that lives to the end of the run; 267k of them bring Python's
    collector round every few hundred steps, and its passes (8 ms each,
    with a long prompt's token lists young) then land in the timed steps
    and crowd their top percent. An array of ints is not tracked."""

    def __init__(self, labels) -> None:
        self.columns = {label: array.array("q") for label in labels}

    def append(self, step: collections.Counter) -> None:
        for label, column in self.columns.items():
            column.append(step.get(label, 0))

    def __len__(self) -> int:
        return len(self.columns["step"])

    def __iter__(self):
        """Each step as a Counter of its parts that took time."""
        columns = list(self.columns.items())
        for i in range(len(self)):
            yield collections.Counter({label: c[i] for label, c in columns if c[i]})


class StepTimers:
    """Thread-CPU time per part, per step, per scheduler class; a context
    manager: the timers are in place inside `with`, and every wrapped
    attribute is put back on leaving.

    `free_requests_after_step` (a diagnostic): finished requests are kept
    alive until their step has been timed, so that their deallocation (a
    long prompt's token lists: hundreds of microseconds, in both policies)
    falls outside every step."""

    def __init__(self, parts, scheduler_classes, free_requests_after_step: bool = False) -> None:
        self.parts = list(parts)
        self.scheduler_classes = list(scheduler_classes)
        self.free_after = free_requests_after_step
        self.current: collections.Counter | None = None
        labels = [label for _, _, label in self.parts]
        labels += ["schedule()", "update_from_output()", "step", *KIND_COUNTS]
        self.steps: dict[str, StepRecord] = collections.defaultdict(lambda: StepRecord(labels))
        self._finished: list = []
        # each scheduler's step under way, from its schedule() to its update
        self._open: dict[int, collections.Counter] = {}
        self._saved: list[tuple[object, str, bool, object]] = []

    def __enter__(self) -> "StepTimers":
        for owner, name, label in self.parts:
            raw = inspect.getattr_static(owner, name)
            if isinstance(raw, (classmethod, staticmethod)):
                # find_longest_cache_hit is a classmethod: the class it is
                # called on must still reach it
                self._set(owner, name, type(raw)(self._timed(raw.__func__, label)))
            else:
                self._set(owner, name, self._timed(getattr(owner, name), label))
        self._wrap_steps()
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, had, old in reversed(self._saved):
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self._saved.clear()
        self._finished.clear()
        self._open.clear()

    def _set(self, owner, name: str, value) -> None:
        had = name in vars(owner)
        self._saved.append((owner, name, had, vars(owner).get(name)))
        setattr(owner, name, value)

    def _timed(self, inner, label: str):
        @functools.wraps(inner)
        def timed(*args, **kwargs):
            step = self.current
            if step is None:
                return inner(*args, **kwargs)
            t = cpu()
            try:
                return inner(*args, **kwargs)
            finally:
                step[label] += cpu() - t
        return timed

    def _wrap_steps(self) -> None:
        """A step is one `schedule()` and its `update_from_output()`."""
        from vllm.v1.core.sched.scheduler import Scheduler
        for cls in self.scheduler_classes:
            inner = cls.schedule

            def schedule(sched, *args, _inner=inner, **kwargs):
                if self.current is not None:      # the subclass's super() call
                    return _inner(sched, *args, **kwargs)
                step = self.current = self._open[id(sched)] = collections.Counter()
                t = cpu()
                try:
                    return _inner(sched, *args, **kwargs)
                finally:
                    step["schedule()"] += cpu() - t
                    self.current = None
            self._set(cls, "schedule", schedule)
        update = Scheduler.update_from_output
        free_request = Scheduler._free_request

        def update_from_output(sched, output, runner_output):
            step = self.current = self._open.pop(id(sched))
            t = cpu()
            try:
                return update(sched, output, runner_output)
            finally:
                step["update_from_output()"] += cpu() - t
                self.current = None
                if output.num_scheduled_tokens:
                    step["step"] = step["schedule()"] + step["update_from_output()"]
                    # what kind of step it was (counts, not times: `by_kind`)
                    step["#tokens"] = output.total_num_scheduled_tokens
                    step["#requests"] = len(output.num_scheduled_tokens)
                    step["#admitted"] = len(output.scheduled_new_reqs)
                    self.steps[type(sched).__name__].append(step)
                self._finished.clear()

        def keep_finished(sched, request, *args, **kwargs):
            self._finished.append(request)
            return free_request(sched, request, *args, **kwargs)
        self._set(Scheduler, "update_from_output", update_from_output)
        if self.free_after:
            self._set(Scheduler, "_free_request", keep_finished)


def measure(conversations: list, policies: list, *, free_requests_after_step: bool = False,
            **point) -> list[tuple[object, list]]:
    """[(scheduler_bench's PointResult, the timed steps)] of each policy,
    served interleaved (keyword arguments: `scheduler_bench.serve_point`'s)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from atom_hybrid_cache.vllm.scheduler import AtomScheduler
    plugins = [bench.POLICIES[p].plugin for p in policies]
    if plugins.count(True) > 1 or plugins.count(False) > 1:
        raise ValueError("at most one native and one plugin policy: their steps are told "
                         "apart by their scheduler class")
    with StepTimers(_parts(), [AtomScheduler, Scheduler], free_requests_after_step) as timers:
        results = bench.run_points_interleaved(conversations, policies, progress=False, **point)
    return [(r, timers.steps[r.scheduler]) for r in results]


# per step, what kind it was (`StepTimers` records them beside the times)
KIND_COUNTS = ("#tokens", "#requests", "#admitted")
# a step whose token budget a prefill chunk filled (8,192 here, a few
# decodes aside)
FULL_PREFILL_TOKENS = 8000
KINDS = {
    "decode only": lambda s: s["#tokens"] == s["#requests"],
    "a full prefill chunk, no admission": lambda s: (s["#tokens"] >= FULL_PREFILL_TOKENS
                                                     and not s["#admitted"]),
    "a full prefill chunk and an admission": lambda s: (s["#tokens"] >= FULL_PREFILL_TOKENS
                                                        and s["#admitted"]),
}


def by_kind(steps) -> list[str]:
    """Every step of each kind (`KINDS`), averaged part by part."""
    out = []
    for kind, is_kind in KINDS.items():
        chosen = [s for s in steps if is_kind(s)]
        out.append(f"  -- {kind}")
        out += band_table(chosen, 0, 100) if chosen else ["  (none)"]
    return out


def p99_without_each(steps) -> list[str]:
    """For each part that took time in some step, the p99 of the step totals
    with that part's time taken out, largest fall first."""
    n = len(steps)
    if not n:
        return ["  (no steps)"]
    at = int(n * 0.99)
    p99 = sorted(s["step"] for s in steps)[at]
    labels = {label for s in steps for label, v in s.items()
              if v and label not in (*KIND_COUNTS, "step", "schedule()", "update_from_output()")}
    rows = []
    for label in labels:
        without = sorted(s["step"] - s[label] for s in steps)[at]
        rows.append((p99 - without, label, without))
    out = [f"  p99 {p99 / 1e3:,.0f} us; without one part's time:",
           f"  {'part':52s} {'p99 without':>12s} {'fall':>7s}"]
    for fall, label, without in sorted(rows, key=lambda r: (-r[0], r[1])):
        out.append(f"  {label:52s} {without / 1e3:12,.0f} {fall / 1e3:7,.0f}")
    return out


def band_table(steps, lo: float, hi: float) -> list[str]:
    totals = sorted(s["step"] for s in steps)
    n = len(totals)
    a, b = totals[int(n * lo / 100)], totals[min(n - 1, int(n * hi / 100))]
    band = [s for s in steps if a <= s["step"] <= b]
    p99 = totals[int(n * 0.99)]
    sums, counts = collections.Counter(), collections.Counter()
    for s in band:
        sums.update(s)
        counts.update({k: 1 for k, v in s.items() if v})
    out = [f"{n} steps, p99 {p99 / 1e3:,.0f} us; band p{lo}-p{hi}: {a / 1e3:,.0f}-"
           f"{b / 1e3:,.0f} us, {len(band)} steps",
           f"  {'part':52s} {'us a band step':>15s} {'steps with it':>14s} {'us each':>9s}"]
    for label, total in sorted(sums.items(), key=lambda kv: -kv[1]):
        if not total or label in KIND_COUNTS:
            continue
        out.append(f"  {label:52s} {total / len(band) / 1e3:15,.1f} {counts[label]:14d} "
                   f"{total / counts[label] / 1e3:9,.1f}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="+", default=[str(bench.DEFAULT_TRACES)])
    ap.add_argument("--max-traces", type=int, default=30)
    ap.add_argument("--point", default="c4:40", help="one cN:GIB point")
    ap.add_argument("--policies", type=bench.parse_policies,
                    default=bench.parse_policies("native,plugin-default-block"),
                    help="one native and one plugin policy at most")
    ap.add_argument("--max-model-len", type=int, default=bench.DEFAULT_MAX_MODEL_LEN,
                    help="the context (scheduler_bench's; a small pool needs a shorter one)")
    ap.add_argument("--band", default="98.5,99.5", help="LO,HI percentiles of the step total")
    ap.add_argument("--by-kind", action="store_true",
                    help="also every step of each kind (decode only; a full prefill chunk, "
                         "with and without an admission), averaged part by part")
    ap.add_argument("--without", action="store_true",
                    help="also the p99 with each part's time taken out, largest fall first")
    ap.add_argument("--free-requests-after-step", action="store_true",
                    help="diagnostic: a finished request is deallocated after its step is "
                         "timed, not in it")
    args = ap.parse_args(argv)
    (concurrency, gib), = bench.parse_points(args.point)
    lo, hi = (float(x) for x in args.band.split(","))
    conversations = bench.load_conversations(args.traces, args.max_traces)
    try:
        measured = measure(conversations, args.policies, concurrency=concurrency,
                           memory_gib=gib, max_model_len=args.max_model_len,
                           free_requests_after_step=args.free_requests_after_step)
    except ValueError as exc:
        ap.error(f"--policies: {exc}")
    print(f"c{concurrency} / {gib:g} GiB, {len(conversations)} traces, thread-CPU timers"
          + (", finished requests deallocated after their step"
             if args.free_requests_after_step else ""))
    for r, steps in measured:
        print(f"\n{r.policy} ({r.scheduler}): p99 {r.step_cpu_us_p99:,.0f} us "
              "by scheduler_bench's own clock")
        print("\n".join(band_table(steps, lo, hi)))
        if args.by_kind:
            print("\n".join(by_kind(steps)))
        if args.without:
            print("\n".join(p99_without_each(list(steps))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
