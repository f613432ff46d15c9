"""The `vllm.general_plugins` entry point: loaded by vLLM's own plugin
loader, a no-op unless enabled by name, idempotent, and a bad ATOM_* value
stops it with the variable named."""

import importlib.metadata as md
import logging

import pytest

from atom_hybrid_cache.config import ConfigError
from atom_hybrid_cache.vllm import plugin


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    for var in list(__import__("os").environ):
        if var.startswith("ATOM_"):
            monkeypatch.delenv(var)
    plugin._reset_for_tests()
    yield
    plugin._reset_for_tests()


def test_entry_point_is_declared():
    eps = md.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "atom_hybrid_cache"]
    assert len(ours) == 1
    assert ours[0].value == "atom_hybrid_cache.vllm.plugin:register"


def test_not_enabled_does_nothing(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setenv("ATOM_STATE_CHECKPOINT_DEMAND", "maybe")  # would fail if parsed
    plugin.register()
    assert plugin._registered is None
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    plugin.register()
    assert plugin._registered is None


def test_enabled_parses_once_and_is_idempotent(monkeypatch, caplog):
    monkeypatch.setenv("VLLM_PLUGINS", "other,atom_hybrid_cache")
    monkeypatch.setenv("ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS", "4096")
    with caplog.at_level(logging.INFO, logger="atom_hybrid_cache"):
        plugin.register()
        plugin.register()
    assert plugin._registered.placement.interval_tokens == 4096
    assert sum("atom_hybrid_cache enabled" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("var,value", [
    ("ATOM_STATE_CHECKPOINT_DEMAND", "yes"),
    ("ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS", "8k"),
    ("ATOM_STATE_CHECKPOINT_SLOTS", "-3"),
    ("ATOM_STATE_CHECKPOINT_EVICTION", "fifo"),
    ("ATOM_NO_SUCH_SETTING", "1"),
])
def test_bad_setting_names_the_variable(monkeypatch, var, value):
    monkeypatch.setenv("VLLM_PLUGINS", "atom_hybrid_cache")
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as e:
        plugin.register()
    msg = str(e.value)
    assert var in msg or (var == "ATOM_STATE_CHECKPOINT_SLOTS" and "state_checkpoint_slots" in msg
                          and var in msg)


def test_vllm_loader_calls_register(monkeypatch):
    """vLLM's own loader finds the entry point and runs it."""
    plugins = pytest.importorskip("vllm.plugins")
    monkeypatch.setenv("VLLM_PLUGINS", "atom_hybrid_cache")
    monkeypatch.setenv("ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS", "-1")
    monkeypatch.setattr(plugins, "plugins_loaded", False, raising=False)
    plugins.load_general_plugins()
    assert plugin._registered is not None
    assert plugin._registered.placement.interval_tokens == -1


# -- the scheduler class (registration.default_scheduler_class) -------------

def _enable_with_patch(monkeypatch, patched: str):
    """Enable and register the plugin as vLLM would; the patch of `patched`
    must be listed against the vLLM version it was written for."""
    pytest.importorskip("vllm")
    from atom_hybrid_cache.vllm import registration

    monkeypatch.setenv("VLLM_PLUGINS", "atom_hybrid_cache")
    plugin.register()
    assert any(patched in what and version == "0.32.0" for what, version in registration.PATCHES)
    return registration


def _scheduler_config(**kwargs):
    from vllm.config.scheduler import SchedulerConfig
    return SchedulerConfig.default_factory(**kwargs)


def test_enabled_plugin_makes_our_scheduler_the_default(monkeypatch, caplog):
    """`VLLM_PLUGINS=atom_hybrid_cache vllm serve MODEL` with no
    --scheduler-cls builds AtomScheduler (AtomAsyncScheduler with async
    scheduling); without the patch vLLM answers its own Scheduler and the
    plugin's placement, eviction order and stats never run."""
    registration = _enable_with_patch(monkeypatch, "get_scheduler_cls")
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from atom_hybrid_cache.vllm.scheduler import AtomAsyncScheduler, AtomScheduler

    with caplog.at_level(logging.INFO, logger="atom_hybrid_cache"):
        assert _scheduler_config(async_scheduling=False).get_scheduler_cls() is AtomScheduler
        assert _scheduler_config(async_scheduling=True).get_scheduler_cls() is AtomAsyncScheduler
    assert "atom_hybrid_cache: scheduler AtomScheduler (vLLM's --scheduler-cls is unset)" in \
        caplog.messages

    # an explicit class wins; one that is not ours is warned about
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="atom_hybrid_cache"):
        mine = _scheduler_config(async_scheduling=False,
                                 scheduler_cls="atom_hybrid_cache.vllm.scheduler.AtomScheduler")
        assert mine.get_scheduler_cls() is AtomScheduler
        assert not [r for r in caplog.records
                    if r.name == "atom_hybrid_cache" and r.levelno >= logging.WARNING]
        other = _scheduler_config(async_scheduling=False,
                                  scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler")
        assert other.get_scheduler_cls() is Scheduler
    assert [r.message for r in caplog.records
            if r.name == "atom_hybrid_cache" and r.levelno >= logging.WARNING] == [
        "atom_hybrid_cache: --scheduler-cls Scheduler is not ours: checkpoint placement, "
        "eviction order and stats are vLLM's (unset it, or subclass "
        "atom_hybrid_cache.vllm.scheduler.AtomScheduler)"]

    # read at the call: an engine built later without the plugin named gets
    # vLLM's classes, and registering again wraps nothing twice
    monkeypatch.delenv("VLLM_PLUGINS")
    assert _scheduler_config(async_scheduling=False).get_scheduler_cls() is Scheduler
    assert _scheduler_config(async_scheduling=True).get_scheduler_cls() is AsyncScheduler
    from vllm.config.scheduler import SchedulerConfig
    wrapped = SchedulerConfig.get_scheduler_cls
    registration.default_scheduler_class()
    assert SchedulerConfig.get_scheduler_cls is wrapped
    assert not hasattr(wrapped.__wrapped__, "__wrapped__")


# -- the prefix-hash unit (registration.default_hash_unit) ----------

def _hash_unit(block_size, prefix_match_unit, ours=True):
    """vLLM's (scheduler block, hash unit) for qwen3.5-27b-like geometry, as
    EngineCore resolves them (scheduler bench's build_configs, no model):
    `block_size` None is vLLM's default 16 (a 400-token hybrid block), 64
    gives 448-token blocks; `ours` declares AtomGDNSpec state groups."""
    from scheduler_bench_module import load_scheduler_bench

    from atom_hybrid_cache.vllm.spec import AtomGDNSpec

    SB = load_scheduler_bench()
    built = SB.build_configs(SB.Policy("probe", block_size, prefix_match_unit),
                             concurrency=2, budget_bytes=4 * SB.GIB, max_model_len=32_768,
                             mamba_spec_cls=AtomGDNSpec if ours else None)
    return built.scheduler_block_size, built.hash_block_size


def test_enabled_plugin_hashes_prefixes_on_64_token_units(monkeypatch, caplog):
    """`VLLM_PLUGINS=atom_hybrid_cache vllm serve MODEL --enable-prefix-caching`
    with no --prefix-match-unit: vLLM would hash on its 400-token hybrid
    block (a prompt could resume only at multiples of 400, and one shorter
    than 400 tokens never); with the plugin the unit is the block's largest
    divisor up to 64 (50 for 400, 64 for 448). Without the patch the
    first assertion fails with (400, 400); with the earlier rule, gcd(64,
    block), with (400, 16). The scheduler bench's `plugin-default-block`
    runs the unit the plugin asks for."""
    registration = _enable_with_patch(monkeypatch, "resolve_kv_cache_block_sizes")
    with caplog.at_level(logging.INFO, logger="atom_hybrid_cache"):
        assert _hash_unit(None, None) == (400, 50)
        assert _hash_unit(64, None) == (448, 64)
    from scheduler_bench_module import load_scheduler_bench
    assert load_scheduler_bench().POLICIES["plugin-default-block"].prefix_match_unit == 50
    assert ("atom_hybrid_cache: prefix hashes every 64 tokens (vLLM's --prefix-match-unit "
            "is unset; blocks are 448 tokens)") in caplog.messages
    # an explicit unit wins; vLLM's own state groups are not ours to change
    assert _hash_unit(64, 64) == (448, 64)
    assert _hash_unit(64, 448) == (448, 448)
    assert _hash_unit(None, None, ours=False) == (400, 400)
    # read at the call: without the plugin named, vLLM's default
    monkeypatch.delenv("VLLM_PLUGINS")
    assert _hash_unit(None, None) == (400, 400)
    assert _hash_unit(64, None) == (448, 448)
    # wrapped once, and vllm.v1.engine.core calls the wrapper
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.engine import core
    wrapped = kv_cache_utils.resolve_kv_cache_block_sizes
    registration.default_hash_unit()
    assert kv_cache_utils.resolve_kv_cache_block_sizes is wrapped
    assert core.resolve_kv_cache_block_sizes is wrapped
    assert not hasattr(wrapped.__wrapped__, "__wrapped__")


def test_largest_unit_dividing_the_blocks():
    from atom_hybrid_cache.core.hash_unit import largest_unit_dividing
    assert largest_unit_dividing([400], 64) == 50
    assert largest_unit_dividing([448], 64) == 64
    assert largest_unit_dividing([128, 64], 64) == 64
    assert largest_unit_dividing([1568], 64) == 56     # 2^5 * 7^2
    assert largest_unit_dividing([1072], 64) == 16     # 16 * 67: no divisor in 17..64
    assert largest_unit_dividing([400, 600], 64) == 50  # gcd 200
    assert largest_unit_dividing([48], 64) == 48


# -- settings through vLLM's --additional-config ----------------------------

def _plugin_scheduler(additional_config):
    from scheduler_bench_module import load_scheduler_bench

    SB = load_scheduler_bench()
    spec_cls, sched_cls, register = SB.load_plugin()
    register()
    built = SB.build_configs(SB.POLICIES["plugin"], concurrency=2, budget_bytes=4 * SB.GIB,
                             max_model_len=32_768, mamba_spec_cls=spec_cls)
    built.vllm_config.additional_config = additional_config
    return SB.make_scheduler(built, sched_cls)


def test_additional_config_sets_the_engines_settings(monkeypatch, caplog):
    """`--additional-config '{"atom_hybrid_cache": {...}}'` reaches our
    scheduler, over an exported variable; a bad entry stops the engine at
    start-up naming it."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("ATOM_ADMISSION_ORDER", "arrival")
    plain = _plugin_scheduler({})
    # a server's defaults: the gate auto, so on (test_admission_gate.py),
    # stats every 100 admissions (the replay's 0)
    assert plain.atom.planner is not None and not plain.atom.hits_first
    assert plain.atom.gate is not None
    assert plain.atom.planner.stats_log_interval == 100
    with caplog.at_level(logging.INFO, logger="atom_hybrid_cache"):
        tuned = _plugin_scheduler({"atom_hybrid_cache": {"ATOM_ADMISSION_ORDER": "hits-first",
                                                         "ATOM_ADMISSION_GATE": "off",
                                                         "ATOM_STATE_CHECKPOINT_SPAN": [0.5, 0.875],
                                                         "ATOM_STATS_LOG_INTERVAL": 7}})
    assert tuned.atom.hits_first and tuned.atom.gate is None
    assert tuned.atom.planner.policy.placement.span_fractions == (0.5, 0.875)
    assert tuned.atom.planner.stats_log_interval == 7
    assert any(m.startswith("atom_hybrid_cache: settings from --additional-config: ")
               for m in caplog.messages)
    with pytest.raises(ConfigError, match=r"ATOM_ADMISSION_GATE='yes' must be one of off, on, auto "
                                          r"\(from --additional-config atom_hybrid_cache\)"):
        _plugin_scheduler({"atom_hybrid_cache": {"ATOM_ADMISSION_GATE": "yes"}})


def test_the_vllm_release_it_was_written_for():
    from atom_hybrid_cache.vllm import registration
    assert registration.WRITTEN_FOR_VLLM == "0.32"
    assert all(map(registration.written_for, ["0.32.0", "0.32.0+cpu", "0.32.3"]))
    assert not any(map(registration.written_for, ["0.33.0", "0.3.2", "1.32.0", "0.31.9+cpu"]))


def test_another_vllm_release_is_warned_about_and_runs_vllms_own_steps(monkeypatch, caplog):
    pytest.importorskip("vllm")
    from atom_hybrid_cache.vllm import registration, state_manager
    monkeypatch.setattr(state_manager.AtomStateManager, "steady_shortcuts", True)
    with caplog.at_level(logging.WARNING, logger="atom_hybrid_cache"):
        assert registration.check_vllm_version()          # the installed vLLM 0.32
        assert registration.check_vllm_version("0.32.0+cpu")
        assert state_manager.AtomStateManager.steady_shortcuts
        assert not registration.check_vllm_version("0.33.1")
    assert not state_manager.AtomStateManager.steady_shortcuts
    assert [r.getMessage() for r in caplog.records] == [
        "atom_hybrid_cache was written for vLLM 0.32.x and this is vLLM 0.33.1: the scheduler "
        "and state managers subclass vLLM's and may not fit it; the steady-step shortcuts are "
        "off. Pin vllm==0.32.* for the tested setup"]
