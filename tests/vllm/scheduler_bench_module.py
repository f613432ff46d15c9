"""benchmarks/scheduler_bench.py as the scheduler-level tests drive it: its
module, the sample point and the sample conversations."""

from __future__ import annotations

from benchmark_modules import load_benchmark

# The smoke point the tests serve the embedded sample traces at: 2 slots,
# 2.5 GiB (pressure enough to preempt), outputs capped at 32 tokens.
SAMPLE_POINT = dict(concurrency=2, memory_gib=2.5, max_model_len=32_768, max_output=32)


def load_scheduler_bench():
    return load_benchmark("scheduler_bench")


def load_sample_conversations():
    """The embedded sample cc traces, as the bench loads conversations."""
    from atom_hybrid_cache.replay.traces import default_sample_paths

    return load_scheduler_bench().load_conversations(
        [p for p in default_sample_paths() if p.endswith(".json")])
