#!/usr/bin/env python3
"""The scaled e2e pressure workload (``e2e_pressure.py``'s SCALE rule) in
several shapes: how much of the oracle each policy keeps when the traces are
scaled differently or more or fewer conversations are in flight.

Why: at 0.83x a single workload's figure moves by about 0.01 with small
changes of policy that shift which conversation a peak round cuts (a whole
resume of 4-7k tokens). A change is kept only when it holds across shapes.
Each shape is ``TOKENS_PER_IDxIN_FLIGHT`` (the plan's is ``8x4``); budgets
are multiples of that shape's own largest live working set, as in
``e2e_pressure.py``. Outputs are not compared here (no caching-off run):
that is ``e2e_pressure.py``'s job. With ``--scheduler-only`` each run drives
the engine's scheduler with synthetic outputs instead of running the model
(``e2e_pressure.replay_scheduler_only``): the same cached counts to the
token; the 40 runs of the command below took 270 s that way (beside a CI
run) against 868 s with the model on a faster machine.

    python3 benchmarks/e2e_pressure_sweep.py \\
        --shapes 8x4,6x4,10x4,8x3,8x5 --pool-multiples 0.83,1.25 \\
        --policies native,attention-control,plugin,plugin-hits-first \\
        --json benchmarks/results/e2e_pressure_sweep.json

``--scheduler-only --geometry default --shapes 64x4`` is the plan's
workload at full length (64 tokens per trace id), which only the
scheduler-only replay makes affordable here.

``--max-prompt CAP[,CAP...]`` runs each shape under ``e2e_pressure.py``'s
ELIDE rule at each cap as well (conversations cut where a prompt passes
it, as a server's context length cuts them), labelled ``/capN``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_pressure as E  # noqa: E402

# A checkpoint costs the KV of 96 tokens: near qwen3.5-27b's share of a
# prompt when the traces are scaled to 6-10 tokens per id. At full length
# (64 tokens per id) the default geometry's 384 is the nearer share.
GEOMETRY = "small-block"
# The row of e2e_pressure.paged_reuse_bound: what no paged cache of the
# same blocks can exceed (attention-only; states would lower it).
BOUND = "paged bound"


def parse_shapes(raw: str) -> list[tuple[int, int]]:
    shapes = []
    for item in filter(None, raw.split(",")):
        tokens_per_id, _, in_flight = item.partition("x")
        shapes.append((int(tokens_per_id), int(in_flight)))
    return shapes


def largest_prompt(path) -> int:
    from atom_hybrid_cache.replay.traces import load_traces
    return max((r.prompt_len for c in load_traces(path) for r in c.requests), default=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8x4,6x4,10x4,8x3,8x5",
                    help="comma list of TOKENS_PER_IDxIN_FLIGHT")
    ap.add_argument("--pool-multiples", default="0.83,1.25")
    ap.add_argument("--policies", default="native,attention-control,plugin,plugin-hits-first")
    E.add_trace_dir_argument(ap)
    ap.add_argument("--traces-fitting", type=int, default=64000,
                    help="the traces whose prompts are all shorter than this (the plan's 14)")
    ap.add_argument("--traces-above", type=int, default=0, metavar="TOKENS",
                    help="and whose largest prompt is at least this: with --traces-fitting "
                         "128000, --traces-above 64000 gives 54 traces the defaults were not "
                         "tuned on")
    ap.add_argument("--groups", type=int, default=1,
                    help="split the selected traces into this many workloads (every Nth "
                         "trace in name order), each run on its own")
    ap.add_argument("--max-prompt", default="0",
                    help="comma list of caps, each shape run at each: e2e_pressure's ELIDE "
                         "rule (0: none), each conversation's first prompt elided to a "
                         "quarter of the cap, the conversation ended at its first prompt "
                         "longer than it")
    ap.add_argument("--scheduler-only", action="store_true",
                    help="drive the engines' schedulers without the model (same cached counts, "
                         "about a second per run; see e2e_pressure.replay_scheduler_only)")
    ap.add_argument("--geometry", choices=sorted(E.GEOMETRIES), default=GEOMETRY,
                    help="tiny-model geometry (block size and the KV share of a state page)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    policies = args.policies.split(",")
    # vLLM loads plugins once per process: the plugin's runs come last
    policies.sort(key=lambda p: p in E.PLUGIN_POLICIES)
    multiples = [float(m) for m in args.pool_multiples.split(",")]
    paths = [p for p in E.traces_fitting(args.traces_fitting, args.trace_dir)
             if not args.traces_above or largest_prompt(p) >= args.traces_above]
    groups = [paths[g::args.groups] for g in range(args.groups)]
    block_size = E.GEOMETRIES[args.geometry]["block_size"]
    rows = []
    t0 = time.monotonic()
    shapes = []
    caps = [int(c) for c in args.max_prompt.split(",")]
    for (tokens_per_id, in_flight), cap, (g, group) in itertools.product(
            parse_shapes(args.shapes), caps, enumerate(groups)):
        shape = (f"{tokens_per_id}x{in_flight}" + (f"/cap{cap}" if cap else "")
                 + (f"/g{g}" if args.groups > 1 else ""))
        shapes.append(shape)
        convs = E.build_workload(group, cap, 256, None, tokens_per_id)
        w = E.lockstep_workload(convs, in_flight, block_size)
        oracle = sum(w.oracle)
        budgets = {m: E.budget_blocks(m, w.working_set, w.single_request)
                   for m in multiples}

        def record(m, policy, cached):
            rows.append({"shape": shape, "multiple": m, "policy": policy,
                         "num_blocks": budgets[m], "cached_tokens": cached,
                         "oracle_tokens": oracle, "ratio": round(cached / oracle, 4)})
            print(f"{shape} {m:>5} {policy:<20} blocks {budgets[m]:>5} "
                  f"cached {cached:>9,} / {oracle:,} = {cached / oracle:.4f}", flush=True)

        for m in multiples:
            record(m, BOUND, E.paged_reuse_bound(w.sent, w.oracle,
                                                 [len(r) for r in w.rounds], block_size,
                                                 budgets[m] - 1))   # -1: the null block
        for policy in policies:
            for m in multiples:
                run = E.run_policy(policy, convs, w.rounds, budgets[m], w.max_model_len,
                                   args.geometry, scheduler_only=args.scheduler_only)
                record(m, policy, sum(run["cached"]))
    print(f"\n{'multiple':>8} {'policy':<20} " + " ".join(f"{s:>7}" for s in shapes) + "    mean")
    for m in multiples:
        for policy in [BOUND] + policies:
            vals = [next(r["ratio"] for r in rows if r["shape"] == s and r["multiple"] == m
                         and r["policy"] == policy) for s in shapes]
            print(f"{m:>8} {policy:<20} " + " ".join(f"{v:7.4f}" for v in vals)
                  + f"  {sum(vals) / len(vals):.4f}")
    print(f"elapsed: {time.monotonic() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": dict(vars(args), trace_dir=str(args.trace_dir)),
             "groups": [[p.stem for p in g] for g in groups], "rows": rows},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
