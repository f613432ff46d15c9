"""The benchmark's scheduler-only replay (``--scheduler-only``) keeps exactly
the cached counts of the runs with the model.

``e2e_pressure.replay_scheduler_only`` starts the same engine and sends the
same rounds, but answers each scheduler step with synthetic one-token
outputs instead of running the forward. With ``max_tokens=1`` no output
enters a later prompt, so caching is decided by the scheduler alone; this
test pins that claim against the figures the model runs pin in
``test_trace_replay_plugin.py`` (elided workload, 128-token blocks) and
``test_scaled_trace_replay_plugin.py`` (the plan's scaled workload,
32-token blocks), and against the hits-first figure of BENCHMARKS.md; it
also pins the plan's workload at full length, which only this replay can
run here (native, the plugin, the plugin with vLLM's admission, without its
floor states, without its cold checkpoints and with span checkpoints). A
replay that mis-states a hit, or runs the scheduler in another order than
the engine does, moves these totals.
"""

from __future__ import annotations

import json
import shutil

import pytest

POOL_MULTIPLE = 0.83

# The elided workload's 63-page pool (20 checkpoints' worth, 4 in flight)
# prices eviction by default (ATOM_EVICTION_PRICE_WEIGHT=auto); with vLLM's
# FIFO order (=0), the figures of the model runs (see the module docstring):
# ELIDED_FIFO. The server's admission gate (ATOM_ADMISSION_GATE=auto, on at
# every pool size): plugin-ungated with it off.
ELIDED_CACHED = {"native-pmu64": 13_760, "plugin": 16_000, "plugin-hits-first": 17_664,
                 "plugin-ungated": 13_632}
ELIDED_FIFO = {"native-pmu64": 13_760, "plugin": 14_720, "plugin-hits-first": 17_664,
               "plugin-ungated": 14_528}
SCALED_CACHED = {"native": 702_944, "plugin": 816_288}


@pytest.fixture
def plugin_env(monkeypatch):
    # the bench enables the plugin process-wide and sets the admission
    # order per policy: restore those variables afterwards
    monkeypatch.setenv("VLLM_PLUGINS", "atom_hybrid_cache")
    for var in ("ATOM_INTERIOR_CHECKPOINTS", "ATOM_ADMISSION_ORDER", "ATOM_ADMISSION_GATE"):
        monkeypatch.delenv(var, raising=False)


def test_elided_workload_matches_the_model_runs(pressure_bench, plugin_env, vllm_cpu_env,
                                                elided_workload):
    E = pressure_bench
    convs, w = elided_workload
    nb = E.budget_blocks(POOL_MULTIPLE, w.working_set, w.single_request)
    assert (len(w.sent), nb) == (26, 63)
    got = {}
    for policy in ELIDED_CACHED:
        run = E.run_policy(policy, convs, w.rounds, nb, w.max_model_len, scheduler_only=True)
        assert run["outputs"] == [] and len(run["cached"]) == len(w.sent)
        got[policy] = sum(run["cached"])
    assert got == ELIDED_CACHED


def _replay_scaled(E, scaled_plan_workload, policies) -> tuple[dict, int]:
    """({policy: cached tokens}, oracle) of the scaled workload at 0.83x."""
    _, convs, _, _ = scaled_plan_workload
    w = E.lockstep_workload(convs, 4, E.GEOMETRIES["small-block"]["block_size"])
    nb = E.budget_blocks(POOL_MULTIPLE, w.working_set, w.single_request)
    assert (len(w.sent), nb) == (223, 599)
    return {p: sum(E.run_policy(p, convs, w.rounds, nb, w.max_model_len, "small-block",
                                scheduler_only=True)["cached"])
            for p in policies}, sum(w.oracle)


def test_scaled_workload_matches_the_model_runs(pressure_bench, plugin_env, vllm_cpu_env,
                                                scaled_plan_workload):
    got, _ = _replay_scaled(pressure_bench, scaled_plan_workload, SCALED_CACHED)
    assert got == SCALED_CACHED
    assert got["plugin"] > got["native"]


# The admission gate (BENCHMARKS.md, "The admission gate"): the attention-only
# control under AtomScheduler with the gate, and the plugin with the gate
# switched off (ATOM_ADMISSION_GATE=off)
SCALED_ADMISSION = {"attention-control-gated": 847_008, "plugin-ungated": 786_784}


def test_the_admission_gate_on_the_scaled_workload(pressure_bench, plugin_env, vllm_cpu_env,
                                                   scaled_plan_workload):
    got, oracle = _replay_scaled(pressure_bench, scaled_plan_workload, SCALED_ADMISSION)
    assert got == SCALED_ADMISSION
    # both gated engines above the same engines without the gate (the
    # control keeps 0.949 there, BENCHMARKS.md; the plugin's default, with
    # the gate, is pinned above)
    assert SCALED_CACHED["plugin"] > got["plugin-ungated"]
    assert got["attention-control-gated"] / oracle > 0.98


# The plan's 14 traces at full length (BENCHMARKS.md, "The plan's 14 traces at
# full length"): 128-token blocks, 4 conversations in flight, 0.83x
# plugin: 0.9514 of the oracle (0.9539 before priced eviction faded out above
# the line), with the server's admission gate (its default
# since 2026-12-01, later); 6,438,528 (0.9353; 6,475,264 before the fade)
# with vLLM's admission
FULL_LENGTH_CACHED = {"native": 5_621_888, "plugin": 6_549_376, "plugin-ungated": 6_438_528}
# (plugin-ungated: 6,475,264 with every prompt-end state inside a page kept,
# before core/tail_price.py)
# the same plugin without the server's floor states (ATOM_STATE_CHECKPOINT_FLOOR=;
# 6,270,656 without the gate either), without its cold checkpoints
# (ATOM_STATE_CHECKPOINT_COLD=; 6,277,632 ungated), and with
# ATOM_STATE_CHECKPOINT_SPAN=0.5,0.875 (whose positions in a cold prompt are the
# cold checkpoints'; 6,463,808 ungated)
FULL_LENGTH_NO_FLOOR_CACHED = 6_504_960
FULL_LENGTH_NO_COLD_CACHED = 6_497_472
FULL_LENGTH_SPAN_CACHED = 6_545_280


@pytest.mark.slow
def test_the_plan_workload_at_full_length(pressure_bench, plugin_env, vllm_cpu_env,
                                          monkeypatch):
    E = pressure_bench
    convs = E.build_workload(E.traces_fitting(64000), 0, 256, None, 64)
    w = E.lockstep_workload(convs, 4, E.GEOMETRIES["default"]["block_size"])
    nb = E.budget_blocks(POOL_MULTIPLE, w.working_set, w.single_request)
    assert (len(w.sent), w.working_set, nb, sum(w.oracle)) == (223, 1413, 1174, 6_883_831)

    def cached(policy):
        return sum(E.run_policy(policy, convs, w.rounds, nb, w.max_model_len,
                                scheduler_only=True)["cached"])

    assert {p: cached(p) for p in FULL_LENGTH_CACHED} == FULL_LENGTH_CACHED
    assert cached("plugin-no-floor") == FULL_LENGTH_NO_FLOOR_CACHED
    assert cached("plugin-no-cold") == FULL_LENGTH_NO_COLD_CACHED
    monkeypatch.setenv("ATOM_STATE_CHECKPOINT_SPAN", "0.5,0.875")
    assert cached("plugin") == FULL_LENGTH_SPAN_CACHED


# benchmarks/loss_trace.py on the elided workload, plugin at 0.83x: where the
# 20,099 - 15,808 tokens go, read where vLLM looks each request up
ELIDED_PLUGIN_SPLIT = {"oracle": 20_099, "cached": 14_720, "kv_cut": 3_843,
                       "states_missing": 2_048, "requests_missing_states": 4}


def test_the_loss_tracer_watches_without_changing_the_replay(pressure_bench, plugin_env,
                                                            vllm_cpu_env, elided_workload,
                                                            monkeypatch):
    from benchmark_modules import load_benchmark
    LT = load_benchmark("loss_trace")
    from vllm.v1.core.block_pool import BlockPool
    untraced_evict = BlockPool._maybe_evict_cached_block

    E = pressure_bench
    convs, w = elided_workload
    nb = E.budget_blocks(POOL_MULTIPLE, w.working_set, w.single_request)
    # (the split below pinned with vLLM's FIFO order)
    monkeypatch.setenv("ATOM_EVICTION_PRICE_WEIGHT", "0")
    tracer = LT.LossTracer(w.oracle)
    tracer.install()
    try:
        run = E.run_policy("plugin", convs, w.rounds, nb, w.max_model_len, scheduler_only=True,
                           observer=tracer)
    finally:
        tracer.uninstall()
    assert BlockPool._maybe_evict_cached_block is untraced_evict
    # the replay's own count, to the token, and one admission per request,
    # matched by request id (the gate may admit out of arrival order)
    assert sum(run["cached"]) == ELIDED_FIFO["plugin"]
    assert len(tracer.admissions) == len(run["cached"])
    assert {a.request: a.hit for a in tracer.admissions} == dict(enumerate(run["cached"]))
    split = LT.loss_split(tracer.admissions, page=E.BLOCK_SIZE)
    assert split == ELIDED_PLUGIN_SPLIT
    # the worst: a conversation's fifth turn finds 896 tokens of KV and no
    # state (the round before, a prefill the gate held until the others
    # finished evicted that conversation's top units; with the gate off the
    # worst is conversation 0's sixth turn: 384 tokens of KV, no state)
    a = LT.worst(tracer.admissions, 1, page=E.BLOCK_SIZE)[0]
    assert (a.request, a.conversation, a.turn, a.kv_prefix, a.hit, a.states) == (
        17, 1, 4, 896, 0, ())
    # (178, 114) before the inner prompt-end states were priced (core/tail_price.py):
    # a dropped one goes back uncached, and its pages are reused before the
    # indexed ones they would have displaced; (182, 117) with the gate off
    assert (len(tracer.evictions), sum(e.state for e in tracer.evictions)) == (199, 129)


# Two cells of benchmarks/small_pool_sweep.py (subset, checkpoints' worth,
# pool / live): vLLM's default geometry, its 64-token hash unit inside
# 128-token pages. The planner's model gives the same (pinned for it in
# tests/test_planner_agreement.py). Priced eviction by default (a slot's
# share under 32 checkpoints' worth); SWEEP_CELLS_FIFO with vLLM's order.
SWEEP_CELLS = {(1, 30, 1.0): {"native-pmu64": 235_712, "plugin": 244_992},
               (2, 30, 0.83): {"native-pmu64": 142_080, "plugin": 355_840}}
SWEEP_CELLS_FIFO = {(1, 30, 1.0): 242_816, (2, 30, 0.83): 321_920}


def test_the_small_pool_sweep_cells_the_planner_pins(pressure_bench, plugin_env, vllm_cpu_env,
                                                     sweep):
    E = pressure_bench
    for (subset, checkpoints, multiple), want in SWEEP_CELLS.items():
        convs, w, pool, in_flight = sweep.cell_workload(subset, checkpoints, multiple)
        got = {}
        for policy in want:
            # +1: vLLM's null block
            run = E.run_policy(policy, convs, w.rounds, pool + 1, w.max_model_len,
                               sweep.GEOMETRY, scheduler_only=True, max_num_seqs=in_flight)
            got[policy] = sum(run["cached"])
        assert got == want, (subset, checkpoints, multiple)


# The issue's geometry (640-token pages: one KV head of 64, so vLLM raises
# the block over the state page): (subset, multiple) at 30 checkpoints'
# worth -> cached tokens, the planner's pins (tests/test_small_pool_sweep.py)
LARGE_PAGE_CELLS = {(2, 1.0): {"native": 763_520, "native-pmu64": 704_960, "plugin": 760_064},
                    (0, 2.0): {"native": 465_920, "native-pmu64": 536_256, "plugin": 535_680}}


def test_the_issues_geometry_on_vllms_scheduler(pressure_bench, plugin_env, vllm_cpu_env, sweep):
    """vLLM runs 640-token blocks for the `large-page` model (`run_policy`
    raises where it runs others) and caches what the planner says."""
    E = pressure_bench
    for (subset, multiple), want in LARGE_PAGE_CELLS.items():
        convs, w, pool, in_flight = sweep.cell_workload(subset, 30, multiple,
                                                        geometry="large-page")
        got = {p: sum(E.run_policy(p, convs, w.rounds, pool + 1, w.max_model_len, "large-page",
                                   scheduler_only=True, max_num_seqs=in_flight)["cached"])
               for p in want}
        assert got == want, (subset, multiple)


# With vLLM's FIFO free order (ATOM_EVICTION_PRICE_WEIGHT=0, the queue not
# replaced): the planner's figures there too (tests/test_planner_agreement.py).
def test_vllms_order_keeps_the_planners_figures(pressure_bench, plugin_env, vllm_cpu_env,
                                                elided_workload, monkeypatch, sweep):
    monkeypatch.setenv("ATOM_EVICTION_PRICE_WEIGHT", "0")
    E = pressure_bench
    convs, w = elided_workload
    nb = E.budget_blocks(POOL_MULTIPLE, w.working_set, w.single_request)
    policies = ("plugin", "plugin-ungated")
    got = {p: sum(E.run_policy(p, convs, w.rounds, nb, w.max_model_len,
                               scheduler_only=True)["cached"]) for p in policies}
    assert got == {p: ELIDED_FIFO[p] for p in policies}
    for (subset, checkpoints, multiple), want in SWEEP_CELLS_FIFO.items():
        convs, w, pool, in_flight = sweep.cell_workload(subset, checkpoints, multiple)
        run = E.run_policy("plugin", convs, w.rounds, pool + 1, w.max_model_len,
                           sweep.GEOMETRY, scheduler_only=True, max_num_seqs=in_flight)
        assert sum(run["cached"]) == want, (subset, checkpoints, multiple)


# Speculative decoding with 1 + k states (n-gram, vLLM's align mode: a
# request holds k scratch pages a state group from admission to release),
# the scaled workload in 128-token pages, the defaults: (pool / live, k) ->
# cached tokens. The planner gives the same (tests/test_planner_agreement.py).
# Before the admission gate counted the scratch pages (`PageGroup.
# speculative_pages`, read from vLLM's `num_speculative_blocks`) it let in
# requests that then stalled the pool: 651,840 and 703,168.
SPECULATIVE = {(0.83, 3): 715_136, (1.0, 7): 731_328, (0.83, 7): 601_600,
               (0.5, 3): 396_032, (0.5, 7): 356_864}


def test_the_gate_counts_speculative_scratch_states(pressure_bench, plugin_env, vllm_cpu_env,
                                                     scaled_plan_workload):
    E = pressure_bench
    _, convs, _, _ = scaled_plan_workload
    w = E.lockstep_workload(convs, 4, E.BLOCK_SIZE)
    got = {}
    for multiple, k in SPECULATIVE:
        nb = E.budget_blocks(multiple, w.working_set, w.single_request)
        run = E.run_policy("plugin", convs, w.rounds, nb, w.max_model_len, scheduler_only=True,
                           dtype="float32",
                           speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                               "prompt_lookup_max": 4, "prompt_lookup_min": 2})
        got[multiple, k] = sum(run["cached"])
    assert got == SPECULATIVE


# benchmarks/continuation_bound.py: four first prompts, then one of the
# four conversations goes on (the first two continuations); vLLM's
# scheduler gives the planner's rows (tests/test_continuation_bound.py):
# the plugin keeps conversation 0's prompt, which both natives lost, and
# native keeps conversation 1's, which the other two spent on prompt-end
# copies.
CONTINUATIONS = {0: {"native": 0, "native-pmu64": 0, "plugin": 1_088},
                 1: {"native": 640, "native-pmu64": 0, "plugin": 0}}


def test_which_policy_serves_the_next_request_depends_on_the_request(plugin_env, vllm_cpu_env):
    from benchmark_modules import load_benchmark
    bound = load_benchmark("continuation_bound")
    got = {j: {} for j in CONTINUATIONS}
    for policy in bound.POLICIES:     # the plugin last: vLLM loads plugins once
        for j in CONTINUATIONS:
            convs = bound.first_turns_then(bound.LENS, j)
            got[j][policy] = bound.scheduler_runner(policy, convs, bound.POOL_PAGES)
    assert got == CONTINUATIONS


# e2e_pressure_sweep.py --max-prompt 2000 on the bench's four traces at
# 0.83x: {row: (pool pages, cached tokens, oracle)}; the paged bound is the
# attention-only ceiling of the same pages.
SWEEP_ELIDED = {"paged bound": (63, 18_816, 20_099), "native-pmu64": (63, 16_640, 20_099),
                "plugin": (63, 18_688, 20_099)}


def test_the_pressure_sweep_elides_as_the_bench_does(pressure_bench, plugin_env, vllm_cpu_env,
                                                     tmp_path):
    """e2e_pressure_sweep.py --max-prompt: the bench's elided workload (its
    four traces, prompts capped at 2,000 tokens) as one group, full length
    (64 tokens an id); the sweep takes the traces in name order, so the
    rounds differ from the bench's order and so do the counts."""
    from benchmark_modules import load_benchmark
    sweep = load_benchmark("e2e_pressure_sweep")
    for path in pressure_bench.resolve_trace_paths(None):
        shutil.copy(path, tmp_path / path.name)
    out = tmp_path / "sweep.json"
    assert sweep.main(["--trace-dir", str(tmp_path), "--traces-fitting", str(10 ** 9),
                       "--shapes", "64x4", "--max-prompt", "2000", "--pool-multiples", "0.83",
                       "--policies", "native-pmu64,plugin", "--scheduler-only",
                       "--geometry", "default", "--json", str(out)]) == 0
    rows = {r["policy"]: (r["num_blocks"], r["cached_tokens"], r["oracle_tokens"])
            for r in json.loads(out.read_text())["rows"]}
    assert rows == SWEEP_ELIDED
