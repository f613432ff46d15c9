"""`config.engine_settings`: one engine's ATOM_* settings from the exported
variables and vLLM's `--additional-config '{"atom_hybrid_cache": {...}}'`."""

from __future__ import annotations

import pytest

from atom_hybrid_cache.config import (ADDITIONAL_CONFIG_KEY, SERVER_ADMISSION_GATE, SERVER_COLD_FRACTIONS,
                                      SERVER_FLOOR_FRACTIONS, SERVER_STATS_LOG_INTERVAL, CacheConfig, ConfigError,
                                      apply_env, engine_config, engine_settings, server_config)


def test_exported_variables_only_when_the_engine_names_nothing():
    env = {"ATOM_ADMISSION_GATE": "on", "PATH": "/bin"}
    assert engine_settings(env, {}) == {"ATOM_ADMISSION_GATE": "on"}
    assert engine_settings(env, None) == {"ATOM_ADMISSION_GATE": "on"}
    assert engine_settings(env, {"gdn_prefill_backend": "auto"}) == {"ATOM_ADMISSION_GATE": "on"}


def test_additional_config_wins_and_takes_json_types():
    env = {"ATOM_ADMISSION_GATE": "off", "ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS": "4096"}
    extra = {ADDITIONAL_CONFIG_KEY: {"ATOM_ADMISSION_GATE": "on",
                                     "ATOM_STATE_CHECKPOINT_SPAN": [0.5, 0.875],
                                     "ATOM_STATE_CHECKPOINT_DEMAND": False,
                                     "ATOM_STATS_LOG_INTERVAL": 10}}
    settings = engine_settings(env, extra)
    assert settings == {"ATOM_ADMISSION_GATE": "on", "ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS": "4096",
                        "ATOM_STATE_CHECKPOINT_SPAN": "0.5,0.875",
                        "ATOM_STATE_CHECKPOINT_DEMAND": "0", "ATOM_STATS_LOG_INTERVAL": "10"}
    cfg = apply_env(CacheConfig(), settings)
    assert (cfg.admission_gate, cfg.stats_log_interval) == ("on", 10)
    assert cfg.placement.span_fractions == (0.5, 0.875)
    assert cfg.placement.demand is False and cfg.placement.interval_tokens == 4096


@pytest.mark.parametrize("ours,message", [
    ({"ATOM_ADMISSION_GATE": "maybe"},
     "ATOM_ADMISSION_GATE='maybe' must be one of off, on, auto (from --additional-config "
     "atom_hybrid_cache)"),
    ({"ATOM_STATE_CHECKPOINT_INTERVALL_TOKENS": 4096},
     "unknown setting --additional-config atom_hybrid_cache.ATOM_STATE_CHECKPOINT_INTERVALL_TOKENS"),
    ({"ATOM_STATE_CHECKPOINT_SPAN": {"a": 1}},
     "--additional-config atom_hybrid_cache.ATOM_STATE_CHECKPOINT_SPAN={'a': 1}: give a string"),
    ({"ATOM_STATE_CHECKPOINT_SLOTS": "-4"}, "ATOM_STATE_CHECKPOINT_SLOTS"),
    ("ATOM_ADMISSION_GATE=on", "--additional-config atom_hybrid_cache must be a JSON object"),
])
def test_a_bad_entry_names_the_setting_and_where_it_came_from(ours, message):
    with pytest.raises(ConfigError) as e:
        apply_env(CacheConfig(), engine_settings({}, {ADDITIONAL_CONFIG_KEY: ours}))
    assert message in str(e.value)


def test_a_server_differs_from_the_core_in_four_defaults():
    server, core = server_config(), CacheConfig()
    assert server.placement.cold_fractions == SERVER_COLD_FRACTIONS == (0.5, 0.875)
    assert server.placement.floor_fractions == SERVER_FLOOR_FRACTIONS == (0.25, 0.5)
    assert server.stats_log_interval == SERVER_STATS_LOG_INTERVAL == 100
    assert server.admission_gate == SERVER_ADMISSION_GATE == "auto"
    assert core.placement.cold_fractions == () and core.placement.floor_fractions == ()
    assert core.stats_log_interval == 0 and core.admission_gate == "off"
    import dataclasses
    placement = dataclasses.replace(server.placement, cold_fractions=(), floor_fractions=())
    assert placement == core.placement
    assert dataclasses.replace(server, stats_log_interval=0, admission_gate="off",
                               placement=placement) == core


def test_the_server_gate_is_set_by_variable_or_additional_config():
    assert engine_config(None, server_config(), environ={}).admission_gate == "auto"
    assert engine_config(None, server_config(),
                         environ={"ATOM_ADMISSION_GATE": "on"}).admission_gate == "on"
    assert engine_config(None, server_config(),
                         environ={"ATOM_ADMISSION_GATE": "off"}).admission_gate == "off"
    assert engine_config({ADDITIONAL_CONFIG_KEY: {"ATOM_ADMISSION_GATE": "off"}}, server_config(),
                         environ={}).admission_gate == "off"
    # the replay planner's config (the core's) has no gate to switch
    assert engine_config(environ={}).admission_gate == "off"


def test_the_gate_help_names_the_pool_minimum():
    from atom_hybrid_cache.config import ENV_VARS
    from atom_hybrid_cache.core.placement import MIN_POOL_CHECKPOINTS
    assert f"at least {MIN_POOL_CHECKPOINTS} checkpoints' worth" in ENV_VARS["ATOM_ADMISSION_GATE"][3]


@pytest.mark.parametrize("var,field,given", [
    ("ATOM_STATE_CHECKPOINT_COLD", "cold_fractions", 0.875),
    ("ATOM_STATE_CHECKPOINT_FLOOR", "floor_fractions", 0.5),
])
def test_a_server_default_fraction_list_empty_given_or_bad(var, field, given):
    cfg = engine_config(None, server_config(), environ={var: ""})
    assert getattr(cfg.placement, field) == ()
    cfg = engine_config({ADDITIONAL_CONFIG_KEY: {var: [given]}}, server_config(), environ={})
    assert getattr(cfg.placement, field) == (given,)
    # the replay planner's placement (the core's) has none unless exported
    assert getattr(engine_config(environ={}).placement, field) == ()
    with pytest.raises(ConfigError) as e:
        engine_config(None, server_config(), environ={var: "0.5,1.5"})
    assert (f"{var.removeprefix('ATOM_').lower()} fractions must be in (0, 1), got 1.5"
            in str(e.value))
    assert var in str(e.value)
