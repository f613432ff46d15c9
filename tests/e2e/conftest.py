"""Fixtures for the end-to-end tests: vLLM 0.32 (CPU build) on a tiny random
Qwen3-Next (3 Gated-DeltaNet layers + 1 full attention layer).

Everything under tests/e2e is skipped, with the reason, when vLLM cannot be
imported here (install it with ``bash scripts/setup_cpu_vllm.sh``). Test
modules should import vllm inside their tests or fixtures (or start with
``vllm = pytest.importorskip("vllm")``), never bare at module level, so that
collection itself does not fail where vLLM is missing.

Fixtures:

* ``tiny_model_path`` (session): folder of the tiny model, built once and
  cached (see ``tiny_model.py``; ``$ATOM_TEST_MODEL_CACHE`` moves the cache).
* ``vllm_cpu_env`` (session): the environment variables that keep vLLM small
  and quiet on a 2-core machine, applied to ``os.environ`` (read by the engine
  core process at start-up).
* ``llm_kwargs``: keyword arguments for ``vllm.LLM`` that start in about half a
  minute on 2 cores; override any of them per test.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

import pytest

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:          # "import tiny_model" from the tests
    sys.path.insert(0, str(_HERE))

from tiny_model import build_tiny_qwen3_next  # noqa: E402

# Environment for vLLM on a small CPU-only machine. setdefault: a value
# exported by the caller wins.
VLLM_CPU_ENV: dict[str, str] = {
    # KV cache (and, for hybrid models, the mamba state pool), GiB. The tiny
    # model needs a few MiB; the default (4 GiB) only costs start-up time.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # One OpenMP thread per core; "auto" binds by NUMA node and warns on
    # containers without NUMA information.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": str(os.cpu_count() or 1),
    # No hub, no telemetry.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

# vllm.LLM(...) settings that keep start-up and memory small on 2 cores.
LLM_KWARGS: dict[str, Any] = {
    "dtype": "bfloat16",
    "max_model_len": 2048,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 2048,
    "enforce_eager": True,           # no torch.compile / graph capture: ~2x faster start
    "enable_prefix_caching": True,
    "seed": 0,
}


@functools.lru_cache(maxsize=1)
def vllm_import_error() -> str | None:
    """None when ``import vllm`` works here, else the reason it does not."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # ImportError, or a broken torchvision and the like
        return f"vllm is not importable ({type(exc).__name__}: {exc}); " \
               "run: bash scripts/setup_cpu_vllm.sh"
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "e2e: end-to-end test that runs vLLM (CPU) on the tiny model")


def pytest_collection_modifyitems(config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    ours = [it for it in items if _HERE in Path(str(it.fspath)).resolve().parents]
    if not ours:
        return
    for item in ours:
        item.add_marker(pytest.mark.e2e)
    reason = vllm_import_error()
    if reason is not None:
        skip = pytest.mark.skip(reason=reason)
        for item in ours:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_cpu_env() -> dict[str, str]:
    for key, value in VLLM_CPU_ENV.items():
        os.environ.setdefault(key, value)
    return {k: os.environ[k] for k in VLLM_CPU_ENV}


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    return build_tiny_qwen3_next()


@pytest.fixture
def llm_kwargs(vllm_cpu_env, tiny_model_path) -> dict[str, Any]:
    return {"model": str(tiny_model_path), **LLM_KWARGS}
