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
    assert plugin._registered.interval_tokens == 4096
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
    assert plugin._registered.interval_tokens == -1
