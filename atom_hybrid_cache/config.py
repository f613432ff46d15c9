"""Every setting of the package and its `ATOM_*` environment variables.

One place parses and validates them, at start-up, with errors that name the
offending setting. Unset variables change nothing: the defaults stand.

Two groups, by who reads them:
- `PlacementConfig`: where checkpoints go and how they leave (the core's
  policy: the replay planner and the vLLM plugin both);
- `ServerConfig`: what only the vLLM plugin does (admission, floors,
  interior checkpoints).
`Settings` carries both and the two plain numbers both read. The replay
planner's own pools, sized from the model's geometry and the memory budget
rather than set by a variable, are `core/replay_pool_config.py`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

EVICTION_POLICIES = ("reuse-aware", "lru")
INTERIOR_CHECKPOINT_MODES = ("off", "on")
ADMISSION_ORDERS = ("arrival", "hits-first")
ADMISSION_GATE_MODES = ("off", "on", "auto")
# Steps the admission gate may hold a request (vllm/admission_gate.py).
ADMISSION_GATE_MAX_HOLD_STEPS = 32

# The largest prefix-hash unit the plugin asks of vLLM where its
# `--prefix-match-unit` is unset (vLLM's own is the state-page-sized block,
# and a resume lands only on a unit boundary).
MAX_HASH_UNIT_TOKENS = 64

# The vLLM plugin's defaults where the replay planner's differ (its own state
# slots lose with the cold checkpoints; floors hold pages of vLLM's shared pool):
SERVER_STATS_LOG_INTERVAL = 100         # admissions between two stats reports
SERVER_COLD_FRACTIONS = (0.5, 0.875)    # ATOM_STATE_CHECKPOINT_COLD
SERVER_FLOOR_FRACTIONS = (0.25, 0.5)    # ATOM_STATE_CHECKPOINT_FLOOR
SERVER_ADMISSION_GATE = "auto"          # ATOM_ADMISSION_GATE


class ConfigError(ValueError):
    """A setting has a bad value; the message names the setting."""


def _at_least(name: str, v: int, low: int) -> None:
    if not isinstance(v, int) or v < low:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ConfigError(f"{name} must be {what}, got {v!r}")


def check_positive(name: str, v: int) -> None:
    _at_least(name, v, 1)


def check_non_negative(name: str, v: int) -> None:
    _at_least(name, v, 0)


def _one_of(name: str, v, choices: tuple) -> None:
    if v not in choices:
        raise ConfigError(f"{name} must be one of {choices}, got {v!r}")


def _fractions(name: str, values: tuple) -> None:
    for f in values:
        if not 0.0 < f < 1.0:
            raise ConfigError(f"{name} fractions must be in (0, 1), got {f!r}")


@dataclass(frozen=True)
class PlacementConfig:
    """Where checkpoints go and how they are evicted (the core's policy)."""

    # The meaning of each field is its ATOM_* variable's (ENV_VARS below).
    interval_tokens: int = -1
    demand: bool = True
    anchor: bool = True
    anchor_margin_tokens: int = 1
    eviction: str = "reuse-aware"
    # None: auto (core/priced_eviction.py: priced where a request slot's
    # share of the pool is under 32 checkpoints' worth)
    eviction_price_weight: Optional[float] = None
    cut_backoffs: tuple = (0.03, 0.15, 0.4)
    fallback_fractions: tuple = (0.5, 0.85)
    # On release, the highest state at or below each of these fractions of
    # the prefix leaves with the prefix's KV, in its unit (vLLM's shared
    # pool): a conversation's recent anchors slide down to the lower
    # fractions instead of aging out while their KV stays in use.
    retain_fractions: tuple = (0.5, 0.75, 0.875, 0.94)
    # A prompt resumed below half its length (a conversation's start) also
    # keeps a checkpoint at each of these fractions: its only other states
    # are its turns' anchors, near the top.
    cold_fractions: tuple = ()
    span_fractions: tuple = ()
    # protected anchors/cut checkpoints per request slot (max_num_seqs).
    protected_per_seq: int = 7
    # clients rewrite the last 1-3 blocks of 64 tokens now and then: a long
    # recompute insures its anchor a little below it
    insure_recompute_tokens: int = 16384
    insure_distance_tokens: int = 256
    # kinds filed in the replay manager's protected tier (None: the
    # core's `kinds.PROTECTED_KINDS`)
    protected_kinds: Optional[frozenset] = None

    def __post_init__(self) -> None:
        if not isinstance(self.interval_tokens, int) or self.interval_tokens < -1:
            raise ConfigError("state_checkpoint_interval_tokens must be > 0, 0 (off) or -1 "
                              f"(no ladder), got {self.interval_tokens!r}")
        check_non_negative("state_checkpoint_anchor_margin", self.anchor_margin_tokens)
        _one_of("state_checkpoint_eviction", self.eviction, EVICTION_POLICIES)
        w = self.eviction_price_weight
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, float))
                              or not 0 <= w < float("inf")):
            raise ConfigError(f"eviction_price_weight must be auto or a number >= 0, got {w!r}")
        for f in self.cut_backoffs:
            if not 0.0 <= f < 1.0:
                raise ConfigError(f"state_checkpoint_cut_backoff fractions must be in [0, 1), "
                                  f"got {f!r}")
        _fractions("state_checkpoint_fallback", self.fallback_fractions)
        _fractions("state_checkpoint_retain", self.retain_fractions)
        _fractions("state_checkpoint_cold", self.cold_fractions)
        _fractions("state_checkpoint_span", self.span_fractions)
        check_non_negative("protected_per_seq", self.protected_per_seq)
        check_non_negative("state_checkpoint_insure_tokens", self.insure_recompute_tokens)
        check_non_negative("state_checkpoint_insure_distance", self.insure_distance_tokens)


@dataclass(frozen=True)
class ServerConfig:
    """What only the vLLM plugin does; the defaults are a server's. Each
    field means what its ATOM_* variable says (ENV_VARS below)."""

    interior_checkpoints: str = "off"       # vllm/interior_cpu.py
    admission_order: str = "arrival"        # vllm/admission_order.py
    admission_gate: str = SERVER_ADMISSION_GATE   # vllm/admission_gate.py
    floor_fractions: tuple = SERVER_FLOOR_FRACTIONS   # vllm/floor_states.py
    replayssm: bool = False                 # vllm/replayssm.py
    replayssm_cache_len: Optional[int] = None   # None: 2 * (k + 1)

    def __post_init__(self) -> None:
        _one_of("interior_checkpoints", self.interior_checkpoints, INTERIOR_CHECKPOINT_MODES)
        if self.replayssm_cache_len is not None:
            check_positive("replayssm_cache_len", self.replayssm_cache_len)
        _one_of("admission_order", self.admission_order, ADMISSION_ORDERS)
        _one_of("admission_gate", self.admission_gate, ADMISSION_GATE_MODES)
        _fractions("state_checkpoint_floor", self.floor_fractions)


@dataclass(frozen=True)
class Settings:
    """Every ATOM_* setting of one vLLM engine or one replay."""

    placement: PlacementConfig = field(default_factory=PlacementConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    # the replay planner's checkpoint-only state slots (None: its default)
    state_checkpoint_slots: Optional[int] = None
    # print the stats lines every N admissions (0: never)
    stats_log_interval: int = 0

    def __post_init__(self) -> None:
        if self.state_checkpoint_slots is not None:
            check_non_negative("state_checkpoint_slots", self.state_checkpoint_slots)
        check_non_negative("stats_log_interval", self.stats_log_interval)


def server_defaults() -> Settings:
    """A vLLM server's settings before its ATOM_* variables."""
    return Settings(PlacementConfig(cold_fractions=SERVER_COLD_FRACTIONS), ServerConfig(),
                    stats_log_interval=SERVER_STATS_LOG_INTERVAL)


def replay_defaults() -> Settings:
    """The replay planner's settings before its ATOM_* variables: no cold
    ladder, no floors, no gate, no periodic stats."""
    return Settings(PlacementConfig(), ServerConfig(admission_gate="off", floor_fractions=()))


# -- environment ---------------------------------------------------------

def _parse_number(kind: type, what: str):
    def parse(var: str, raw: str):
        try:
            return kind(raw.strip())
        except ValueError:
            raise ConfigError(f"{var}={raw!r} is not {what}") from None
    return parse


_parse_int = _parse_number(int, "an integer")
_parse_float = _parse_number(float, "a number")


def _parse_auto_or_float(var: str, raw: str) -> Optional[float]:
    return None if raw.strip() in ("", "auto") else _parse_float(var, raw)


def _parse_switch(var: str, raw: str) -> bool:
    if raw.strip() not in ("0", "1"):
        raise ConfigError(f"{var}={raw!r} must be 1 (on) or 0 (off)")
    return raw.strip() == "1"


def _parse_choice(choices):
    def parse(var: str, raw: str) -> str:
        v = raw.strip()
        if v not in choices:
            raise ConfigError(f"{var}={raw!r} must be one of {', '.join(choices)}")
        return v
    return parse


def _parse_fractions(var: str, raw: str) -> tuple:
    if not raw.strip():
        return ()
    return tuple(_parse_float(var, x) for x in raw.split(","))


# variable -> (section, field, parser, help); the section is "placement",
# "server" or "settings" (a field of `Settings` itself)
ENV_VARS: dict[str, tuple[str, str, Callable, str]] = {
    "ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS": (
        "placement", "interval_tokens", _parse_int,
        ">0 a ladder rung every N tokens (snapped down to the block size); 0 no state "
        "checkpoints at all; -1 no ladder, anchor and demand rungs only"),
    "ATOM_STATE_CHECKPOINT_DEMAND": (
        "placement", "demand", _parse_switch,
        "1/0: place a checkpoint where a request wanted to resume but found none"),
    "ATOM_STATE_CHECKPOINT_SLOTS": (
        "settings", "state_checkpoint_slots", _parse_int,
        "replay planner: checkpoint-only state slots on top of max_num_seqs*(1+num_spec), "
        "paid from the KV budget"),
    "ATOM_STATE_CHECKPOINT_EVICTION": (
        "placement", "eviction", _parse_choice(EVICTION_POLICIES),
        "reuse-aware (a freed request's states leave in units with their KV, from the top) "
        "or lru"),
    "ATOM_EVICTION_PRICE_WEIGHT": (
        "placement", "eviction_price_weight", _parse_auto_or_float,
        "with reuse-aware eviction: a freed unit whose loss would cost a resume every token of "
        "its pages stays this many times the pool's pages longer in the free queue, a cheaper "
        "unit in proportion; 0: vLLM's FIFO order; auto (the default): 0.25 where a request "
        "slot's share of the pool holds fewer than 32 checkpoints' worth, else 0"),
    "ATOM_STATE_CHECKPOINT_ANCHOR_MARGIN": (
        "placement", "anchor_margin_tokens", _parse_int,
        "tokens at a prompt's end assumed to change when the client appends"),
    "ATOM_STATE_CHECKPOINT_CUT_BACKOFF": (
        "placement", "cut_backoffs", _parse_fractions,
        "comma list: after a KV tail cut, keep checkpoints these fractions below the surviving "
        "prefix"),
    "ATOM_STATE_CHECKPOINT_FALLBACK": (
        "placement", "fallback_fractions", _parse_fractions,
        "comma list of fractions of the pool share for fallback rungs in prompts longer than "
        "that share"),
    "ATOM_STATE_CHECKPOINT_RETAIN": (
        "placement", "retain_fractions", _parse_fractions,
        "comma list: on release, the highest state at or below each fraction of the prefix is "
        "kept with its KV"),
    "ATOM_STATE_CHECKPOINT_COLD": (
        "placement", "cold_fractions", _parse_fractions,
        "comma list: a prompt resumed below half its length also keeps a checkpoint at each "
        "fraction of its length (unset: 0.5,0.875 in a vLLM server where a request slot's "
        "share of the pool holds at least 32 checkpoints' worth, none in the replay planner; "
        "empty: none)"),
    "ATOM_STATE_CHECKPOINT_SPAN": (
        "placement", "span_fractions", _parse_fractions,
        "comma list: any prompt also keeps a checkpoint at each fraction of its length that its "
        "prefill computes (above its hit; unset: none)"),
    "ATOM_STATE_CHECKPOINT_FLOOR": (
        "server", "floor_fractions", _parse_fractions,
        "comma list: a request waiting for admission or running holds the highest state at or "
        "below each fraction of its prompt until its release (unset: 0.25,0.5 in a vLLM "
        "server where a request slot's share of the pool holds at least 32 checkpoints' "
        "worth; empty: none)"),
    "ATOM_STATE_CHECKPOINT_INSURE_TOKENS": (
        "placement", "insure_recompute_tokens", _parse_int,
        "a prefill recomputing at least N tokens also keeps a checkpoint a little below its "
        "anchor (0: never)"),
    "ATOM_STATE_CHECKPOINT_INSURE_DISTANCE": (
        "placement", "insure_distance_tokens", _parse_int,
        "how many tokens below the anchor that insurance checkpoint sits (rounded up to a "
        "block)"),
    "ATOM_INTERIOR_CHECKPOINTS": (
        "server", "interior_checkpoints", _parse_choice(INTERIOR_CHECKPOINT_MODES),
        "on: write checkpoints from inside a prefill forward where the platform has the "
        "extraction path (vLLM's CPU GDN path; elsewhere chunks are still cut); "
        "off: cut prefill chunks onto them"),
    "ATOM_ADMISSION_ORDER": (
        "server", "admission_order", _parse_choice(ADMISSION_ORDERS),
        "hits-first: among the first max_num_seqs waiting requests, admit those that resume on "
        "a cached prefix first, largest hit first; arrival: vLLM's order"),
    "ATOM_ADMISSION_GATE": (
        "server", "admission_gate", _parse_choice(ADMISSION_GATE_MODES),
        "on: a waiting request whose prefill would evict the cached prefixes of the requests "
        f"waiting with it waits for the running ones to finish ({ADMISSION_GATE_MAX_HOLD_STEPS} "
        "steps at most), and those prefixes cannot be evicted while a step is scheduled; off: "
        "vLLM's admission; auto (a vLLM server's default): on for a hybrid model whose states the "
        "plugin manages, off otherwise"),
    "ATOM_ENABLE_REPLAYSSM": (
        "server", "replayssm", _parse_switch,
        "1: one state page per request under speculative decoding, not 1 + k (environment "
        "only; no effect without --speculative-config)"),
    "ATOM_REPLAYSSM_CACHE_LEN": (
        "server", "replayssm_cache_len", _parse_int,
        "records a ReplaySSM page holds (unset: the least, 2 * (k + 1); less is raised)"),
    "ATOM_STATS_LOG_INTERVAL": (
        "settings", "stats_log_interval", _parse_int,
        "print the cache log lines every N admissions (0: never; a vLLM server's default 100)"),
}


# Settings read before vLLM reads --additional-config (the model class).
ENVIRONMENT_ONLY = ("ATOM_ENABLE_REPLAYSSM",)

# vLLM's channel for options of what it loads (its own GDN layers read
# theirs there too): `--additional-config '{"atom_hybrid_cache": {...}}'`.
ADDITIONAL_CONFIG_KEY = "atom_hybrid_cache"


def engine_settings(environ: Optional[Mapping[str, str]] = None,
                    additional_config: object = None) -> dict:
    """The ATOM_* settings of one vLLM engine, as `apply_env` takes them:
    the exported variables, then the entries of `--additional-config
    '{"atom_hybrid_cache": {"ATOM_...": value}}'`, which win. A value may be
    a string, number, boolean (1/0) or list (comma-joined); each is parsed
    here, so an error names where it came from."""
    env = os.environ if environ is None else environ
    out = {k: v for k, v in env.items() if k.startswith("ATOM_")}
    ours = additional_config.get(ADDITIONAL_CONFIG_KEY) \
        if isinstance(additional_config, Mapping) else None
    if ours is None:
        return out
    where = f"--additional-config {ADDITIONAL_CONFIG_KEY}"
    if not isinstance(ours, Mapping):
        raise ConfigError(f"{where} must be a JSON object of ATOM_* settings, "
                          f"not {type(ours).__name__}")
    for var, value in ours.items():
        if var not in ENV_VARS:
            raise ConfigError(f"unknown setting {where}.{var}; known: "
                              f"{', '.join(sorted(ENV_VARS))}")
        if var in ENVIRONMENT_ONLY:
            raise ConfigError(f"{where}.{var}: set {var} in the environment of `vllm serve` "
                              "instead (it chooses the model class, before vLLM reads "
                              "--additional-config)")
        if isinstance(value, bool):
            raw = "1" if value else "0"
        elif isinstance(value, (int, float, str)):
            raw = str(value)
        elif isinstance(value, (list, tuple)) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
            raw = ",".join(str(x) for x in value)
        else:
            raise ConfigError(f"{where}.{var}={value!r}: give a string, number, boolean or "
                              "list of numbers")
        try:
            ENV_VARS[var][2](var, raw)
        except ConfigError as e:
            raise ConfigError(f"{e} (from {where})") from None
        out[var] = raw
    return out


def load_settings(additional_config: object = None, base: Optional[Settings] = None,
                  environ: Optional[Mapping[str, str]] = None) -> Settings:
    """`base` (the replay's defaults when None) with one engine's settings
    (`engine_settings`) applied."""
    return apply_env(base or replay_defaults(), engine_settings(environ, additional_config))


def apply_env(settings: Settings, environ: Optional[Mapping[str, str]] = None) -> Settings:
    """`settings` with every exported ATOM_* variable applied; an unknown
    one is an error (a typo would otherwise be silently ignored)."""
    env = os.environ if environ is None else environ
    changes: dict[str, dict] = {"placement": {}, "server": {}, "settings": {}}
    for var, raw in env.items():
        if var.startswith("ATOM_") and var not in ENV_VARS:
            raise ConfigError(f"unknown setting {var}; known: {', '.join(sorted(ENV_VARS))}")
        if var in ENV_VARS:
            section, name, parse, _ = ENV_VARS[var]
            changes[section][name] = parse(var, raw)
    try:
        return dataclasses.replace(
            settings, placement=dataclasses.replace(settings.placement, **changes["placement"]),
            server=dataclasses.replace(settings.server, **changes["server"]),
            **changes["settings"])
    except ConfigError as e:
        names = ", ".join(v for v in ENV_VARS if v in env)
        raise ConfigError(f"{e} (from {names})") from None
