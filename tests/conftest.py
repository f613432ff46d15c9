"""Test markers, by folder, so a fast loop exists:

    python3 -m pytest -q -m "not slow"     # everything but the model runs (~1-2 min)
    python3 -m pytest -q -m unit           # no vLLM: core, replay, config, kernels
    python3 -m pytest -q -m vllm           # vLLM's real scheduler, no model
    python3 -m pytest -q -m e2e            # vLLM on the tiny model

`unit`: tests/test_*.py and tests/kernels; `vllm`: tests/vllm; `e2e`:
tests/e2e (tests/e2e/conftest.py); `slow`: marked in the modules that run
the model over workloads or start `vllm serve` (tens of seconds each).
`.ci/run` runs them all.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmark_modules import load_benchmark

_HERE = Path(__file__).resolve().parent
_BY_FOLDER = {_HERE / "vllm": "vllm", _HERE / "kernels": "unit", _HERE: "unit"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).resolve().parent
        marker = _BY_FOLDER.get(folder)
        if marker is not None:
            item.add_marker(getattr(pytest.mark, marker))


@pytest.fixture(autouse=True)
def _plugin_settings_restored():
    """Every test leaves the plugin's variables (ATOM_*, LMCACHE_*, VLLM_PLUGINS) as it
    found them: the benchmarks a test drives set them per policy, and one
    left behind would change what a later test measures."""
    def ours(k: str) -> bool:
        return k.startswith(("ATOM_", "LMCACHE_")) or k == "VLLM_PLUGINS"

    saved = {k: v for k, v in os.environ.items() if ours(k)}
    yield
    for k in [k for k in os.environ if ours(k)]:
        if k not in saved:
            del os.environ[k]
    os.environ.update(saved)


@pytest.fixture(scope="session")
def sweep():
    """benchmarks/small_pool_sweep.py as a module: the tests that pin its
    cells build their workloads with it."""
    return load_benchmark("small_pool_sweep")
