#!/usr/bin/env python3
"""The plugin against vLLM's native hybrid caching over pool size x pressure.

Issue 31's sweep: vLLM's real scheduler and block pool (the scheduler-only
replay of ``e2e_pressure.py``: no model, the same cached counts as the model
runs), the tiny Qwen3-Next in its default geometry (128-token blocks; a
checkpoint = one page per GDN group = 3 pages = the KV of 384 tokens; with
``--geometry large-page`` the issue's 640-token pages), on disjoint subsets
of the shared cc traces, lock-step rounds of conversations.

A cell is (pool size in checkpoints' worth, pool / live working set). For
each subset and cell the workload is scaled (tokens per trace id, then
conversations in flight) so that a pool of exactly that many checkpoints'
worth is that multiple of the workload's largest live working set; the cell
reports the multiple it really got. Policies: vLLM's default (hash unit =
the block), vLLM with ``prefix_match_unit=64``, the plugin at its defaults,
and ``paged-bound``: what no paged cache of the same pages can exceed
(attention-only, no state pages; the attention-only control's run stays at
or under it, ``--policies attention-control`` runs the control itself). Each cell prints cached tokens over the oracle
reusable prefix.

    python benchmarks/small_pool_sweep.py --json benchmarks/results/small_pool_sweep.json

Runs share one process (vLLM loads plugins once: the plugin's runs come
last); engine start-up is about a second a run, the replay about a second
per million prompt tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_pressure as E  # noqa: E402

GEOMETRY = "default"
# The tiny model's checkpoint: one page in each of its three GDN groups.
CHECKPOINT_PAGES = E.MAMBA_GROUPS
CHECKPOINTS = (30, 50, 75, 100, 200, 500, 1000)
MULTIPLES = (0.83, 1.0, 1.25, 2.0)
TOKENS_PER_ID = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64)
# 4 in flight first (the plan's); fewer only where even 1 token per id
# overfills the pool
IN_FLIGHT = (4, 6, 8, 12, 16, 3, 2)
POLICIES = ("native", "native-pmu64", "paged-bound", "plugin")
# Not an engine: what no paged cache of the pool's pages can exceed
# (e2e_pressure.paged_reuse_bound, attention-only: no state pages at all),
# at or above the attention-only control's run, computed in no time.
PAGED_BOUND = "paged-bound"
# a workload whose multiple lands within this factor of the cell's counts as a hit
CLOSE_ENOUGH = 1.06


def subsets(traces_fitting: int, count: int, size: int,
            trace_dir: Path = E.DEFAULT_TRACE_DIR) -> list[list[Path]]:
    """`count` disjoint subsets of `size` traces each, every `count`-th
    trace (in name order) of those in `trace_dir` whose prompts all fit
    `traces_fitting` tokens: each subset mixes short and long traces alike."""
    paths = E.traces_fitting(traces_fitting, trace_dir)
    groups = [paths[g::count][:size] for g in range(count)]
    if any(len(g) < size for g in groups):
        raise SystemExit(f"only {len(paths)} traces in {trace_dir} fit {traces_fitting} tokens: "
                         f"not {count} subsets of {size}")
    return groups


class Shapes:
    """The scaled workloads of one subset. Which shape a cell gets is
    decided on prompt lengths alone (the SCALE rule's length: a 64-token
    trace id becomes `tokens_per_id` tokens, a request's tail of `in % 64`
    tokens `tail * tokens_per_id // 64`); token ids are built only for the
    shapes picked."""

    def __init__(self, paths: list[Path], max_requests: int | None,
                 geometry: str = GEOMETRY) -> None:
        from atom_hybrid_cache.replay.traces import load_traces

        self.paths = paths
        self.max_requests = max_requests
        self.block = E.GEOMETRIES[geometry]["block_size"]
        self.lengths = [[r.prompt_len for r in conv.requests[:max_requests]]
                        for path in paths for conv in load_traces(path) if conv.requests]
        self.convs: dict[int, list] = {}
        self.workloads: dict[tuple[int, int], E.LockstepWorkload] = {}

    def working_set(self, tokens_per_id: int, in_flight: int) -> tuple[int, int]:
        """(largest live working set, largest request) in pages."""
        convs = [{"prompts": [range((n // 64) * tokens_per_id + (n % 64) * tokens_per_id // 64)
                              for n in lens]} for lens in self.lengths]
        return E.working_set(convs, E.lockstep_rounds(convs, in_flight), self.block)

    def workload(self, tokens_per_id: int, in_flight: int):
        if tokens_per_id not in self.convs:
            self.convs[tokens_per_id] = E.build_workload(self.paths, 0, 256, self.max_requests,
                                                         tokens_per_id)
        key = (tokens_per_id, in_flight)
        if key not in self.workloads:
            self.workloads[key] = E.lockstep_workload(self.convs[tokens_per_id], in_flight,
                                                      self.block)
        return self.convs[tokens_per_id], self.workloads[key]


def pick_shape(shapes: Shapes, pool_pages: int, multiple: float):
    """The (tokens per id, in flight) whose live working set makes
    `pool_pages` nearest `multiple` of it (in log ratio), the plan's 4 in
    flight first; None when no shape fits one request."""
    best = None
    for in_flight in IN_FLIGHT:
        for tpi in TOKENS_PER_ID:
            ws, one = shapes.working_set(tpi, in_flight)
            if one > pool_pages:
                break                      # larger tpi only grows it
            got = pool_pages / ws
            err = abs(math.log(got / multiple))
            if best is None or err < best[0] - 1e-9:
                best = (err, tpi, in_flight, got)
            if ws * multiple > pool_pages * CLOSE_ENOUGH:
                break
        if best is not None and best[0] <= math.log(CLOSE_ENOUGH):
            break
    return None if best is None else best[1:]


def cell_workload(subset: int, checkpoints: int, multiple: float,
                  traces_fitting: int = 128000, count: int = 3, size: int = 8,
                  geometry: str = GEOMETRY):
    """One cell's workload, as `main` builds it: (convs, lock-step
    workload, pool pages, in flight); the tests that pin cells use it."""
    shapes = Shapes(subsets(traces_fitting, count, size)[subset], None, geometry)
    pool = checkpoints * CHECKPOINT_PAGES
    tokens_per_id, in_flight, _ = pick_shape(shapes, pool, multiple)
    convs, w = shapes.workload(tokens_per_id, in_flight)
    return convs, w, pool, in_flight


def at_pool_offsets(cell: dict, offsets) -> list[dict]:
    """`cell` at pool x (1 + offset) for each of `offsets`, its workload
    unchanged: the pages rounded, the real multiple scaled with them (to
    three places), and `pool_offset` kept where it is not 0, so that a run
    without offsets writes the cells it always wrote."""
    out = []
    for offset in offsets:
        pages = round(cell["pool_pages"] * (1 + offset))
        out.append(dict(cell, pool_pages=pages,
                        real_multiple=round(cell["real_multiple"] * pages / cell["pool_pages"], 3),
                        cached={}, **({"pool_offset": offset} if offset else {})))
    return out


def add_grid_arguments(ap: argparse.ArgumentParser) -> None:
    """The grid's options (this sweep's, and the benchmarks that run its cells)."""
    ap.add_argument("--checkpoints", default=",".join(map(str, CHECKPOINTS)),
                    help="pool sizes, in checkpoints' worth")
    ap.add_argument("--pool-multiples", default=",".join(map(str, MULTIPLES)),
                    help="pool / largest live working set")
    E.add_trace_dir_argument(ap)
    ap.add_argument("--geometry", choices=sorted(E.GEOMETRIES), default=GEOMETRY,
                    help="the tiny model's geometry: 'large-page' is issue 31's first "
                         "measure, 640-token pages (a checkpoint = 3 pages either way)")
    ap.add_argument("--traces-fitting", type=int, default=128000,
                    help="subsets are drawn from the traces whose prompts all fit this")
    ap.add_argument("--subsets", type=int, default=3)
    ap.add_argument("--subset-size", type=int, default=8, help="traces per subset")
    ap.add_argument("--max-requests", type=int, default=None,
                    help="requests per conversation (default: all)")
    ap.add_argument("--pool-offsets", default="0",
                    help="each cell also at pool x (1 + offset), its workload unchanged: pool "
                         "sizes between the grid's, e.g. -0.03,-0.02,-0.01,0,0.01,0.02,0.03 "
                         "(BENCHMARKS.md, 'The knee')")


def grid_cells(args) -> tuple:
    """(trace groups, their Shapes, the cells) for the grid options
    (`add_grid_arguments`), each cell's workload scaled to its multiple."""
    checkpoints = [int(x) for x in args.checkpoints.split(",")]
    offsets = [float(x) for x in args.pool_offsets.split(",")]
    multiples = [float(x) for x in args.pool_multiples.split(",")]
    groups = subsets(args.traces_fitting, args.subsets, args.subset_size, args.trace_dir)
    geometry = args.geometry
    shapes = [Shapes(g, args.max_requests, geometry) for g in groups]
    cells = []
    for s, sh in enumerate(shapes):
        for n in checkpoints:
            pool = n * CHECKPOINT_PAGES
            for m in multiples:
                picked = pick_shape(sh, pool, m)
                if picked is None:
                    print(f"subset {s}: {n} checkpoints x {m}: no shape fits", flush=True)
                    continue
                tpi, in_flight, got = picked
                convs, w = sh.workload(tpi, in_flight)
                cells += at_pool_offsets(
                    dict(subset=s, checkpoints=n, multiple=m, tokens_per_id=tpi,
                         **({} if geometry == GEOMETRY else {"geometry": geometry}),
                         in_flight=in_flight, pool_pages=pool, live_pages=w.working_set,
                         real_multiple=got, oracle=sum(w.oracle),
                         prompt_tokens=sum(map(len, w.sent)), cached={}), offsets)
    return groups, shapes, cells


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_grid_arguments(ap)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--planner", action="store_true",
                    help="the replay planner's model of each policy (core/shared_pool_manager.py) "
                         "instead of vLLM's scheduler: seconds, exact where the model is "
                         "(BENCHMARKS.md, 'The planner against vLLM's scheduler')")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="vLLM's max_num_seqs (default: each cell's requests in flight; a "
                         "server left at vLLM's default runs 128 to 1,024)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", metavar="JSON", default=None,
                    help="print an earlier run's --json as markdown tables, run nothing")
    args = ap.parse_args(argv)
    if args.markdown:
        data = json.loads(Path(args.markdown).read_text())
        print_markdown(data["cells"], data["args"]["policies"].split(","),
                       len(data["subsets"]))
        return 0
    policies = args.policies.split(",")
    for p in policies:
        if p not in E.POLICIES and p != PAGED_BOUND:
            ap.error(f"unknown policy {p!r}")
    policies.sort(key=lambda p: p in E.PLUGIN_POLICIES)   # plugin runs last
    groups, shapes, cells = grid_cells(args)
    t0 = time.monotonic()
    for policy in policies:
        for cell in cells:
            convs, w = shapes[cell["subset"]].workload(cell["tokens_per_id"], cell["in_flight"])
            if policy == PAGED_BOUND:
                cell["cached"][policy] = E.paged_reuse_bound(
                    w.sent, w.oracle, [len(r) for r in w.rounds],
                    shapes[cell["subset"]].block, cell["pool_pages"])
            elif args.planner:
                cell["cached"][policy] = planner_cached(policy, convs, w, cell,
                                                        args.max_num_seqs)
            else:
                # +1: vLLM's null block
                run = E.run_policy(policy, convs, w.rounds, cell["pool_pages"] + 1,
                                   w.max_model_len, cell.get("geometry", GEOMETRY),
                                   scheduler_only=True,
                                   max_num_seqs=args.max_num_seqs or cell["in_flight"])
                cell["cached"][policy] = sum(run["cached"])
            print(f"subset {cell['subset']} {cell['checkpoints']:>5} ckpt x{cell['multiple']:<5}"
                  f"{cell.get('pool_offset', 0):+.2f} "
                  f"({cell['real_multiple']:.2f}, {cell['tokens_per_id']}x{cell['in_flight']}) "
                  f"{policy:<18} {cell['cached'][policy] / cell['oracle']:.4f}  "
                  f"[{time.monotonic() - t0:.0f} s]", flush=True)
    print_table(cells, policies, len(groups))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": dict(vars(args), trace_dir=str(args.trace_dir)),
             # the plugin's settings a run was given (`load_settings` reads them)
             "atom_env": {k: v for k, v in os.environ.items() if k.startswith("ATOM_")},
             "subsets": [[p.stem for p in g] for g in groups],
             "cells": cells}, indent=1) + "\n")
    return 0


# policy -> (hash unit, the plugin's placement and release, its admission
# order: None, the server's ATOM_ADMISSION_ORDER) in the planner
PLANNER_POLICIES = {"native": (None, False, None), "native-pmu64": (64, False, None),
                    "plugin": (64, True, None), "plugin-block-unit": (None, True, None),
                    "plugin-hits-first": (64, True, "hits-first")}


def planner_cached(policy: str, convs, w, cell, max_num_seqs=None, manager_class=None) -> int:
    """The planner's cached tokens for `policy` in this cell (vLLM's
    `max_num_seqs`: None, the cell's requests in flight; `manager_class`: what
    makes the manager instead of SharedPoolManager, with its arguments, e.g.
    one that records)."""
    import planner_agreement as A
    from atom_hybrid_cache.config import load_settings, server_defaults
    from atom_hybrid_cache.core.manager import Request
    from atom_hybrid_cache.core.shared_pool_manager import SharedPoolManager
    from atom_hybrid_cache.core.shared_pool_shape import SharedPoolShape
    from atom_hybrid_cache.replay.simulator import SimSettings, simulate

    block = E.GEOMETRIES[cell.get("geometry", GEOMETRY)]["block_size"]
    unit, plugin, order = PLANNER_POLICIES[policy]
    unit = unit or block
    settings = load_settings(None, server_defaults())
    shape = SharedPoolShape(num_pages=cell["pool_pages"] + 1, page_tokens=block, hash_unit=unit,
                            pages_per_state=CHECKPOINT_PAGES,
                            max_num_seqs=max_num_seqs or cell["in_flight"],
                            step_tokens=A.STEP_TOKENS)
    mgr = (manager_class or SharedPoolManager)(
        shape, settings.placement, floor_fractions=settings.server.floor_fractions, plugin=plugin,
        admission_gate=settings.server.admission_gate,
        admission_order=order or settings.server.admission_order)
    conversations = [A._Conversation(c["id"], c["prompts"]) for c in convs]
    sim = SimSettings(concurrency=cell["in_flight"], prefill_chunk=A.STEP_TOKENS,
                      block_size=unit, max_model_len=1 << 40, lockstep=True, max_output=1)
    totals = simulate(conversations, A.TokenSource(), mgr,
                      lambda rid, n, hashes, tuples: Request(rid, n, hashes, tuples), sim)
    return totals.cached_tokens


def print_table(cells, policies, n_subsets) -> None:
    natives = [p for p in policies if p.startswith("native")]
    for s in range(n_subsets):
        print(f"\nsubset {s}: cached / oracle")
        print(f"{'ckpt':>5} {'x':>5} {'got':>5} {'shape':>6} "
              + " ".join(f"{p:>17}" for p in policies) + "  plugin - best native")
        for c in (c for c in cells if c["subset"] == s):
            r = {p: c["cached"][p] / c["oracle"] for p in policies if p in c["cached"]}
            gap = (r["plugin"] - max(r[p] for p in natives)
                   if "plugin" in r and natives else float("nan"))
            print(f"{c['checkpoints']:>5} {c['multiple']:>5} {c['real_multiple']:>5.2f} "
                  f"{c['tokens_per_id']:>3}x{c['in_flight']:<2} "
                  + " ".join(f"{r.get(p, float('nan')):>17.4f}" for p in policies)
                  + f"  {gap:+.4f}")


def print_markdown(cells, policies, n_subsets) -> None:
    """One table a subset, and the count of cells where the plugin is
    below the better native."""
    natives = [p for p in policies if p.startswith("native")]
    below = total = 0
    for s in range(n_subsets):
        print(f"\nSubset {s}:\n")
        print("| checkpoints | pool / live | shape | " + " | ".join(policies)
              + " | plugin - best native |")
        print("|---" * (len(policies) + 4) + "|")
        for c in (c for c in cells if c["subset"] == s):
            r = {p: c["cached"][p] / c["oracle"] for p in policies if p in c["cached"]}
            gap = r["plugin"] - max(r[p] for p in natives)
            total += 1
            below += gap < -0.00005
            print(f"| {c['checkpoints']} | {c['multiple']} ({c['real_multiple']:.2f}) | "
                  f"{c['tokens_per_id']}x{c['in_flight']} | "
                  + " | ".join(f"{r[p]:.4f}" for p in policies) + f" | {gap:+.4f} |")
    print(f"\nplugin below the better native in {below} of {total} cells")


if __name__ == "__main__":
    raise SystemExit(main())
