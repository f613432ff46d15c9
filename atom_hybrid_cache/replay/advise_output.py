"""What `atom-hybrid-cache advise` prints: the table of candidates, the
recommendation with its `vllm serve` line, and the subcommand itself
(`advise.py` runs the grid).
"""

from __future__ import annotations

import shlex
import sys
import time

from ..config import ENV_VARS, server_defaults
from .advise import MIN_GAIN, Advice, NativeOutcome, Outcome, advise, best_native
from .advise_grid import (ORDER_AXES, PAGE_UNIT, PLACEMENT_AXES, PLUGIN_HASH_UNIT, SERVER_AXES,
                          Candidate, env_var, format_value)

# Hugging Face names of the geometry presets, for the printed serve line.
SERVED_MODEL = {
    "qwen3.5-27b": "Qwen/Qwen3.5-27B",
    "qwen3-next-80b": "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "kimi-linear-48b": "moonshotai/Kimi-Linear-48B-A3B-Instruct",
}


def serve_line(candidate: Candidate, model: str, page_tokens: int) -> str:
    """The `vllm serve` command that runs `candidate`."""
    env = " ".join(f"{var}={shlex.quote(value)}" for var, value in candidate.env)
    unit = f" --prefix-match-unit {page_tokens}" if candidate.hash_unit == PAGE_UNIT else ""
    return (f"VLLM_PLUGINS=atom_hybrid_cache {env + ' ' if env else ''}vllm serve "
            f"{SERVED_MODEL.get(model, model)} --enable-prefix-caching{unit}")


def native_serve_line(native: NativeOutcome, model: str, page_tokens: int) -> str:
    """The `vllm serve` command of vLLM's own caching, without the plugin."""
    unit = f" --prefix-match-unit {native.unit}" if native.unit != page_tokens else ""
    return f"vllm serve {SERVED_MODEL.get(model, model)} --enable-prefix-caching{unit}"


def native_label(native: NativeOutcome, page_tokens: int) -> str:
    return (f"the page ({page_tokens} tokens, vLLM's default)" if native.unit == page_tokens
            else f"{native.unit} tokens (--prefix-match-unit {native.unit})")


def native_rows(a: Advice) -> list[str]:
    """vLLM's own caching beside the table: what the plugin is for."""
    header = ["vLLM without the plugin, hashing on", "hit", "hit/ceil", "band (halves)",
              "vs defaults"]
    rows = []
    for n in a.native:
        ratio, band = n.over(a.ceilings)
        rows.append([native_label(n, a.page_tokens), f"{n.full:.2%}", f"{ratio:.4f}",
                     f"{band[0]:.4f}-{band[1]:.4f}", f"{n.full - a.default.full:+.4f}"])
    return aligned(header, rows)


def aligned(header: list, rows: list) -> list[str]:
    """The lines of a table, each column as wide as its widest cell."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
            for r in [header, *rows]]


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
        *([f"client: {a.client}"] if a.client else []),
        "",
    ]
    swept = {v for o in a.outcomes for v, _ in o.candidate.env}
    axes = PLACEMENT_AXES + tuple(ax for ax in SERVER_AXES + ORDER_AXES
                                  if env_var(ax[1], ax[2]) in swept)
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
    lines += aligned(header, rows)
    lines.append("(* the default; hit: cached / prompt tokens of the whole set; hit/ceil: over "
                 "the ceiling; band: hit/ceil's min-max over the halves; vs defaults: hit)")
    if any(o.over(a.ceilings)[0] > 1 for o in a.outcomes):
        lines.append("(hit/ceil above 1: the ceiling, an attention-only run in the planner's "
                     "separate-pools model, thrashes at this pool; read the hit column)")
    lines.append("")
    defaults = server_defaults()

    def listed(fields) -> str:
        # (section, field): a server axis may be a placement setting
        return ", ".join(f"{env_var(*f)} "
                         f"({format_value(getattr(getattr(defaults, f[0]), f[1])) or 'none'})"
                         for f in fields)
    unswept = [(ax[1], ax[2]) for ax in SERVER_AXES + ORDER_AXES
               if env_var(ax[1], ax[2]) not in swept]
    if unswept:
        lines.append(f"not swept, run by the planner at default: {listed(unswept)}")
    if a.native:
        lines += native_rows(a) + [""]
    d = a.default
    if a.native_better is not None:
        n = a.native_better
        lines += [f"recommended: vLLM's own prefix caching, without the plugin, hashing on "
                  f"{native_label(n, a.page_tokens)}: it beats the plugin's best setting "
                  f"({a.recommended.candidate.label()}) by {n.full - a.recommended.full:+.4f} "
                  f"of prompt tokens, on both halves",
                  f"  expect {describe(n, a.ceilings)}",
                  f"  {native_serve_line(n, model, a.page_tokens)}",
                  f"the plugin's best: {describe(a.recommended, a.ceilings)}"]
    else:
        if a.recommended is d:
            lines.append(f"recommended: the defaults (no candidate beats them by at least "
                         f"{MIN_GAIN} and by more than its gains on the halves stray from it)")
        else:
            lines.append(f"recommended: {a.recommended.candidate.label()}")
            lines.append(f"  expect {describe(a.recommended, a.ceilings)}; {a.gain:+.4f} of "
                         f"prompt tokens over the defaults (noise {a.noise:.4f})")
        lines.append(f"  {serve_line(a.recommended.candidate, model, a.page_tokens)}")
        if a.lighter is not None:
            gain = a.lighter.full - a.recommended.full
            lines += [f"lighter: the same without the admission gate, the floor states and "
                      f"priced eviction ({gain:+.4f} of prompt tokens, less than {MIN_GAIN} "
                      f"lost on either half too): here they buy no hit and still cost "
                      f"scheduler step time (BENCHMARKS.md, \"What each admission part "
                      f"costs\")",
                      f"  expect {describe(a.lighter, a.ceilings)}",
                      f"  {serve_line(a.lighter.candidate, model, a.page_tokens)}"]
    lines.append(f"defaults: {describe(d, a.ceilings)}")
    alone = best_native(a.native)
    if a.native_better is None and alone is not None and alone.full - d.full >= MIN_GAIN:
        lines.append(f"note: vLLM alone, hashing on {native_label(alone, a.page_tokens)}, beats "
                     f"the plugin's defaults by {alone.full - d.full:+.4f} of prompt tokens here; "
                     f"the recommendation beats it by {a.recommended.full - alone.full:+.4f}")
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
                        time_scale=args.time_scale, jobs=args.jobs, progress=progress)
    finally:
        for bar in bars:
            bar.close()
    print(format_advice(advice, model=geometry.name, memory_gib=args.memory_gib,
                        concurrency=args.concurrency))
    print(f"elapsed: {time.perf_counter() - t0:.1f} s")
    return 0
