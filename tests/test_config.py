"""`config.engine_settings`: one engine's ATOM_* settings from the exported
variables and vLLM's `--additional-config '{"atom_hybrid_cache": {...}}'`."""

from __future__ import annotations

import pytest

from atom_hybrid_cache.config import (ADDITIONAL_CONFIG_KEY, SERVER_ADMISSION_GATE, SERVER_COLD_FRACTIONS,
                                      SERVER_FLOOR_FRACTIONS, SERVER_STATS_LOG_INTERVAL, ConfigError,
                                      apply_env, engine_settings, load_settings, replay_defaults,
                                      server_defaults)


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
    cfg = apply_env(replay_defaults(), settings)
    assert (cfg.server.admission_gate, cfg.stats_log_interval) == ("on", 10)
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
        apply_env(replay_defaults(), engine_settings({}, {ADDITIONAL_CONFIG_KEY: ours}))
    assert message in str(e.value)


def test_a_server_differs_from_the_replay_in_four_defaults():
    server, core = server_defaults(), replay_defaults()
    assert server.placement.cold_fractions == SERVER_COLD_FRACTIONS == (0.5, 0.875)
    assert server.server.floor_fractions == SERVER_FLOOR_FRACTIONS == (0.25, 0.5)
    assert server.stats_log_interval == SERVER_STATS_LOG_INTERVAL == 100
    assert server.server.admission_gate == SERVER_ADMISSION_GATE == "auto"
    assert core.placement.cold_fractions == () and core.server.floor_fractions == ()
    assert core.stats_log_interval == 0 and core.server.admission_gate == "off"
    import dataclasses
    placement = dataclasses.replace(server.placement, cold_fractions=())
    assert placement == core.placement
    assert dataclasses.replace(server, stats_log_interval=0, placement=placement,
                               server=dataclasses.replace(server.server, admission_gate="off",
                                                          floor_fractions=())) == core


def test_the_server_gate_is_set_by_variable_or_additional_config():
    def gate(extra=None, **env):
        return load_settings(extra, server_defaults(), environ=env).server.admission_gate
    assert gate() == "auto"
    assert gate(ATOM_ADMISSION_GATE="on") == "on"
    assert gate(ATOM_ADMISSION_GATE="off") == "off"
    assert gate({ADDITIONAL_CONFIG_KEY: {"ATOM_ADMISSION_GATE": "off"}}) == "off"
    # the replay planner has no gate to switch
    assert load_settings(environ={}).server.admission_gate == "off"


def test_the_insurance_help_names_the_slot_minimum():
    from atom_hybrid_cache.config import ENV_VARS
    from atom_hybrid_cache.core.pool_budget import MIN_SLOT_CHECKPOINTS
    for var in ("ATOM_STATE_CHECKPOINT_COLD", "ATOM_STATE_CHECKPOINT_FLOOR"):
        assert f"at least {MIN_SLOT_CHECKPOINTS} checkpoints' worth" in ENV_VARS[var][3]
    assert "on for a hybrid model whose states the plugin manages" in (
        ENV_VARS["ATOM_ADMISSION_GATE"][3])


@pytest.mark.parametrize("var,section,field,given", [
    ("ATOM_STATE_CHECKPOINT_COLD", "placement", "cold_fractions", 0.875),
    ("ATOM_STATE_CHECKPOINT_FLOOR", "server", "floor_fractions", 0.5),
])
def test_a_server_default_fraction_list_empty_given_or_bad(var, section, field, given):
    def fractions(settings):
        return getattr(getattr(settings, section), field)
    assert fractions(load_settings(None, server_defaults(), environ={var: ""})) == ()
    assert fractions(load_settings({ADDITIONAL_CONFIG_KEY: {var: [given]}}, server_defaults(),
                                   environ={})) == (given,)
    # the replay planner has none unless exported
    assert fractions(load_settings(environ={})) == ()
    with pytest.raises(ConfigError) as e:
        load_settings(None, server_defaults(), environ={var: "0.5,1.5"})
    assert (f"{var.removeprefix('ATOM_').lower()} fractions must be in (0, 1), got 1.5"
            in str(e.value))
    assert var in str(e.value)
