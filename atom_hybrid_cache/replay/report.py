"""Presenting replay results: a text table, a JSON file and a sweep plot.

`PolicyResult` is the one record the simulator hands back per policy; this
module only formats it. Nothing here runs a simulation, and matplotlib is
imported only inside `plot_sweep`, so importing `PolicyResult` stays cheap.

Ratios are stored as fractions in [0, 1]; the table shows them as percentages.
A ratio with a zero denominator (no resumed hit, a zero ceiling) may arrive as
NaN or infinity: the table prints it as ``n/a`` and the JSON writes ``null``,
because bare ``NaN`` is not valid JSON.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

FATE_KEYS = ("kept", "dropped", "evicted", "orphaned")


@dataclass
class PolicyResult:
    """What one policy achieved on one replayed workload.

    hit_rate          cached prompt tokens / prompt tokens of admitted requests
    ceiling_hit_rate  the same for the kv-only-ceiling policy: the same KV pool with a
                      free state at every block (attention-only with these bytes)
    hit_over_ceiling  hit_rate / ceiling_hit_rate
    paged_hit         KV-prefix-present tokens / reusable tokens
    state_hit         cached tokens / KV-prefix-present tokens
    fates             checkpoint fates: kept, dropped, evicted, orphaned
    over_context_*    requests longer than the model's context, counted apart
                      and not simulated
    resume_at_*_share where resumed hits landed: on a previous prompt's end, or
                      on a ladder rung (interval checkpoint)
    """

    policy: str
    hit_rate: float
    ceiling_hit_rate: float
    hit_over_ceiling: float
    paged_hit: float
    state_hit: float
    writes_per_resumed_hit: float
    checkpoint_writes: int
    resumed_hits: int
    fates: dict[str, int]
    prefill_tokens_computed: int
    prompt_tokens: int
    requests: int
    over_context_requests: int
    over_context_tokens: int
    resume_at_prompt_end_share: float
    resume_at_ladder_rung_share: float
    kv_blocks: int
    state_slots: int
    block_size: int
    elapsed_s: float
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-ready copy (non-finite floats become None)."""
        return _json_safe(asdict(self))


# --------------------------------------------------------------------------
# Text table
# --------------------------------------------------------------------------

_HEADERS = (
    "policy",
    "hit",
    "ceiling",
    "hit/ceil",
    "state-hit",
    "writes/resumed hit",
    "kept/dropped/evicted/orphaned",
    "prefill tokens computed",
    "kv blocks",
    "state slots",
)
# The policy name and the fates read best left-aligned; numbers right-aligned.
_LEFT_ALIGNED = {0, 6}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _pct(x: float) -> str:
    return f"{100.0 * x:.2f}%" if _finite(x) else "n/a"


def _ratio(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if _finite(x) else "n/a"


def _count(x: int) -> str:
    return f"{int(x):,}"


def _fates(fates: dict[str, int]) -> str:
    return "/".join(_count(fates.get(k, 0)) for k in FATE_KEYS)


def _row(r: PolicyResult) -> list[str]:
    return [
        r.policy,
        _pct(r.hit_rate),
        _pct(r.ceiling_hit_rate),
        _ratio(r.hit_over_ceiling),
        _pct(r.state_hit),
        _ratio(r.writes_per_resumed_hit, 2),
        _fates(r.fates),
        _count(r.prefill_tokens_computed),
        _count(r.kv_blocks),
        _count(r.state_slots),
    ]


def _workload_footer(results: Sequence[PolicyResult]) -> list[str]:
    first = results[0]
    lines = [
        f"requests={_count(first.requests)} (prompt tokens {_count(first.prompt_tokens)}); "
        f"over-context: {_count(first.over_context_requests)} requests / "
        f"{_count(first.over_context_tokens)} tokens (counted apart, not simulated)"
    ]
    over_pool = [r for r in results if r.extra.get("over_pool_requests")]
    if over_pool:
        # refused at admission with the pool to themselves, or preempted
        # twice so (replay.simulator): what such a pool cannot serve
        lines.append("larger than the pool (not served): " + ", ".join(
            f"{r.policy} {_count(r.extra['over_pool_requests'])}" for r in over_pool))
    # Every policy replays the same workload; say so if that ever breaks.
    workload = {(r.requests, r.over_context_requests, r.over_context_tokens) for r in results}
    if len(workload) > 1:
        lines.append(
            "note: policies saw different request counts: "
            + ", ".join(
                f"{r.policy}={_count(r.requests)}/{_count(r.over_context_requests)}"
                for r in results
            )
        )
    lines.append(
        "resume landing (prompt end / ladder rung): "
        + ", ".join(
            f"{r.policy} {_pct(r.resume_at_prompt_end_share)} / "
            f"{_pct(r.resume_at_ladder_rung_share)}"
            for r in results
        )
    )
    # what every ratio above is taken over, and the hit rate over all input
    # (the over-context requests and those a pool never admitted counted as
    # misses: the same input for every policy)
    def all_input(r: PolicyResult) -> int:
        return r.prompt_tokens + r.over_context_tokens + r.extra.get("over_pool_tokens", 0)
    ceiling = next((r for r in results if r.policy == "kv-only-ceiling"), None)
    pool = (f"kv-only-ceiling: its KV pool ({_count(ceiling.kv_blocks)} blocks x "
            f"{ceiling.block_size} tokens) with a free state at every block"
            if ceiling is not None else "no kv-only-ceiling run")
    # the one-pool models hash prefixes on their own unit (runner.run_spec)
    units = ", ".join(f"{r.policy} {r.extra['hash_unit']}" for r in results
                      if r.extra.get("hash_unit"))
    lines.append(
        f"basis: hit = cached / prompt tokens of the {_count(first.requests)} requests "
        f"simulated (over-context ones excluded); ceiling = {pool}; "
        + (f"prefix hash unit (tokens): {units}; " if units else "")
        + "hit over all input: "
        + ", ".join(f"{r.policy} {_pct(_share(r.hit_rate * r.prompt_tokens, all_input(r)))}"
                    for r in results)
    )
    return lines


def _share(part: float, whole: int) -> float:
    return part / whole if whole else 0.0


def format_table(results: Sequence[PolicyResult], title: str = "") -> str:
    """Aligned text table, one row per policy, with a workload footer."""
    out: list[str] = []
    if title:
        out.append(title)
    if not results:
        out.append("(no results)")
        return "\n".join(out)

    rows = [list(_HEADERS)] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEADERS))]

    def render(row: list[str]) -> str:
        cells = [
            cell.ljust(w) if i in _LEFT_ALIGNED else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ]
        return "  ".join(cells).rstrip()

    header = render(rows[0])
    out.append(header)
    out.append("-" * len(header))
    out.extend(render(row) for row in rows[1:])
    out.extend(_workload_footer(results))
    return "\n".join(out)


# --------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(
    results: Iterable[PolicyResult], path: str | os.PathLike, meta: dict | None = None
) -> str:
    """Write ``{"meta": meta, "policies": [...]}`` to ``path``; return the path."""
    doc = {
        "meta": _json_safe(dict(meta or {})),
        "policies": [r.to_dict() for r in results],
    }
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        # default=str: a stray Path or enum in meta is written, not fatal.
        json.dump(doc, f, indent=2, sort_keys=False, allow_nan=False, default=str)
        f.write("\n")
    return path


# --------------------------------------------------------------------------
# Sweep plot
# --------------------------------------------------------------------------


def plot_sweep(
    points: dict[str, list[tuple[int, float]]],
    path: str | os.PathLike,
    title: str = "",
    xlabel: str = "checkpoint headroom (state slots)",
) -> str:
    """Plot hit/ceiling against a swept setting, one line per policy.

    ``points`` maps a policy name to ``(x, hit_over_ceiling)`` pairs in any
    order (x: headroom slots, or the memory in GiB with ``xlabel`` saying
    so). Non-finite y values are skipped. Writes a PNG with
    the Agg backend (no display needed) and returns the path.
    """
    # The object API with an explicit Agg canvas: no pyplot global state and
    # no dependence on whatever backend the caller's environment selected.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)

    ys_all: list[float] = []
    for policy, pts in points.items():
        clean = sorted((float(x), float(y)) for x, y in pts if _finite(y))
        if not clean:
            continue
        xs = [x for x, _ in clean]
        ys = [y for _, y in clean]
        ys_all.extend(ys)
        ax.plot(xs, ys, marker="o", linewidth=1.6, markersize=4, label=policy)

    if ys_all:
        ax.set_ylim(0.0, max(1.0, max(ys_all)) * 1.05)
        ax.legend(loc="lower right", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("hit rate / ceiling")
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()

    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    fig.savefig(path, format="png")
    return path
