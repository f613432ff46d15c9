"""The benchmark's scheduler-only replay (``--scheduler-only``) keeps exactly
the cached counts of the runs with the model.

``e2e_pressure.replay_scheduler_only`` starts the same engine and sends the
same rounds, but answers each scheduler step with synthetic one-token
outputs instead of running the forward. With ``max_tokens=1`` no output
enters a later prompt, so caching is decided by the scheduler alone; this
test pins that claim against the figures the model runs pin in
``test_trace_replay_plugin.py`` (elided workload, 128-token blocks) and
``test_scaled_trace_replay_plugin.py`` (the plan's scaled workload,
32-token blocks), and against the hits-first figure of BENCHMARKS.md. A
replay that mis-states a hit, or runs the scheduler in another order than
the engine does, moves these totals.
"""

from __future__ import annotations

import pytest

POOL_MULTIPLE = 0.83

# the same figures as the model runs (see the module docstring)
ELIDED_CACHED = {"native-pmu64": 13_760, "plugin": 15_808, "plugin-hits-first": 17_536}
SCALED_CACHED = {"native": 702_944, "plugin": 783_360}


@pytest.fixture
def plugin_env(monkeypatch):
    # the bench enables the plugin process-wide and sets the admission
    # order per policy: restore those variables afterwards
    monkeypatch.setenv("VLLM_PLUGINS", "atom_hybrid_cache")
    for var in ("ATOM_INTERIOR_CHECKPOINTS", "ATOM_ADMISSION_ORDER"):
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


def test_scaled_workload_matches_the_model_runs(pressure_bench, plugin_env, vllm_cpu_env,
                                                scaled_plan_workload):
    E = pressure_bench
    _, convs, rounds, sent = scaled_plan_workload
    w = E.lockstep_workload(convs, 4, E.GEOMETRIES["small-block"]["block_size"])
    nb = E.budget_blocks(POOL_MULTIPLE, w.working_set, w.single_request)
    assert (len(w.sent), nb) == (223, 599)
    got = {p: sum(E.run_policy(p, convs, w.rounds, nb, w.max_model_len, "small-block",
                               scheduler_only=True)["cached"])
           for p in SCALED_CACHED}
    assert got == SCALED_CACHED
    assert got["plugin"] > got["native"]
