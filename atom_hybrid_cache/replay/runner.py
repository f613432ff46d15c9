"""`atom-hybrid-cache replay`: run traces through every policy side by side."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import sys
import time
from typing import Optional

from ..config import MAX_HASH_UNIT_TOKENS, PlacementConfig, load_settings, server_defaults
from ..core.hash_unit import largest_unit_dividing
from ..core.manager import HybridCacheManager, Request
from ..core.replay_pool_config import DEFAULT_HEADROOM_PER_SEQ
from ..core.shared_pool_manager import SharedPoolManager
from ..core.shared_pool_shape import SharedPoolShape
from .policies import PolicySpec, build_policies, parse_policy_names
from .report import PolicyResult, format_table, plot_sweep, write_json
from .client_clock import DECODE_S_PER_STEP, MAX_THINK_S, PREFILL_S_PER_TOKEN, ClientClock
from .simulator import SimSettings, SimTotals, simulate

GIB = 1 << 30


def default_headroom(max_num_seqs: int) -> int:
    return DEFAULT_HEADROOM_PER_SEQ * max_num_seqs


@dataclasses.dataclass
class Workload:
    conversations: list
    source: object
    settings: SimSettings


_WORKLOAD: Optional[Workload] = None  # shared with forked workers


def run_spec(spec: PolicySpec, workload: Workload, progress=None) -> tuple[str, SimTotals, dict]:
    s = workload.settings
    if spec.shared_pool is not None:
        # vLLM's own prefix hashes are one page long unless the spec names
        # a unit (`--prefix-match-unit`); the plugin's the spec's unit where
        # it names one (`compare`), else the workload's (advise runs each
        # candidate's on a workload of its own)
        unit = spec.hash_unit or (s.block_size if spec.plugin else spec.page_tokens)
        s = dataclasses.replace(s, block_size=unit)
        shape = SharedPoolShape(num_pages=spec.num_pages, page_tokens=spec.page_tokens,
                                hash_unit=s.block_size, pages_per_state=spec.pages_per_state,
                                max_num_seqs=s.concurrency, step_tokens=s.prefill_chunk,
                                speculative_state_pages=spec.speculative_state_pages)
        mgr = SharedPoolManager(shape, spec.shared_pool, floor_fractions=spec.floor_fractions,
                                plugin=spec.plugin, admission_gate=spec.admission_gate,
                                admission_order=spec.admission_order)
        totals = simulate(workload.conversations, workload.source, mgr, _make_request, s, progress)
        extra = dict(fates=mgr.fates(), writes=mgr.writes, kv_blocks=spec.num_pages,
                     state_slots=0, page_tokens=spec.page_tokens, hash_unit=s.block_size,
                     pages_per_state=spec.pages_per_state, stats=mgr.stats.as_dict())
        return spec.name, totals, extra
    # The replay keeps every hash it saw so `reusable` is exact, and
    # checks the stats nesting strictly.
    mgr = HybridCacheManager(dataclasses.replace(spec.cache, strict_stats=True),
                             oracle_limit=1 << 62)
    totals = simulate(workload.conversations, workload.source, mgr, _make_request, s, progress)
    st = mgr.stats
    extra = dict(fates=mgr.state.fates.as_dict(), writes=st.checkpoint_writes,
                 kv_blocks=spec.cache.num_kv_blocks, state_slots=spec.cache.num_state_slots,
                 stats=st.as_dict(), log_lines=mgr.stats_lines(),
                 kv_evicted=mgr.kv.evicted)
    return spec.name, totals, extra


def _make_request(req_id, prompt_len, hashes, tuples) -> Request:
    return Request(req_id, prompt_len, hashes, tuples)


def _worker(spec: PolicySpec):
    return run_spec(spec, _WORKLOAD)


def run_specs(specs: list[PolicySpec], workload: Workload, jobs: int, show_progress: bool):
    global _WORKLOAD
    _WORKLOAD = workload
    if jobs > 1 and len(specs) > 1 and "fork" in mp.get_all_start_methods():
        ctx = mp.get_context("fork")
        with ctx.Pool(min(jobs, len(specs))) as pool:
            it = pool.imap(_worker, specs)
            out = []
            bar = _bar(len(specs), "policies", show_progress)
            for r in it:
                out.append(r)
                bar.update(1)
            bar.close()
            return out
    out = []
    n_req = sum(len(c.requests) for c in workload.conversations)
    for spec in specs:
        bar = _bar(n_req, spec.name, show_progress)
        out.append(run_spec(spec, workload, bar.update))
        bar.close()
    return out


def _bar(total: int, desc: str, show: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, disable=not show, file=sys.stderr, leave=False)


def to_results(runs, settings: SimSettings) -> list[PolicyResult]:
    by_name = {name: (t, e) for name, t, e in runs}
    ceiling = by_name.get("kv-only-ceiling")
    ceil_hit = _ratio(ceiling[0].cached_tokens, ceiling[0].prompt_tokens) if ceiling else float("nan")
    results = []
    for name, t, e in runs:
        hit = _ratio(t.cached_tokens, t.prompt_tokens)
        resumed = t.resumed_hits
        kinds = t.resume_kinds
        results.append(PolicyResult(
            policy=name, hit_rate=hit, ceiling_hit_rate=ceil_hit,
            hit_over_ceiling=_ratio(hit, ceil_hit),
            paged_hit=_ratio(t.kv_reach_tokens, t.reusable_tokens),
            state_hit=_ratio(t.cached_tokens, t.kv_reach_tokens),
            writes_per_resumed_hit=_ratio(e["writes"], resumed),
            checkpoint_writes=e["writes"], resumed_hits=resumed, fates=e["fates"],
            prefill_tokens_computed=t.prefill_tokens_computed, prompt_tokens=t.prompt_tokens,
            requests=t.requests, over_context_requests=t.over_context_requests,
            over_context_tokens=t.over_context_tokens,
            resume_at_prompt_end_share=_ratio(t.resumes_at_prompt_end, resumed),
            resume_at_ladder_rung_share=_ratio(t.resumes_at_ladder_rung, resumed),
            kv_blocks=e["kv_blocks"], state_slots=e["state_slots"], block_size=settings.block_size,
            elapsed_s=t.elapsed_s,
            extra=dict(resume_kinds=kinds, preemptions=t.preemptions,
                       over_pool_requests=t.over_pool_requests,
                       over_pool_tokens=t.over_pool_tokens, steps=t.steps,
                       client_s=round(t.client_s, 1),
                       **{k: v for k, v in e.items() if k not in ("fates", "writes", "kv_blocks", "state_slots")}),
        ))
    return results


def _ratio(a, b) -> float:
    return a / b if b else float("nan")


def load_workload(args) -> tuple[Workload, object]:
    from .geometry import geometry_from_args
    from .token_expander import TokenExpander
    from .traces import default_sample_paths, load_traces
    overrides = {}
    for name in ("kv_bytes_per_token", "state_slot_bytes", "max_model_len"):
        v = getattr(args, name, None)
        if v is not None:
            overrides[name] = v
    geometry = geometry_from_args(args.model, **overrides)
    # The default run is the agentic workload this project is built for:
    # the embedded cc traces. The Mooncake excerpt (independent requests
    # sharing prefixes, no resume pattern) is there to be named explicitly.
    paths = list(args.traces) or [p for p in default_sample_paths() if p.endswith(".json")]
    conversations = load_traces(paths)
    clock = ClientClock(time_scale=getattr(args, "time_scale", 0.0),
                        max_think_s=getattr(args, "think_cap_s", MAX_THINK_S),
                        prefill_s_per_token=1 / getattr(args, "prefill_tokens_per_s",
                                                        1 / PREFILL_S_PER_TOKEN),
                        decode_s_per_step=getattr(args, "decode_step_ms",
                                                  DECODE_S_PER_STEP * 1e3) / 1e3)
    settings = SimSettings(concurrency=args.concurrency, prefill_chunk=args.prefill_chunk,
                           block_size=args.block_size, max_model_len=geometry.max_model_len,
                           max_requests=args.max_requests, clock=clock)
    return Workload(conversations, TokenExpander(), settings), geometry


def placement_from_args(args) -> PlacementConfig:
    """The core's placement with the exported ATOM_* placement settings
    (ATOM_STATE_CHECKPOINT_SPAN, ...), then the command's flags. A vLLM
    server differs in two defaults: with ATOM_STATE_CHECKPOINT_COLD unset it
    keeps cold checkpoints (`config.SERVER_COLD_FRACTIONS`), which the core's
    own state slots lose with; export the variable to replay it. Its floor
    states (`config.SERVER_FLOOR_FRACTIONS`) hold pages of vLLM's shared
    pool; the core's manager keeps states in slots by tier and does not
    read ATOM_STATE_CHECKPOINT_FLOOR."""
    p = load_settings().placement
    if getattr(args, "interval", None) is not None:
        p = dataclasses.replace(p, interval_tokens=args.interval)
    return p


def server_policy(placement: PlacementConfig) -> dict:
    """The vLLM server's settings for the `default` policy (the plugin as it
    runs): the server's defaults with the exported ATOM_* variables, and the
    interval the command asked for (`placement`'s)."""
    server = load_settings(None, server_defaults())
    return dict(server_placement=dataclasses.replace(
                    server.placement, interval_tokens=placement.interval_tokens),
                floor_fractions=server.server.floor_fractions,
                admission_gate=server.server.admission_gate,
                admission_order=server.server.admission_order)


def compare(workload: Workload, geometry, *, memory_gib: float, policies: list[str],
            headroom: Optional[int], placement: PlacementConfig, num_spec: int = 0,
            jobs: int = 2, show_progress: bool = False, replayssm: bool = False,
            replayssm_cache_len: Optional[int] = None) -> list[PolicyResult]:
    """`replayssm`: one state slot per request, holding the records, instead
    of 1 + `num_spec` (vLLM with ATOM_ENABLE_REPLAYSSM=1)."""
    from .geometry import speculative_geometry
    from .memory_split import shared_pool_layout
    geometry = speculative_geometry(geometry, num_spec, replayssm, replayssm_cache_len)
    if replayssm:
        num_spec = 0        # the working slots per request: one
    s = workload.settings
    budget = int(memory_gib * GIB)
    layout = shared_pool_layout(geometry, budget, page_tokens_multiple=s.block_size)
    specs = build_policies(
        policies, kv_bytes_per_token=geometry.kv_bytes_per_token,
        state_slot_bytes=geometry.state_slot_bytes, budget_bytes=int(memory_gib * GIB),
        block_size=s.block_size, max_num_seqs=s.concurrency, num_spec=num_spec,
        headroom_slots=default_headroom(s.concurrency) if headroom is None else headroom,
        base_placement=placement, align_layout=layout, **server_policy(placement),
        # the unit the plugin asks vLLM for on these pages (vllm/registration.py),
        # whatever --block-size they were sized with
        plugin_hash_unit=largest_unit_dividing([layout.block_size_tokens], MAX_HASH_UNIT_TOKENS))
    runs = run_specs(specs, workload, jobs, show_progress)
    return to_results(runs, s)


def run_replay(args) -> int:
    t0 = time.perf_counter()
    names = parse_policy_names(",".join(args.policies))
    workload, geometry = load_workload(args)
    placement = placement_from_args(args)
    # the flag, else ATOM_STATE_CHECKPOINT_SLOTS, else the default per slot
    headroom = args.state_checkpoint_slots
    if headroom is None:
        headroom = load_settings().state_checkpoint_slots
    results = compare(workload, geometry, memory_gib=args.memory_gib, policies=names,
                      headroom=headroom, placement=placement,
                      num_spec=args.num_spec, jobs=args.jobs, show_progress=not args.no_progress,
                      replayssm=args.replayssm)
    spec = (f", k={args.num_spec} ({'ReplaySSM' if args.replayssm else '1 + k slots'})"
            if args.num_spec else "")
    title = (f"replay: {len(workload.conversations)} conversations, model {geometry.name}{spec}, "
             f"{args.memory_gib:g} GiB, concurrency {args.concurrency}, block {args.block_size}")
    print(format_table(results, title))
    print(f"client: {workload.settings.clock.describe()}")
    meta = dict(model=geometry.name, num_spec=args.num_spec, replayssm=args.replayssm,
                memory_gib=args.memory_gib, concurrency=args.concurrency,
                block_size=args.block_size, prefill_chunk=args.prefill_chunk,
                traces=list(args.traces) or "embedded sample",
                time_scale=workload.settings.clock.time_scale,
                client=workload.settings.clock.describe(),
                state_slot_tokens_equiv=geometry.state_slot_bytes / geometry.kv_bytes_per_token)
    if args.sweep_slots:
        points: dict = {}
        for slots in args.sweep_slots:
            rs = compare(workload, geometry, memory_gib=args.memory_gib,
                         policies=["separate-pools", "simple", "kv-only-ceiling"],
                         headroom=slots,
                         placement=placement, num_spec=args.num_spec, jobs=args.jobs,
                         replayssm=args.replayssm)
            for r in rs:
                if r.policy != "kv-only-ceiling":
                    points.setdefault(r.policy, []).append((slots, r.hit_over_ceiling))
        meta["sweep"] = points
        plot_sweep(points, args.plot, title.replace(", model", "\nmodel") + ": hit/ceiling vs checkpoint slots")
        print(f"sweep plot: {args.plot}")
    if getattr(args, "sweep_memory", None):
        points = {}
        for gib in args.sweep_memory:
            rs = compare(workload, geometry, memory_gib=gib,
                         policies=["default", "vllm-align", "kv-only-ceiling"],
                         headroom=headroom, placement=placement, num_spec=args.num_spec,
                         jobs=args.jobs, replayssm=args.replayssm)
            for r in rs:
                if r.policy != "kv-only-ceiling":
                    points.setdefault(r.policy, []).append((gib, r.hit_over_ceiling))
        meta["sweep_memory"] = points
        plot_sweep({("plugin (default)" if k == "default" else k): v for k, v in points.items()},
                   args.plot, title.split(", model")[0] + f"\nmodel {geometry.name}, concurrency "
                   f"{args.concurrency}: hit/ceiling vs memory", xlabel="memory for KV and states (GiB)")
        print(f"memory sweep plot: {args.plot}")
    if args.json:
        write_json(results, args.json, meta)
        print(f"json: {args.json}")
    print(f"elapsed: {time.perf_counter() - t0:.1f} s")
    return 0
