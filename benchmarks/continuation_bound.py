#!/usr/bin/env python3
"""Which policy serves the next request best depends on which request comes.

Issue 31 asks for the plugin at or above the better of vLLM's two native
settings in every cell. This benchmark shows why no policy can promise that
on every workload, the plugin, either native or any other: after the same
first turns, policies with the same pool hold different prefixes, and the
workload can go on with the request only one of them kept.

The workload: `len(lens)` conversations send one first prompt each (no
prompt shares a token with another, so every policy caches 0 tokens over
them), all in flight in one lock-step round, in a pool too small for all
of them; then ONE conversation, `j`, sends its second turn (its first
prompt and 200 new tokens). Up to that request every policy's total is 0,
so that one resume decides. For each `j` the table gives each policy's
cached tokens: a policy is "beaten at j" where another caches more.

The argument it illustrates: at the end of the first round, the two
natives together hold more resumable prefixes than one pool of the same
pages holds (vLLM at its 64-token unit spends pages on the prompt-end
copies that vLLM at its page-sized unit spends on older prompts). Whatever
a policy keeps, it lacks one of the prefixes one of the natives kept, and
the continuation of that conversation puts it below that native. A policy
can lead on a set of workloads in sum, or in every cell of a sweep of
natural traces (an empirical question, `small_pool_sweep.py`); not on every
workload.

    python benchmarks/continuation_bound.py                      # the planner's model
    python benchmarks/continuation_bound.py --scheduler          # vLLM's real scheduler
    python benchmarks/continuation_bound.py --search 200         # random first turns

The planner's model gives vLLM's figures to the token here (the table;
`tests/test_continuation_bound.py` pins the planner's, and
`tests/e2e/test_scheduler_only_replay.py` vLLM's at two continuations).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import small_pool_sweep as S  # noqa: E402

POLICIES = ("native", "native-pmu64", "plugin")
# four first prompts (tokens) and a pool of 40 pages (13 checkpoints' worth)
LENS = (1149, 730, 453, 1479)
POOL_PAGES = 40
# the second turn's new tokens
CONTINUATION_TOKENS = 200


def first_turns_then(lens, j: Optional[int]) -> list[dict]:
    """The conversations: one first prompt each (token ids no other prompt
    has), and for conversation `j` (None: none) a second turn that resends
    its first prompt and continues it."""
    convs = []
    for i, n in enumerate(lens):
        first = [(i + 1) * 1_000_000 + t for t in range(n)]
        prompts = [first]
        if i == j:
            prompts.append(first + [900_000_000 + i * 1_000 + t
                                    for t in range(CONTINUATION_TOKENS)])
        convs.append(dict(id=f"conversation_{i}", prompts=prompts))
    return convs


def planner_runner(policy: str, convs, pool_pages: int) -> int:
    """Cached tokens in the planner's model (`small_pool_sweep.planner_cached`)."""
    return S.planner_cached(policy, convs, None,
                            dict(pool_pages=pool_pages, in_flight=len(convs)))


def scheduler_runner(policy: str, convs, pool_pages: int) -> int:
    """Cached tokens on vLLM's real scheduler (e2e_pressure's scheduler-only
    replay; the plugin's policies must come after the natives: vLLM loads
    plugins once a process)."""
    E = S.E
    w = E.lockstep_workload(convs, len(convs), E.GEOMETRIES[S.GEOMETRY]["block_size"])
    # +1: vLLM's null block
    run = E.run_policy(policy, convs, w.rounds, pool_pages + 1, w.max_model_len, S.GEOMETRY,
                       scheduler_only=True, max_num_seqs=len(convs))
    return sum(run["cached"])


def continuation_table(lens, pool_pages: int, policies=POLICIES, runner=planner_runner):
    """[{policy: cached tokens}] for each conversation's continuation, policy
    by policy (all of one policy's runs before the next)."""
    rows = [dict() for _ in lens]
    for policy in policies:
        for j in range(len(lens)):
            rows[j][policy] = runner(policy, first_turns_then(lens, j), pool_pages)
    return rows


def beaten_at(rows, policy: str) -> list[int]:
    """The continuations where another policy caches more than `policy`."""
    return [j for j, r in enumerate(rows) if r[policy] < max(r.values())]


def search(count: int, seed: int = 0, pools=(30, 40, 50, 60)) -> dict:
    """Random first turns (4 or 6 prompts of 3-12 pages and 65-127 tokens
    into the next page), each at every pool: in how many is each policy
    beaten at some continuation (by any other; each native by the other),
    in how many is every policy, and which leads in sum?"""
    rng = random.Random(seed)
    a, b = POLICIES[:2]     # the two natives against each other
    tally = dict(cases=0, every_policy_beaten=0, **{f"{p}_beaten": 0 for p in POLICIES},
                 **{f"{a}_beaten_by_{b}": 0, f"{b}_beaten_by_{a}": 0},
                 **{f"{p}_best_in_sum": 0 for p in POLICIES})
    for _ in range(count):
        k = rng.choice((4, 6))
        lens = [128 * rng.randint(3, 12) + rng.randint(65, 127) for _ in range(k)]
        for pool in pools:
            rows = continuation_table(lens, pool)
            if not any(any(r.values()) for r in rows):
                continue    # the pool kept nothing for any policy
            tally["cases"] += 1
            beaten = [p for p in POLICIES if beaten_at(rows, p)]
            for p in beaten:
                tally[f"{p}_beaten"] += 1
            tally["every_policy_beaten"] += len(beaten) == len(POLICIES)
            tally[f"{a}_beaten_by_{b}"] += any(r[a] < r[b] for r in rows)
            tally[f"{b}_beaten_by_{a}"] += any(r[b] < r[a] for r in rows)
            sums = {p: sum(r[p] for r in rows) for p in POLICIES}
            for p in POLICIES:
                tally[f"{p}_best_in_sum"] += sums[p] == max(sums.values())
    return tally


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lens", default=",".join(map(str, LENS)),
                    help="the first prompts' lengths in tokens")
    ap.add_argument("--pool-pages", type=int, default=POOL_PAGES,
                    help="the pool in 128-token pages (a checkpoint is 3)")
    ap.add_argument("--scheduler", action="store_true",
                    help="vLLM's real scheduler instead of the planner's model")
    ap.add_argument("--search", type=int, default=0, metavar="N",
                    help="N random sets of first turns at pools of 30, 40, 50 and 60 pages "
                         "(the planner): how often each policy is beaten at some continuation")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.search:
        out = search(args.search)
        print(json.dumps(out, indent=1))
    else:
        if args.scheduler:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        lens = [int(x) for x in args.lens.split(",")]
        rows = continuation_table(lens, args.pool_pages,
                                  runner=scheduler_runner if args.scheduler else planner_runner)
        print(f"first prompts {lens}, a pool of {args.pool_pages} pages; cached tokens of the "
              f"one continuation\n")
        print("| continuation of | " + " | ".join(POLICIES) + " | best |")
        print("|---|" + "---|" * (len(POLICIES) + 1))
        for j, r in enumerate(rows):
            best = ", ".join(p for p in POLICIES if r[p] == max(r.values()))
            print(f"| conversation {j} ({lens[j]} tokens) | "
                  + " | ".join(f"{r[p]:,}" for p in POLICIES) + f" | {best} |")
        print("| sum | " + " | ".join(f"{sum(r[p] for r in rows):,}" for p in POLICIES) + " | |")
        out = dict(lens=lens, pool_pages=args.pool_pages, scheduler=args.scheduler, rows=rows,
                   beaten_at={p: beaten_at(rows, p) for p in POLICIES})
        print("\nbeaten at: " + "; ".join(f"{p} {out['beaten_at'][p]}" for p in POLICIES))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
