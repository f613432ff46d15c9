"""benchmarks/scheduler_bench.py (and the benchmarks built on it) as modules
for the tests (benchmarks/ is not a package): loaded once, under the names
the benchmarks themselves use."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# The smoke point the tests serve the embedded sample traces at: 2 slots,
# 2.5 GiB (pressure enough to preempt), outputs capped at 32 tokens.
SAMPLE_POINT = dict(concurrency=2, memory_gib=2.5, max_model_len=32_768, max_output=32)


def load_benchmark(name: str):
    """benchmarks/NAME.py as the module NAME, loaded once (the benchmarks
    import each other by that name)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def load_scheduler_bench():
    return load_benchmark("scheduler_bench")


def load_sample_conversations():
    """The embedded sample cc traces, as the bench loads conversations."""
    from atom_hybrid_cache.replay.traces import default_sample_paths

    return load_scheduler_bench().load_conversations(
        [p for p in default_sample_paths() if p.endswith(".json")])
