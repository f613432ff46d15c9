"""The store connector's start-up: the settings it refuses (each message
names the setting), and the llvmlite handle LMCache brings in made safe
for vLLM's CPU kernel scan."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from atom_hybrid_cache.connector.lmcache_connector import (ConnectorRefused,  # noqa: E402
                                                            check_engine)
from atom_hybrid_cache.vllm.scheduler import AtomScheduler  # noqa: E402


def _config(policy="recompute", tp=1, pp=1, caching=True, scheduler=AtomScheduler):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy=policy),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        cache_config=SimpleNamespace(enable_prefix_caching=caching),
        scheduler_config=SimpleNamespace(get_scheduler_cls=lambda: scheduler))


def test_a_serveable_engine_is_accepted():
    assert check_engine(_config()) is None


@pytest.mark.parametrize("settings, names", [
    ({"policy": "fail"}, ['"kv_load_failure_policy": "recompute"', "(it is 'fail')"]),
    ({"tp": 2}, ["--tensor-parallel-size 2", "--pipeline-parallel-size 1"]),
    ({"pp": 2}, ["--tensor-parallel-size 1", "--pipeline-parallel-size 2"]),
    ({"caching": False}, ["--enable-prefix-caching"]),
])
def test_each_unsupported_setting_is_refused_naming_it(settings, names):
    with pytest.raises(ConnectorRefused) as refused:
        check_engine(_config(**settings))
    for name in names:
        assert name in str(refused.value)


def test_vllms_own_scheduler_is_refused():
    from vllm.v1.core.sched.scheduler import Scheduler
    with pytest.raises(ConnectorRefused, match="VLLM_PLUGINS=atom_hybrid_cache"):
        check_engine(_config(scheduler=Scheduler))


def test_the_llvmlite_handle_no_longer_breaks_vllms_cpu_kernel_scan():
    # without the guard (a fresh process): what vLLM's scan reads fails
    unguarded = subprocess.run(
        [sys.executable, "-c", "import llvmlite.binding.ffi as f; vars(f.lib).get('kernel')"],
        capture_output=True, text=True)
    assert unguarded.returncode == 1
    assert "'_lib_fn_wrapper' object has no attribute 'get'" in unguarded.stderr

    import llvmlite.binding.ffi as ffi
    from vllm.triton_utils.dispatcher import _rebind_kernels

    from atom_hybrid_cache.vllm.llvmlite_guard import make_llvmlite_scan_safe
    assert make_llvmlite_scan_safe() is True
    assert not hasattr(ffi.lib, "__dict__")
    assert callable(ffi.lib.LLVMPY_GetVersionInfo)   # llvmlite's own calls unchanged
    _rebind_kernels([])   # the scan over every module: no error
