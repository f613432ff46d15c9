"""benchmarks/scheduler_bench.py as a module for the tests (benchmarks/ is
not a package): loaded once, under the name the bench itself uses."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "scheduler_bench.py"


def load_scheduler_bench():
    if "scheduler_bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("scheduler_bench", BENCH)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["scheduler_bench"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["scheduler_bench"]
