"""Fixtures for the end-to-end tests: vLLM 0.32 (CPU build) on a tiny random
Qwen3-Next (3 Gated-DeltaNet layers + 1 full attention layer).

Everything under tests/e2e is skipped, with the reason, when vLLM cannot be
imported here (install it with ``bash scripts/setup_cpu_vllm.sh``). Test
modules should import vllm inside their tests or fixtures (or start with
``vllm = pytest.importorskip("vllm")``), never bare at module level, so that
collection itself does not fail where vLLM is missing.

Fixtures:

* ``tiny_model_path`` (session): folder of the tiny model, built once and
  cached (see ``tiny_model.py``; ``$ATOMHC_TEST_MODEL_CACHE`` moves the cache).
* ``vllm_cpu_env`` (session): the environment variables that keep vLLM small
  and quiet on a 2-core machine, applied to ``os.environ`` (setdefault: an
  exported value wins). Among them ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the
  engine core runs inside the test process, which starts in ~5 s instead of
  ~35 s (no spawned engine-core and worker processes re-importing vLLM) and
  lets a test reach the scheduler, the KV cache manager and the model through
  ``llm.llm_engine.engine_core.engine_core``. Tests of the multiprocess path
  (what ``vllm serve`` runs) must say so: ``make_llm(multiprocess=True)``.
* ``llm_kwargs``: keyword arguments for ``vllm.LLM`` (model included) that
  keep start-up and memory small on 2 cores; override any of them per test.
* ``make_llm``: factory ``make_llm(**overrides) -> vllm.LLM``; every engine it
  made is shut down when the test ends.
* ``tiny_llm`` (module): one in-process ``vllm.LLM`` with ``LLM_KWARGS``,
  shared by the tests of a module.
* ``pressure_bench`` (session): ``benchmarks/e2e_pressure.py`` as a module;
  ``elided_workload`` and ``scaled_plan_workload`` (session): the two trace
  workloads of its replay tests, built once.

Start-up measured on the 2-core machine (loaded by other work): import vllm
15-20 s, then ``LLM()`` 5-7 s in-process (35-50 s with the engine-core
process), and a first ``generate`` of 4-7 s (kernel warm-up); later 600-token
prompts take 0.2-0.6 s each.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:          # "import tiny_model" from the tests
    sys.path.insert(0, str(_HERE))

from tiny_model import build_tiny_qwen3_next  # noqa: E402

from tiny_model import VLLM_CPU_ENV  # noqa: E402  (shared with benchmarks/e2e_pressure.py)

# vllm.LLM(...) settings that keep start-up and memory small on 2 cores.
LLM_KWARGS: dict[str, Any] = {
    "dtype": "bfloat16",
    "max_model_len": 2048,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 2048,
    "enforce_eager": True,           # no torch.compile / graph capture: ~2x faster start
    "enable_prefix_caching": True,   # mamba_cache_mode becomes "align"
    "seed": 0,
    # The CPU GDN kernel requires bfloat16 ("CPU GDN attention requires BF16").
    # block_size: the tiny model keeps the CPU default of 128 (see
    # tiny_model.TINY_CONFIG); pass block_size=64 for finer blocks.
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
    config.addinivalue_line(
        "markers", "slow: e2e test that starts vLLM's engine-core process (~1 min)")


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


@pytest.fixture(autouse=True)
def _llvmlite_made_scan_safe():
    """A test that imports LMCache loads llvmlite into this process, and
    every vLLM CPU engine started after that fails its kernel scan, plugin
    or not ("'_lib_fn_wrapper' object has no attribute 'get'";
    docs/vllm_032_notes.md section 7): make the handle safe after each test,
    as the plugin does where it is enabled."""
    yield
    if "llvmlite.binding.ffi" in sys.modules:
        from atom_hybrid_cache.vllm.llvmlite_guard import make_llvmlite_scan_safe
        make_llvmlite_scan_safe()


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


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # best effort: the engine may already be gone
        pass


def _new_llm(model_path: Path, multiprocess: bool = False, **overrides):
    import vllm
    import vllm.envs

    # vLLM caches its environment once an engine starts (enable_envs_cache);
    # drop that cache so this engine reads the variable set below.
    if hasattr(vllm.envs, "disable_envs_cache"):
        vllm.envs.disable_envs_cache()
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    saved = os.environ.get(key)
    os.environ[key] = "1" if multiprocess else "0"
    try:
        return vllm.LLM(**{"model": str(model_path), **LLM_KWARGS, **overrides})
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


@pytest.fixture
def make_llm(vllm_cpu_env, tiny_model_path) -> Iterator[Callable[..., Any]]:
    made = []

    def factory(multiprocess: bool = False, **overrides):
        llm = _new_llm(tiny_model_path, multiprocess=multiprocess, **overrides)
        made.append(llm)
        return llm

    yield factory
    for llm in made:
        _shutdown(llm)
    made.clear()
    gc.collect()


@pytest.fixture(scope="module")
def tiny_llm(vllm_cpu_env, tiny_model_path):
    llm = _new_llm(tiny_model_path)
    yield llm
    _shutdown(llm)
    del llm
    gc.collect()


@pytest.fixture(scope="session")
def pressure_bench():
    """benchmarks/e2e_pressure.py as a module: the trace workload, the budget
    rule and the policies the e2e replay tests share with the benchmark."""
    from benchmark_modules import load_benchmark
    return load_benchmark("e2e_pressure")


@pytest.fixture(scope="session")
def elided_workload(pressure_bench):
    """The bench's default workload: its 4 short cc traces, prompts capped
    at 2,000 tokens (ELIDE rule), 4 conversations in flight, 128-token
    blocks: ``(convs, LockstepWorkload)``."""
    E = pressure_bench
    try:
        paths = E.resolve_trace_paths(None)
    except FileNotFoundError as exc:
        pytest.skip(f"shared cc traces not available: {exc}")
    convs = E.build_workload(paths, 2000)
    return convs, E.lockstep_workload(convs, 4, E.BLOCK_SIZE)


@pytest.fixture(scope="session")
def scaled_plan_workload(pressure_bench):
    """The plan's workload at 8 tokens per trace id (the bench's SCALE
    rule): ``(paths, convs, rounds, sent)`` of the 14 cc traces whose
    prompts all fit in 64k tokens, 4 conversations in flight. Built once
    (about 8 s) for the modules that use it."""
    E = pressure_bench
    if not E.DEFAULT_TRACE_DIR.is_dir():
        pytest.skip(f"shared cc traces not available in {E.DEFAULT_TRACE_DIR}")
    paths = E.traces_fitting(64000)
    convs = E.build_workload(paths, 0, tokens_per_id=8)
    rounds = E.lockstep_rounds(convs, 4)
    return paths, convs, rounds, E.send_order(convs, rounds)
