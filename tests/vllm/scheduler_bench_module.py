"""benchmarks/scheduler_bench.py as a module for the tests (benchmarks/ is
not a package): loaded once, under the name the bench itself uses."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "scheduler_bench.py"

# The smoke point the tests serve the embedded sample traces at: 2 slots,
# 2.5 GiB (pressure enough to preempt), outputs capped at 32 tokens.
SAMPLE_POINT = dict(concurrency=2, memory_gib=2.5, max_model_len=32_768, max_output=32)


def load_scheduler_bench():
    if "scheduler_bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("scheduler_bench", BENCH)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["scheduler_bench"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["scheduler_bench"]


def load_sample_conversations():
    """The embedded sample cc traces, as the bench loads conversations."""
    from atom_hybrid_cache.replay.traces import default_sample_paths

    return load_scheduler_bench().load_conversations(
        [p for p in default_sample_paths() if p.endswith(".json")])
