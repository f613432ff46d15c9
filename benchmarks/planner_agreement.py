#!/usr/bin/env python3
"""The replay planner against vLLM's real scheduler, at the same points.

Both see the same workload: `e2e_pressure.py`'s conversations (its ELIDE or
SCALE rule, the tiny model's token ids), sent in its lock-step rounds of
`--in-flight` conversations with `max_tokens=1`, into a pool of the same
number of pages (`e2e_pressure.budget_blocks` of the same multiples). The
planner runs `core.shared_pool_manager.SharedPoolManager` (the plugin's
placement and release over one page pool; `native`: the same model as
vLLM's own align mode) in `replay.simulator`'s lock-step mode, with vLLM's
`max_num_batched_tokens` (2,048) as its step budget. The scheduler's
figures are `e2e_pressure.py --scheduler-only`'s, run here
(`--run-scheduler`) or read from its JSON (`--scheduler-json`).

    python3 benchmarks/planner_agreement.py --run-scheduler \\
        --pool-multiples 1.25,1.0,0.83 --json benchmarks/results/planner_agreement.json

Figures are cached tokens over e2e_pressure's oracle (the longest prefix
shared with a prompt of an earlier round).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_pressure as E  # noqa: E402

# e2e_pressure's engines: max_num_batched_tokens, and the tiny model's
# Gated-DeltaNet layers (one state group each)
STEP_TOKENS = 2048
STATE_GROUPS = E.MAMBA_GROUPS
POLICIES = ("plugin", "native")
# what the planner models: also the plugin with its gate forced on or off
MODELLED = (*POLICIES, "plugin-gated", "plugin-ungated", "plugin-hits-first",
            "plugin-gated-hits-first", "plugin-ungated-hits-first")


class _Request:
    __slots__ = ("prompt_len", "output_len")

    def __init__(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.output_len = 1


class _Conversation:
    def __init__(self, conversation_id, prompts) -> None:
        self.conversation_id = conversation_id
        self.prompts = prompts
        self.requests = [_Request(len(p)) for p in prompts]


class TokenSource:
    """`prompt_hashes.BlockSource` over prompts given as token ids."""

    def prompt_block_tuples(self, conv, i: int, block_size: int) -> tuple[list, int]:
        p = conv.prompts[i]
        n = len(p) // block_size
        return [tuple(p[j * block_size:(j + 1) * block_size]) for j in range(n)], len(p)


def planner_cached(policy: str, convs, num_pages: int, block: int, in_flight: int,
                   speculative_state_pages: int = 0) -> int:
    """Cached tokens of the planner's model of `policy` on this workload
    (`speculative_state_pages`: vLLM's num_speculative_blocks, k with
    speculative decoding's 1 + k states)."""
    from atom_hybrid_cache.config import load_settings, server_defaults
    from atom_hybrid_cache.core.manager import Request
    from atom_hybrid_cache.core.shared_pool_manager import SharedPoolManager
    from atom_hybrid_cache.core.shared_pool_shape import SharedPoolShape
    from atom_hybrid_cache.replay.simulator import SimSettings, simulate

    plugin = policy.startswith("plugin")
    unit = min(64, block) if plugin else block
    # e2e_pressure exports ATOM_ADMISSION_GATE for its gated policies (and
    # leaves it set): the gate is the policy's, else the server's default
    settings = load_settings(None, server_defaults(), environ={
        k: v for k, v in os.environ.items() if k != "ATOM_ADMISSION_GATE"})
    gate = E._gate_setting(policy) or settings.server.admission_gate
    # (the order is the policy's alone: e2e_pressure sets or clears it)
    order = "hits-first" if policy.endswith("hits-first") else "arrival"
    shape = SharedPoolShape(num_pages=num_pages, page_tokens=block, hash_unit=unit,
                            pages_per_state=STATE_GROUPS, max_num_seqs=in_flight,
                            step_tokens=STEP_TOKENS,
                            speculative_state_pages=speculative_state_pages)
    mgr = SharedPoolManager(shape, settings.placement,
                            floor_fractions=settings.server.floor_fractions, plugin=plugin,
                            admission_gate=gate, admission_order=order)
    conversations = [_Conversation(c["id"], c["prompts"]) for c in convs]
    sim = SimSettings(concurrency=in_flight, prefill_chunk=STEP_TOKENS, block_size=unit,
                      max_model_len=1 << 40, lockstep=True, max_output=1)
    totals = simulate(conversations, TokenSource(), mgr,
                      lambda rid, n, hashes, tuples: Request(rid, n, hashes, tuples), sim)
    return totals.cached_tokens


def checkpoints_worth(pages: int, block: int) -> int:
    """The pool's size in checkpoints (`core.pool_budget`, as the plugin
    sizes it: a checkpoint costs a page per state group)."""
    from atom_hybrid_cache.core.pool_budget import pool_checkpoints
    return pool_checkpoints((pages - 1) * block, STATE_GROUPS * block)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="*", default=None)
    E.add_trace_dir_argument(ap)
    ap.add_argument("--traces-fitting", type=int, default=None, metavar="TOKENS")
    ap.add_argument("--tokens-per-id", type=int, default=None)
    ap.add_argument("--max-prompt", type=int, default=2000)
    ap.add_argument("--head", type=int, default=256)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--geometry", choices=sorted(E.GEOMETRIES), default="default")
    ap.add_argument("--pool-multiples", default="1.25,1.0,0.83")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--run-scheduler", action="store_true",
                    help="run e2e_pressure's scheduler-only replay for the comparison")
    ap.add_argument("--scheduler-json", type=Path, default=None,
                    help="an e2e_pressure --scheduler-only --json of the same workload")
    ap.add_argument("--run-model", default="", metavar="MULTIPLES",
                    help="also the e2e run with the model (e2e_pressure without "
                         "--scheduler-only) at these pool multiples, e.g. 1.0,0.83")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    model_at = {float(x) for x in args.run_model.split(",") if x}
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in MODELLED:
            ap.error(f"--policies: the planner models {', '.join(MODELLED)}, not {p!r}")
    block = E.GEOMETRIES[args.geometry]["block_size"]
    paths = (E.traces_fitting(args.traces_fitting, args.trace_dir)
             if args.traces_fitting is not None else E.resolve_trace_paths(args.traces,
                                                                           args.trace_dir))
    convs = E.build_workload(paths, args.max_prompt, args.head, None, args.tokens_per_id)
    w = E.lockstep_workload(convs, args.in_flight, block)
    oracle = sum(w.oracle)
    known = {}
    if args.scheduler_json is not None:
        data = json.loads(args.scheduler_json.read_text())
        known = {(r["multiple"], r["policy"]): r["cached_tokens"] for r in data["results"]}
    rows = []
    for m in [float(x) for x in args.pool_multiples.split(",") if x]:
        pages = E.budget_blocks(m, w.working_set, w.single_request)
        for policy in policies:
            t0 = time.monotonic()
            planned = planner_cached(policy, convs, pages, block, args.in_flight)
            t1 = time.monotonic()
            real = known.get((m, policy))
            if real is None and args.run_scheduler:
                run = E.run_policy(policy, convs, w.rounds, pages, w.max_model_len,
                                   args.geometry, scheduler_only=True)
                real = sum(run["cached"])
            model = None
            if m in model_at:
                model = sum(E.run_policy(policy, convs, w.rounds, pages, w.max_model_len,
                                         args.geometry)["cached"])
            row = dict(multiple=m, pages=pages, policy=policy, oracle=oracle,
                       checkpoints=checkpoints_worth(pages, block),
                       planner_cached=planned, planner=round(planned / oracle, 4),
                       planner_s=round(t1 - t0, 2), scheduler_cached=real,
                       scheduler=None if real is None else round(real / oracle, 4),
                       model_cached=model,
                       model=None if model is None else round(model / oracle, 4))
            rows.append(row)
            print(f"x{m:<5} {pages:5d} pages {policy:8s} planner {row['planner']:.4f} "
                  f"({planned})  scheduler {row['scheduler']} ({real})  model {row['model']} "
                  f"({model})", flush=True)
    print()
    print("| pool / live set | pages | checkpoints' worth | policy | planner | scheduler-only "
          "replay | e2e (model) | difference |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        diff = "" if r["scheduler"] is None else f"{(r['planner'] - r['scheduler']) * 100:+.2f} pt"
        print(f"| {r['multiple']}x | {r['pages']} | {r['checkpoints']} | {r['policy']} | "
              f"{r['planner']:.4f} | {r['scheduler'] if r['scheduler'] is not None else '-'} | "
              f"{r['model'] if r['model'] is not None else '-'} | {diff} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "oracle_tokens": oracle, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
