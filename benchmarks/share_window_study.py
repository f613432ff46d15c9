"""Does a request slot's share that only shrinks cost paced traffic?

The plugin sizes its insurance states, priced eviction and placement by a
request slot's share of the pool: the pool over the most requests in
flight at once so far (`core/slot_share.py`). It only shrinks, so a burst
turns the insurance off for the rest of the run. Under a paced client
(think times, sub-agent lanes) the requests in flight rise and fall, and a
share that follows them back up could hold more where the traffic thins.

This study replays the shared cc traces through the planner's model of the
plugin (`default`) with the paced client, twice per point: the share as
shipped, and a share over the most requests in flight within the last
WINDOW scheduler steps (it rises again after a burst, and turns the
insurance back on when it crosses the line), and a third time with only
the fallback rungs (`placement.py`) sized by the share over the requests
in flight at the last step. Side by side, one process.

    python3 benchmarks/share_window_study.py [TRACE_DIR] \
        [--points 16:30,16:60,16:80,32:80] [--window 2000] [--time-scale 1]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE_DIR = ROOT.parent / "shared" / "traces" / "cc-traces"


@contextlib.contextmanager
def windowed_share(window: int, flips: list):
    """SlotShare over the most requests in flight in the last `window`
    steps; `flips` counts the times the share crossed the line."""
    from atom_hybrid_cache.core.slot_share import SlotShare
    init, observe = SlotShare.__init__, SlotShare.observe

    def windowed_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.recent = collections.deque(maxlen=window)

    def windowed_observe(self, in_flight: int) -> bool:
        # True on a crossing either way: the policy refits (`_fit`) then
        self.recent.append(min(in_flight, self.max_num_seqs))
        was_under = self.under_line
        self.peak = max(self.recent)
        crossed = self.under_line != was_under
        flips[0] += crossed
        return crossed

    SlotShare.__init__, SlotShare.observe = windowed_init, windowed_observe
    try:
        yield
    finally:
        SlotShare.__init__, SlotShare.observe = init, observe


@contextlib.contextmanager
def fallback_by_share_now():
    """Fallback rungs sized by the share over the requests in flight at
    the last step, the insurance states and priced eviction by the peak."""
    from atom_hybrid_cache.core import policy as policy_module
    from atom_hybrid_cache.core.slot_share import SlotShare
    observe, plan = SlotShare.observe, policy_module.plan_checkpoints

    def observe_now(self, in_flight: int) -> bool:
        self.now = min(in_flight, self.max_num_seqs)
        return observe(self, in_flight)

    def plan_now(*args, kv_share_tokens, **kwargs):
        share = current_share[0]
        now = getattr(share, "now", share.peak)
        return plan(*args, kv_share_tokens=share.pool_kv_tokens // max(1, now), **kwargs)

    current_share = [None]
    policy_plan = policy_module.CheckpointPolicy.plan

    def policy_plan_now(self, *args, **kwargs):
        current_share[0] = self.share
        return policy_plan(self, *args, **kwargs)

    SlotShare.observe = observe_now
    policy_module.plan_checkpoints = plan_now
    policy_module.CheckpointPolicy.plan = policy_plan_now
    try:
        yield
    finally:
        SlotShare.observe = observe
        policy_module.plan_checkpoints = plan
        policy_module.CheckpointPolicy.plan = policy_plan


def replay_hit(traces: str, concurrency: int, memory_gib: float, time_scale: float) -> dict:
    from atom_hybrid_cache.cli import main
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        main(["replay", traces, "--concurrency", str(concurrency), "--memory-gib", str(memory_gib),
              "--policies", "default", "--time-scale", str(time_scale), "--jobs", "1",
              "--no-progress", "--json", str(out)])
        run = next(p for p in json.loads(out.read_text())["policies"] if p["policy"] == "default")
    return dict(hit=run["hit_rate"], computed=run["prefill_tokens_computed"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="?", default=str(DEFAULT_TRACE_DIR))
    ap.add_argument("--points", default="16:30,16:60,16:80,32:80",
                    help="concurrency:memory GiB, comma-separated")
    ap.add_argument("--window", type=int, default=2000, help="scheduler steps")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for point in args.points.split(","):
        concurrency, memory = point.split(":")
        shipped = replay_hit(args.traces, int(concurrency), float(memory), args.time_scale)
        flips = [0]
        with windowed_share(args.window, flips):
            windowed = replay_hit(args.traces, int(concurrency), float(memory), args.time_scale)
        with fallback_by_share_now():
            fallback_now = replay_hit(args.traces, int(concurrency), float(memory),
                                      args.time_scale)
        rows.append(dict(concurrency=int(concurrency), memory_gib=float(memory),
                         shipped=shipped, windowed=windowed, crossings=flips[0],
                         fallback_now=fallback_now))
    print(f"\ntime scale {args.time_scale}, window {args.window} steps; hit = cached / prompt "
          "tokens of the requests simulated (over-context ones excluded)")
    print("| concurrency | memory | hit, share only shrinks | hit, windowed share | "
          "difference (points) | crossings of the line | hit, fallback rungs by the share now |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        a, b = r["shipped"]["hit"], r["windowed"]["hit"]
        print(f"| {r['concurrency']} | {r['memory_gib']:g} GiB | {a:.4f} | {b:.4f} | "
              f"{100 * (b - a):+.2f} | {r['crossings']} | {r['fallback_now']['hit']:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
