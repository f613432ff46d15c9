"""The scaled workload of ``benchmarks/e2e_pressure.py`` (SCALE rule): the
plan's 14 cc traces whose prompts all fit in 64k tokens, replayed at 8
tokens per 64-token trace id.

No model runs here: this pins what the benchmark's table is measured on
(which traces, how many requests and tokens, the oracle, the working set),
so a change to the expansion or the selection shows up as a failing test
instead of a silently different table. The figures are those of
``benchmarks/results/e2e_pressure_scaled.json``.
"""

from __future__ import annotations

import pytest

FIT_64K = ["trace_0184", "trace_0228", "trace_0288", "trace_0312", "trace_0368", "trace_0372",
           "trace_0432", "trace_0460", "trace_0504", "trace_0620", "trace_0624", "trace_0676",
           "trace_0684", "trace_0704"]


@pytest.fixture(scope="module")
def scaled(pressure_bench, scaled_plan_workload):
    return (pressure_bench, *scaled_plan_workload)


def test_the_plans_fourteen_traces_are_selected(scaled):
    _, paths, convs, _, _ = scaled
    assert [p.stem for p in paths] == FIT_64K
    assert len(convs) == 14


def test_scaled_prompts_keep_the_traces_growth_and_reuse(scaled):
    E, _, convs, rounds, sent = scaled
    assert (len(sent), len(rounds)) == (223, 65)
    assert sum(map(len, sent)) == 950_932 and max(map(len, sent)) == 7_978
    oracle = E.oracle_reusable(sent, [len(r) for r in rounds])
    assert sum(oracle) == 860_393
    assert sum(n // 32 * 32 for n in oracle) == 856_960
    assert E.working_set(convs, rounds, 32) == (720, 256)
    # the recorded resend-and-continue pattern survives the scaling: most
    # turns reuse all but the last few tokens of their conversation's
    # previous prompt
    continued = sum(1 for cv in convs for a, b in zip(cv["prompts"], cv["prompts"][1:])
                    if b[:len(a) - 8] == a[:len(a) - 8])
    assert continued == 198   # of 209 follow-up turns


def test_no_elision_and_no_cap_when_max_prompt_is_zero(scaled):
    E, paths, convs, _, _ = scaled
    from atom_hybrid_cache.replay.token_expander import TokenExpander
    from atom_hybrid_cache.replay.traces import load_traces

    (conv,) = load_traces(paths[0])
    full = TokenExpander().prompt_tokens(conv, 0, tokens_per_id=8)
    assert convs[0]["prompts"][0] == [t % E.TINY_VOCAB_WORDS + 1 for t in full]
    assert len(convs[0]["prompts"]) == len(conv.requests)


def test_paged_reuse_bound_drops_only_the_excess_over_the_pool(pressure_bench):
    E = pressure_bench
    # round 0 computes a and b (sent together: b cannot reuse a); round 1
    # resends both with growth. 4-token blocks; a and b share their first.
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    b = [1, 2, 3, 4, 20, 21, 22, 23]
    sent = [a, b, a + [13], b + [24, 25]]
    oracle = E.oracle_reusable(sent, [2, 2])
    assert oracle == [0, 0, 12, 8]
    # round 1 needs a's 3 blocks and b's 2, one shared: 4 blocks
    assert E.paged_reuse_bound(sent, oracle, [2, 2], 4, 4) == 20
    # one block short: an unshared tip goes (4 tokens), not the shared block
    assert E.paged_reuse_bound(sent, oracle, [2, 2], 4, 3) == 16
    # only the shared block left: each resumes on it
    assert E.paged_reuse_bound(sent, oracle, [2, 2], 4, 1) == 8


def test_paged_reuse_bound_on_the_scaled_workload(scaled):
    """At 0.83x no paged cache can keep more than 0.990 of the oracle (the
    block oracle less 4,832 tokens); the attention-only control's LRU keeps
    0.949 (BENCHMARKS.md). With the whole working set nothing is lost."""
    E, _, convs, rounds, sent = scaled
    oracle = E.oracle_reusable(sent, [len(r) for r in rounds])
    sizes = [len(r) for r in rounds]
    assert E.paged_reuse_bound(sent, oracle, sizes, 32, 598) == 852_128
    assert E.paged_reuse_bound(sent, oracle, sizes, 32, 720) == 856_960


def test_a_run_without_the_plugin_after_a_plugin_run_gets_vllms_scheduler(pressure_bench,
                                                                           monkeypatch):
    """The benchmark runs native after plugin engines in one process. With
    the plugin enabled, vLLM builds our scheduler where none is named
    (registration.default_scheduler_class), so a policy that is not the
    plugin's must drop VLLM_PLUGINS again. Without that, native at 0.83x of
    the elided workload, run after a plugin run, cached 13,824 tokens
    instead of native's 13,184 (it ran our scheduler)."""
    pytest.importorskip("vllm")
    from vllm.config.scheduler import SchedulerConfig
    from vllm.v1.core.sched.scheduler import Scheduler

    from atom_hybrid_cache.vllm.scheduler import AtomScheduler

    E = pressure_bench
    monkeypatch.setenv("VLLM_PLUGINS", "unchanged-by-this-test")   # restored after
    monkeypatch.delenv("ATOM_ADMISSION_GATE", raising=False)
    E.policy_kwargs("plugin")
    assert SchedulerConfig.default_factory().get_scheduler_cls() is AtomScheduler
    for policy in ("native", "native-pmu64", "native-dense", "attention-control", "off"):
        E.policy_kwargs("plugin")
        assert E.policy_kwargs(policy).get("scheduler_cls") is None
        assert SchedulerConfig.default_factory().get_scheduler_cls() is Scheduler, policy
