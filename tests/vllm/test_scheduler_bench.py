"""Smoke test of benchmarks/scheduler_bench.py: vLLM's real scheduler driven by
the embedded sample cc traces at a tiny KV budget (no model).

The full run (all 143 shared traces, c8 / 80 GiB and c4 / 40 GiB) takes
minutes per policy; this one takes a few seconds once vLLM is imported:
the four sample traces (19 requests served; the 4 requests of trace_0184
over 32k tokens are skipped as over-context), 2 slots, 2.5 GiB (102 blocks of
400 tokens for native: pressure enough to preempt), outputs capped at 32
tokens. The figures are exact and deterministic (same traces, same order,
same vLLM): re-measure with the command in ``_measure`` if vLLM changes.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest

if importlib.util.find_spec("vllm") is None:  # cheap: no vLLM import at collection
    pytest.skip("vllm is not installed; run: bash scripts/setup_cpu_vllm.sh",
                allow_module_level=True)

from scheduler_bench_module import (SAMPLE_POINT as POINT, load_sample_conversations,  # noqa: E402
                                    load_scheduler_bench)

SB = load_scheduler_bench()


@pytest.fixture(scope="module")
def conversations():
    pytest.importorskip("vllm")  # installed but broken: skip with the reason
    return load_sample_conversations()


@pytest.fixture
def plugin():
    """Skip where the plugin's scheduler side does not import."""
    try:
        SB.load_plugin()
    except SB.PluginUnavailable as exc:
        pytest.skip(f"plugin scheduler not importable: {exc}")


def _measure(conversations, policy):
    """To re-measure: python3 -c "import sys; sys.path.insert(0, 'benchmarks');
    import scheduler_bench as sb; from atom_hybrid_cache.replay.traces import
    default_sample_paths as d; c = sb.load_conversations([p for p in d() if
    p.endswith('.json')]); print(sb.run_point(c, 'native', concurrency=2,
    memory_gib=2.5, max_model_len=32768, max_output=32))"
    """
    return SB.run_point(conversations, policy, **POINT)


def test_native_exact_figures(conversations):
    r = _measure(conversations, "native")
    assert r.status == "ok" and r.scheduler == "Scheduler"
    # Geometry: qwen3.5-27b, block 400, 1 attention + 3 mamba groups of 16 layers.
    assert (r.block_size, r.hash_block_size, r.num_blocks) == (400, 400, 102)
    assert "a state checkpoint = 3 blocks = KV of 1,200 tokens" in r.geometry
    assert r.requests == 19 and r.over_context_requests == 4 and r.over_pool_requests == 0
    assert r.prompt_tokens == 294_053
    assert r.ceiling_tokens == 237_504
    assert r.hit_tokens == 188_000
    assert r.computed_prompt_tokens == r.prompt_tokens - r.hit_tokens
    assert r.preemptions == 2
    assert r.prefill_tokens_scheduled == 138_453  # > computed: recompute after preemption
    assert r.hit_tokens <= r.ceiling_tokens and r.hit_above_ceiling_requests == 0
    assert r.steps > 0 and r.sched_us_per_step > 0


def test_native_pmu64_exact_figures(conversations):
    r = _measure(conversations, "native-pmu64")
    assert (r.block_size, r.hash_block_size, r.num_blocks) == (448, 64, 91)
    assert r.requests == 19 and r.prompt_tokens == 294_053
    assert r.ceiling_tokens == 237_504
    assert r.hit_tokens == 189_952
    assert r.preemptions == 4
    assert r.hit_tokens <= r.ceiling_tokens and r.hit_above_ceiling_requests == 0


def test_native_async_scheduling_exact_figures(conversations):
    """AsyncScheduler driven as EngineCore's batch queue of 2 does."""
    r = SB.run_point(conversations, "native", async_scheduling=True, **POINT)
    assert r.scheduler == "AsyncScheduler"
    assert r.requests == 19 and r.prompt_tokens == 294_053
    assert r.ceiling_tokens == 237_504
    assert r.hit_tokens == 162_000
    assert r.preemptions == 1
    assert r.hit_tokens <= r.ceiling_tokens


def test_prefix_match_unit_64_needs_block_size_64(conversations):
    """Why native-pmu64 runs with --block-size 64: vLLM rejects a unit that
    does not divide the 400-token hybrid block."""
    bad = SB.Policy("bad", None, 64)
    with pytest.raises(ValueError, match="prefix_match_unit"):
        SB.build_configs(bad, concurrency=2, budget_bytes=int(2.5 * SB.GIB),
                         max_model_len=POINT["max_model_len"])


def test_plugin_runs_if_available(conversations, plugin):
    r = _measure(conversations, "plugin")
    assert r.status == "ok", r.status
    assert r.scheduler == "AtomScheduler"
    assert "AtomGDNSpec x16" in r.geometry
    assert r.requests == 19 and r.prompt_tokens == 294_053
    assert r.hit_tokens <= r.ceiling_tokens and r.hit_above_ceiling_requests == 0
    # Pinned, above native pmu64's 189,952 on this tiny sample (91 pages, 30
    # checkpoints' worth of KV: the plugin runs without its cold checkpoints,
    # which cost this pool 28,544 tokens: BENCHMARKS.md, "The cold checkpoints"). Before each
    # live request held its prompt-end state it got 172,928: in 91 pages
    # vLLM's page of that state went back to the LRU during the decode and
    # was evicted before the next turn came. 199,232 with 6 preemptions
    # with the admission gate off (its default here before 2026-12-03),
    # 161,856 with the gate before its two faults were mended
    # (BENCHMARKS.md, "Small pools"). Priced eviction is on in this pool
    # (15 checkpoints' worth a slot): 225,856 in vLLM's FIFO order (below).
    assert r.hit_tokens == 202_368
    assert r.preemptions == 1


def test_plugin_in_vllms_free_order(conversations, plugin, monkeypatch):
    """ATOM_EVICTION_PRICE_WEIGHT=0: vLLM's own free queue, the figure
    before priced eviction (which loses 23,488 tokens here, BENCHMARKS.md,
    "Priced eviction")."""
    monkeypatch.setenv("ATOM_EVICTION_PRICE_WEIGHT", "0")
    r = _measure(conversations, "plugin")
    assert (r.status, r.hit_tokens, r.preemptions) == ("ok", 225_856, 1)


def test_vllms_default_max_num_seqs_shares_the_pool_among_the_requests_in_flight(
        conversations, plugin, caplog):
    """max_num_seqs is a ceiling: a server left at vLLM's default (256
    here) shares the pool among the requests in flight (2), as one started
    with max_num_seqs=2 does. 5.5 GiB: 201 pages, 67 checkpoints' worth, 33
    a slot for two. While the share was the pool over max_num_seqs, 256 left
    each 350 tokens: cold checkpoints and floors off, priced eviction on,
    and 225,856 tokens instead of 235,712."""
    point = dict(POINT, memory_gib=5.5)
    with caplog.at_level(logging.INFO, logger="atom_hybrid_cache"):
        wide = SB.run_point(conversations, "plugin", max_num_seqs=256, **point)
    assert ("a request slot's share of the KV pool is the pool over the most requests in "
            "flight at once (at most max_num_seqs=256): cold checkpoints and floor states on "
            "up to 2 in flight (the floors' pool share shrinking and a release's refreshed "
            "states spaced out under 48 checkpoints' worth a request); from 3" in caplog.text)
    assert " off: " not in caplog.text and "floor states fill" not in caplog.text
    narrow = SB.run_point(conversations, "plugin", **point)
    assert (wide.status, wide.num_blocks) == ("ok", 201)
    assert (wide.hit_tokens, wide.preemptions) == (narrow.hit_tokens, narrow.preemptions) \
        == (235_712, 0)


def test_the_step_that_sees_a_small_share_turns_the_insurance_off_once(
        conversations, plugin, caplog):
    """4 GiB: 146 pages, 48 checkpoints' worth, 24 a slot for two: the first
    step sees both requests and the insurance goes off, with max_num_seqs
    2 or 256 alike (225,856 tokens)."""
    point = dict(POINT, memory_gib=4.0)
    with caplog.at_level(logging.INFO, logger="atom_hybrid_cache"):
        wide = SB.run_point(conversations, "plugin", max_num_seqs=256, **point)
    assert caplog.text.count(
        "cold checkpoints and floor states off: 2 requests in flight: a request slot's share "
        "of the KV pool (32,480 tokens) holds 24 checkpoints' worth, under 32") == 1
    narrow = SB.run_point(conversations, "plugin", **point)
    assert (wide.hit_tokens, wide.preemptions) == (narrow.hit_tokens, narrow.preemptions) \
        == (225_856, 0)


def test_plugin_hits_first_admission_order(conversations, plugin):
    """ATOM_ADMISSION_ORDER=hits-first on the real Scheduler: pinned."""
    r = _measure(conversations, "plugin-hits-first")
    assert r.status == "ok" and r.scheduler == "AtomScheduler"
    assert r.requests == 19 and r.prompt_tokens == 294_053
    assert r.hit_tokens <= r.ceiling_tokens and r.hit_above_ceiling_requests == 0
    # 215,104 when the release took back states at 0.5 and 0.85 of the
    # prefix only (ATOM_STATE_CHECKPOINT_RETAIN=0.5,0.85; preemptions 3 too);
    # 230,336 with 3 preemptions with the admission gate off
    assert r.hit_tokens == 225_664
    assert r.preemptions == 0


def test_plugin_async_scheduler(conversations, plugin):
    """AtomAsyncScheduler, for vLLM's default async scheduling on GPUs."""
    r = SB.run_point(conversations, "plugin", async_scheduling=True, **POINT)
    assert r.status == "ok" and r.scheduler == "AtomAsyncScheduler"
    assert r.requests == 19 and r.prompt_tokens == 294_053
    assert r.hit_tokens == 202_368 and r.hit_tokens <= r.ceiling_tokens


def test_cli_parsers():
    assert SB.parse_points("c8:80,c4:40") == [(8, 80.0), (4, 40.0)]
    assert SB.parse_policies("native,plugin") == ["native", "plugin"]
    import argparse
    with pytest.raises(argparse.ArgumentTypeError):
        SB.parse_points("8-80")
    with pytest.raises(argparse.ArgumentTypeError):
        SB.parse_policies("native,nope")


def test_interleaved_runs_give_each_policy_its_own_figures(conversations, plugin):
    """--interleave steps one scheduler of each policy in turn: the figures
    are those of the runs one after the other (the pins above), only the
    times are taken side by side."""
    native, pmu64, atom, hits_first = SB.run_points_interleaved(
        conversations, ["native", "native-pmu64", "plugin", "plugin-hits-first"], **POINT)
    for r, one_by_one in ((native, _measure(conversations, "native")),
                          (atom, _measure(conversations, "plugin"))):
        assert (r.status, r.steps, r.hit_tokens, r.preemptions) == (
            "ok", one_by_one.steps, one_by_one.hit_tokens, one_by_one.preemptions)
    assert (atom.hit_tokens, hits_first.hit_tokens, pmu64.hit_tokens) == (202_368, 225_664, 189_952)
    assert atom.scheduler == hits_first.scheduler == "AtomScheduler"
    assert native.scheduler == pmu64.scheduler == "Scheduler"
