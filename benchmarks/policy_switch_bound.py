#!/usr/bin/env python3
"""A bound on switching policies as a run goes: can a plugin that shadows
vLLM alone, and serves with whichever policy leads, stay at or above the
better native in every cell of the small-pool grid (issue 31)?

Each cell of `small_pool_sweep.py`'s grid runs under each policy (the
planner); each request's cached tokens at its first admission are recorded
(they sum to the sweep's figures). The switch is then replayed on them, in
the first policy's admission order: the live policy serves the request,
every policy's running total takes its own run's figure for it, and the live
policy becomes the leader wherever the leader is ahead of it by more than
the margin. Each policy's figures come from its own run, so the switch is
free (the pool holds the new policy's contents at once) and the shadow
exact (the grid's lock-step rounds send every policy the same requests): a
real switch can only do worse, while the pool turns over.

    python benchmarks/policy_switch_bound.py --json benchmarks/results/policy_switch_bound_84.json
    # and with small_pool_sweep.py's grid options, e.g. the 160 held-out cells:
    python benchmarks/policy_switch_bound.py --subsets 8 --checkpoints 30,50,75,100,200 \\
        --pool-multiples 0.83,1.0,1.25,2.0 --json benchmarks/results/policy_switch_bound_160.json
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import small_pool_sweep as S  # noqa: E402
from atom_hybrid_cache.core.shared_pool_manager import SharedPoolManager  # noqa: E402

POLICIES = ("native", "native-pmu64", "plugin")
NATIVES = ("native", "native-pmu64")
# (policies, the first one live at the start; one way: no switch back)
SWITCHES = ((("native-pmu64", "plugin"), False),
            (("native-pmu64", "plugin"), True),
            (("plugin", "native-pmu64"), False),
            (("native", "plugin"), False),
            (("native", "native-pmu64", "plugin"), False))
MARGINS = (0, 1024, 8192)


class FirstHitRecorder(SharedPoolManager):
    """The planner's manager, keeping each request's hit at its first
    admission in `first_hits` (the simulator counts that one: a preempted
    request's later admissions are not new requests)."""

    def __init__(self, first_hits: dict, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.first_hits = first_hits

    def admit(self, req, budget=None):
        adm = super().admit(req, budget)
        if adm is not None and req.request_id not in self.first_hits:
            self.first_hits[req.request_id] = adm.hit_tokens
        return adm


def switched_total(hits: dict, order: Sequence[str], margin: int = 0,
                   one_way: bool = False) -> int:
    """Cached tokens when `order[0]` serves first and the live policy turns
    to whichever of `order` leads it by more than `margin` tokens after each
    request (`hits`: policy -> {request: tokens}, in admission order, the
    first policy's order being time's); after one switch, none more where
    `one_way`."""
    live = order[0]
    totals = dict.fromkeys(order, 0)
    served = 0
    switched = False
    for rid in hits[order[0]]:
        served += hits[live].get(rid, 0)
        for p in order:
            totals[p] += hits[p].get(rid, 0)
        if one_way and switched:
            continue
        leader = max(order, key=lambda p: (totals[p], p == live))
        if totals[leader] - totals[live] > margin:
            live = leader
            switched = True
    return served


def cell_hits(cell, shapes, policies=POLICIES) -> dict:
    """policy -> {request: cached tokens at its first admission} in `cell`."""
    convs, w = shapes[cell["subset"]].workload(cell["tokens_per_id"], cell["in_flight"])
    out = {}
    for policy in policies:
        out[policy] = {}
        cell["cached"][policy] = S.planner_cached(
            policy, convs, w, cell, manager_class=partial(FirstHitRecorder, out[policy]))
    return out


def summarize(rows: list, label: str, cached: list) -> str:
    """One table row: cells under the better native, the worst and the sum
    (points of the oracle) for `cached`, each row's cached tokens."""
    gaps = [100 * (c - r["best_native"]) / r["oracle"] for r, c in zip(rows, cached)]
    below = sum(g < 0 for g in gaps)
    return (f"| {label} | {below} | {min([0.0] + gaps):+.3f} | {sum(gaps) / 100:+.3f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    S.add_grid_arguments(ap)
    ap.add_argument("--margins", default=",".join(map(str, MARGINS)),
                    help="tokens a policy leads by before the live one turns to it")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    margins = [int(x) for x in args.margins.split(",")]
    _, shapes, cells = S.grid_cells(args)
    rows = []
    for cell in cells:
        hits = cell_hits(cell, shapes)
        row = dict(subset=cell["subset"], checkpoints=cell["checkpoints"],
                   multiple=cell["multiple"], pool_offset=cell.get("pool_offset", 0),
                   oracle=cell["oracle"], cached=dict(cell["cached"]),
                   best_native=max(cell["cached"][p] for p in NATIVES), switched={})
        for order, one_way in SWITCHES:
            for m in margins:
                name = f"{'>'.join(order)}{' one way' if one_way else ''} @{m}"
                row["switched"][name] = switched_total(hits, order, m, one_way)
        rows.append(row)
        print(f"subset {row['subset']} {row['checkpoints']:>5} x{row['multiple']:<5}"
              f"{row['pool_offset']:+.2f} plugin {cell['cached']['plugin'] / row['oracle']:.4f} "
              f"best native {row['best_native'] / row['oracle']:.4f}", flush=True)
    print(f"\n{len(rows)} cells; cells under the better native, the worst and the sum, "
          "points of the oracle\n")
    print("| policy | below | worst | sum |\n|---|---|---|---|")
    print(summarize(rows, "plugin alone", [r["cached"]["plugin"] for r in rows]))
    for name in rows[0]["switched"] if rows else ():
        print(summarize(rows, f"switch {name}", [r["switched"][name] for r in rows]))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": dict(vars(args), trace_dir=str(args.trace_dir)), "cells": rows},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
