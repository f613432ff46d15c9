"""Where agentic clients rewrite a conversation, in the shared cc traces.

A request that does not continue its conversation's previous prompt (its
trace ids leave that prompt more than one block before its end) is a
rewrite: a compaction, a retry, an edited message. Its reusable prefix is
the longest one it shares with any earlier prompt of its conversation, and
a hybrid model resumes it only on a state at or below that length. This
script says where those prefixes end: inside the conversation's first
prompt (where only a state inside that prompt saves them), above it, or at
0; how far from the trace's system prompt and tools (`system_tokens +
tool_tokens`) they end; and how much of the inside-first tokens a cold
ladder (states at fixed fractions of the first prompt,
`ATOM_STATE_CHECKPOINT_COLD`) would let a resume keep, if its states
survived.

The traces are split as the e2e benchmarks split them, by their largest
prompt: under 64k tokens (the plan's 14), 64k-128k (the 54 held out from
tuning), and the rest.

    python3 benchmarks/rewrite_study.py [TRACE_DIR] [--ladders "0.5,0.875;0.875"]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import NamedTuple, Sequence

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE_DIR = ROOT.parent / "shared" / "traces" / "cc-traces"
GROUPS = (("plan (<64k)", 64_000), ("held out (64k-128k)", 128_000), ("rest", None))
DEFAULT_LADDERS = "0.875;0.5;0.5,0.875;0.5,0.75,0.875;0.25,0.5,0.75,0.875"


class Rewrite(NamedTuple):
    """One rewrite, in tokens: the prefix it shares with its conversation's
    earlier prompts, its first prompt's length, the previous prompt's."""

    shared: int
    first: int
    previous: int


def common_prefix(a: Sequence, b: Sequence) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


def rewrites(prompts: Sequence[Sequence[int]], block: int = 64) -> list[Rewrite]:
    """The rewrites of one conversation, given each prompt's trace ids in
    order. A prompt continues the previous one when it keeps all of its ids
    but the last (the traces change that block when the prompt ends on it)."""
    out = []
    for i in range(1, len(prompts)):
        previous = prompts[i - 1]
        if common_prefix(previous, prompts[i]) >= len(previous) - 1:
            continue
        shared = max(common_prefix(prompts[j], prompts[i]) for j in range(i))
        out.append(Rewrite(shared * block, len(prompts[0]) * block, len(previous) * block))
    return out


def ladder_keeps(found: Sequence[Rewrite], ladder: Sequence[float]) -> float:
    """Of the tokens the inside-first rewrites share, the part a state at
    the highest ladder fraction at or below each would let it resume on."""
    inside = [r for r in found if 0 < r.shared <= r.first]
    total = sum(r.shared for r in inside)
    kept = sum(max((f * r.first for f in ladder if f * r.first <= r.shared), default=0.0)
               for r in inside)
    return kept / total if total else 0.0


def deciles(values: Sequence[float]) -> list[float]:
    return statistics.quantiles(values, n=10) if len(values) > 3 else list(values)


def study(trace_dir: Path, ladders: list[tuple[float, ...]]) -> dict:
    sys.path.insert(0, str(ROOT))
    from atom_hybrid_cache.replay.traces import load_traces

    groups = {name: dict(conversations=0, rewrites=[], header_gap=[]) for name, _ in GROUPS}
    for path in sorted(trace_dir.glob("*.json")):
        convs = [c for c in load_traces(path) if c.requests]
        largest = max(r.prompt_len for c in convs for r in c.requests)
        name = next(n for n, limit in GROUPS if limit is None or largest < limit)
        meta = json.loads(path.read_text())
        header = meta.get("system_tokens", 0) + meta.get("tool_tokens", 0)
        g = groups[name]
        for conv in convs:
            if len(conv.requests) < 2:
                continue
            g["conversations"] += 1
            found = rewrites([r.trace_block_ids for r in conv.requests], conv.trace_block_size)
            g["rewrites"] += found
            g["header_gap"] += [r.shared - header for r in found if 0 < r.shared <= r.first]
    report = {}
    for name, g in groups.items():
        found = g["rewrites"]
        inside = [r for r in found if 0 < r.shared <= r.first]
        report[name] = dict(
            conversations=g["conversations"], rewrites=len(found), inside_first=len(inside),
            at_zero=sum(1 for r in found if r.shared == 0),
            tokens_inside_first=sum(r.shared for r in inside),
            tokens_above_first=sum(r.shared for r in found if r.shared > r.first),
            above_first_dropped_deciles=[int(x) for x in deciles(
                [r.previous - r.shared for r in found if r.shared > r.first])],
            fraction_of_first_deciles=[round(x, 2) for x in deciles(
                [r.shared / r.first for r in inside])],
            header_gap_deciles=[int(x) for x in deciles(g["header_gap"])],
            ladder_keeps={",".join(map(str, lad)): round(ladder_keeps(found, lad), 3)
                          for lad in ladders})
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace_dir", nargs="?", type=Path, default=DEFAULT_TRACE_DIR)
    ap.add_argument("--ladders", default=DEFAULT_LADDERS,
                    help="semicolon-separated comma lists of fractions")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    ladders = [tuple(float(x) for x in s.split(",")) for s in args.ladders.split(";")]
    report = study(args.trace_dir, ladders)
    for name, r in report.items():
        print(f"{name}: {r['conversations']} conversations of 2+ requests, "
              f"{r['rewrites']} rewrites: {r['inside_first']} inside the first prompt "
              f"({r['tokens_inside_first']:,} shared tokens), {r['at_zero']} at 0, the rest "
              f"above it ({r['tokens_above_first']:,})")
        print(f"  inside-first, shared / first prompt, deciles: {r['fraction_of_first_deciles']}")
        print(f"  inside-first, shared - (system + tool tokens), deciles: "
              f"{r['header_gap_deciles']}")
        print(f"  above it, tokens of the previous prompt dropped, deciles: "
              f"{r['above_first_dropped_deciles']}")
        print("  cold checkpoints keep of the inside-first tokens: " + ", ".join(
            f"{k} {v}" for k, v in r["ladder_keeps"].items()))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
