"""Every setting of the plugin and its `ATOM_*` environment variables.

One place parses and validates them, at start-up, with errors that name the
offending setting. Unset variables change nothing: the dataclass defaults (or
the values a caller passes) stand.
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
# Steps the admission gate may hold a request before it goes through like
# any other (see atom_hybrid_cache/vllm/admission_gate.py).
ADMISSION_GATE_MAX_HOLD_STEPS = 32

# Checkpoint-only slots per request slot when state_checkpoint_slots is not
# set: room for each conversation's anchor, its insurance one block lower,
# branch points it was asked to resume from, and the anchors of a few turns
# back. BENCHMARKS.md's sweep shows fewer losing hits and more costing KV.
DEFAULT_HEADROOM_PER_SEQ = 8

# The prefix-hash unit the plugin gives vLLM when `--prefix-match-unit` is
# unset (or the block's largest divisor below it): vLLM's default
# unit for a hybrid model is its block, raised to a state page (hundreds of
# tokens), and a resume can land only on a unit boundary. vLLM's flag wins.
PREFIX_MATCH_UNIT_TOKENS = 64

# Admissions between two stats reports in a vLLM server when
# ATOM_STATS_LOG_INTERVAL is unset (the replay planner reports at its end).
SERVER_STATS_LOG_INTERVAL = 100

# The plugin's cold ladder in a vLLM server when ATOM_STATE_CHECKPOINT_COLD
# is unset (`PlacementConfig.cold_fractions`). Agentic clients rewrite a
# conversation below its last prompt end now and then (a compaction, a
# retry), and 69 of the 133 such rewrites in the shared cc traces keep only
# part of the conversation's first prompt, often its system prompt and
# tools (benchmarks/rewrite_study.py): only a state inside that prompt
# saves them. In vLLM's shared page
# pool these states gained on every workload set measured, with room and
# under pressure (pools too small to afford them go without:
# core.placement.MIN_POOL_CHECKPOINTS); in the core's own state slots
# (the replay planner) they cost other checkpoints their slots, so the
# core's default stays off (BENCHMARKS.md, "The cold ladder").
SERVER_COLD_FRACTIONS = (0.5, 0.875)

# The floor states a live request holds in a vLLM server when
# ATOM_STATE_CHECKPOINT_FLOOR is unset (`PlacementConfig.floor_fractions`,
# atom_hybrid_cache/vllm/floor_states.py).
SERVER_FLOOR_FRACTIONS = (0.25, 0.5)

# The admission gate in a vLLM server when ATOM_ADMISSION_GATE is unset
# (`CacheConfig.admission_gate`, atom_hybrid_cache/vllm/admission_gate.py).
# vLLM's admission lets the first requests of a round that does not fit
# evict the cached prefixes of the requests waiting behind them; without
# the gate the plugin kept no more than an attention-only model under the
# same admission (0.941 against 0.940 of the oracle on the plan's traces at
# 0.83x the live working set). "auto": on, except in a pool under
# core.placement.MIN_POOL_CHECKPOINTS checkpoints' worth (the two such pools
# measured lost with it) and for a model without state groups. It gained
# under pressure on every larger workload measured and holds a request in
# 32 steps at most (BENCHMARKS.md, "The admission gate by default").
SERVER_ADMISSION_GATE = "auto"


class ConfigError(ValueError):
    """A setting has a bad value; the message names the setting."""


@dataclass(frozen=True)
class PlacementConfig:
    """Where checkpoints go and how they are evicted."""

    # >0: a rung every N tokens; 0: no state checkpoints at all; -1: no
    # rungs, while the anchor and the demand rung still place checkpoints.
    interval_tokens: int = -1
    demand: bool = True
    anchor: bool = True
    # tokens at a prompt's end assumed to change when the client appends.
    anchor_margin_tokens: int = 1
    eviction: str = "reuse-aware"
    # After a KV tail cut, checkpoints these fractions of the surviving
    # prefix below it, so the next, similar cut still leaves one to resume.
    cut_backoffs: tuple = (0.03, 0.15, 0.4)
    # Fallback rungs, as fractions of a request's share of the KV pool, in
    # prompts longer than that share.
    fallback_fractions: tuple = (0.5, 0.85)
    # When a request is released, the highest state at or below each of
    # these fractions of its prefix goes back to the LRU with the prefix's
    # KV, in its unit, besides the state it resumed from. Dense near the
    # top: as a conversation grows, its recent turns' anchors are kept and
    # slide down to the lower fractions, instead of aging out while their
    # KV stays in use, so a cut under pressure finds a state near it.
    # (AtomScheduler's release; the core's manager keeps states by tier.)
    retain_fractions: tuple = (0.5, 0.75, 0.875, 0.94)
    # A prompt computed mostly from scratch (resumed below half its length)
    # starts or restarts a conversation. Its next turns resume at its end,
    # so for a while its only states are its turns' anchors, all near the
    # top, and a short cut under pressure costs the whole prompt. It also
    # keeps a checkpoint at each of these fractions of its length. Off in
    # the core's own pools; a vLLM server defaults to SERVER_COLD_FRACTIONS.
    cold_fractions: tuple = ()
    # Any prompt keeps a checkpoint at each of these fractions of its length
    # that falls inside the span its prefill computes (above its hit, below
    # its anchor); for a cold prompt these are COLD's. Off by default (see
    # BENCHMARKS.md, "Checkpoints inside a long span": in vLLM +0.001-0.006
    # at 1.0x and higher on 13 of 15 means at 0.83x; the replay planner
    # loses up to 0.11 point with it and writes past 1.2 per resumed hit).
    span_fractions: tuple = ()
    # While a request waits in vLLM's admission window or runs, the highest
    # state at or below each of these fractions of its prompt is held (not
    # evictable) until its release. Its KV is held then too, so the round's
    # new pages are taken from the states under it; without a floor a few
    # rounds of that leave a long prefix with no state at all, and the next
    # cut costs all of it. vLLM's shared pool only (the core's manager keeps
    # states by tier); off in the core, a vLLM server defaults to
    # SERVER_FLOOR_FRACTIONS.
    floor_fractions: tuple = ()
    # protected anchors/cut checkpoints per request slot (max_num_seqs).
    protected_per_seq: int = 7
    # a prefill that recomputes at least this many tokens also keeps a
    # fallback one block below its anchor (0: never)
    insure_recompute_tokens: int = 16384
    # how far below the anchor that insurance sits (rounded up to a block):
    # clients rewrite the last 1-3 blocks of 64 tokens now and then
    insure_distance_tokens: int = 256
    # kinds filed in the protected tier
    protected_kinds: tuple = ("anchor", "cut", "demand", "fallback")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int = 1024
    max_num_seqs: int = 8
    num_spec: int = 0
    # headroom: checkpoint-only slots on top of max_num_seqs * (1 + num_spec);
    # None: DEFAULT_HEADROOM_PER_SEQ per request slot
    state_checkpoint_slots: Optional[int] = None
    successor_room: int = 1
    # how many tokens of KV one state checkpoint's bytes would hold (the
    # replay planner's geometry gives it; 0: unknown): the cold ladder needs
    # a pool of many (placement.MIN_POOL_CHECKPOINTS) and states that
    # can save a few (placement.COLD_MIN_SAVING)
    checkpoint_kv_tokens: int = 0
    interior_states_readable: bool = False
    # vLLM plugin: "on" writes planned checkpoints from inside a prefill
    # forward where this package has an extraction path for the platform
    # (vLLM's CPU GDN path); "off" cuts prefill chunks onto them
    interior_checkpoints: str = "off"
    # vLLM plugin: "hits-first" admits the waiting requests that resume on a
    # cached prefix first (largest hit first); "arrival" keeps vLLM's order
    admission_order: str = "arrival"
    # vLLM plugin: "on" holds a waiting request whose prefill would evict the
    # cached prefixes of the requests waiting with it (see AdmissionGate);
    # a vLLM server defaults to SERVER_ADMISSION_GATE
    admission_gate: str = "off"
    stats_log_interval: int = 0
    strict_stats: bool = False
    # Replay only: a free state at every block boundary, i.e. an
    # attention-only model with this KV pool (the hit-rate ceiling).
    kv_only_ceiling: bool = False
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    @property
    def live_slots(self) -> int:
        return self.max_num_seqs * (1 + self.num_spec)

    @property
    def num_state_slots(self) -> int:
        return self.live_slots + self.state_checkpoint_slots

    def __post_init__(self) -> None:
        if self.state_checkpoint_slots is None and isinstance(self.max_num_seqs, int):
            object.__setattr__(self, "state_checkpoint_slots",
                               DEFAULT_HEADROOM_PER_SEQ * self.max_num_seqs)
        validate(self)


def _positive(name: str, v: int) -> None:
    if not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {v!r}")


def _non_negative(name: str, v: int) -> None:
    if not isinstance(v, int) or v < 0:
        raise ConfigError(f"{name} must be an integer >= 0, got {v!r}")


def _one_of(name: str, v, choices: tuple) -> None:
    if v not in choices:
        raise ConfigError(f"{name} must be one of {choices}, got {v!r}")


def _fractions(name: str, values: tuple) -> None:
    for f in values:
        if not 0.0 < f < 1.0:
            raise ConfigError(f"{name} fractions must be in (0, 1), got {f!r}")


def validate(cfg: CacheConfig) -> None:
    _positive("block_size", cfg.block_size)
    if cfg.num_kv_blocks < 2:
        raise ConfigError(f"num_kv_blocks must be >= 2 (block 0 is the null block), got {cfg.num_kv_blocks}")
    _positive("max_num_seqs", cfg.max_num_seqs)
    _non_negative("num_spec", cfg.num_spec)
    _non_negative("state_checkpoint_slots", cfg.state_checkpoint_slots)
    _positive("successor_room", cfg.successor_room)
    _non_negative("checkpoint_kv_tokens", cfg.checkpoint_kv_tokens)
    _non_negative("stats_log_interval", cfg.stats_log_interval)
    _one_of("admission_order", cfg.admission_order, ADMISSION_ORDERS)
    _one_of("admission_gate", cfg.admission_gate, ADMISSION_GATE_MODES)
    _one_of("interior_checkpoints", cfg.interior_checkpoints, INTERIOR_CHECKPOINT_MODES)
    p = cfg.placement
    if not isinstance(p.interval_tokens, int) or p.interval_tokens < -1:
        raise ConfigError("state_checkpoint_interval_tokens must be > 0, 0 (off) or -1 "
                          f"(no ladder), got {p.interval_tokens!r}")
    _non_negative("state_checkpoint_anchor_margin", p.anchor_margin_tokens)
    _one_of("state_checkpoint_eviction", p.eviction, EVICTION_POLICIES)
    for f in p.cut_backoffs:
        if not 0.0 <= f < 1.0:
            raise ConfigError(f"state_checkpoint_cut_backoff fractions must be in [0, 1), got {f!r}")
    _fractions("state_checkpoint_fallback", p.fallback_fractions)
    _fractions("state_checkpoint_retain", p.retain_fractions)
    _fractions("state_checkpoint_cold", p.cold_fractions)
    _fractions("state_checkpoint_span", p.span_fractions)
    _fractions("state_checkpoint_floor", p.floor_fractions)
    _non_negative("protected_per_seq", p.protected_per_seq)
    _non_negative("state_checkpoint_insure_tokens", p.insure_recompute_tokens)
    _non_negative("state_checkpoint_insure_distance", p.insure_distance_tokens)


# -- environment ---------------------------------------------------------

def _parse_int(var: str, raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigError(f"{var}={raw!r} is not an integer") from None


def _parse_float(var: str, raw: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        raise ConfigError(f"{var}={raw!r} is not a number") from None


def _parse_switch(var: str, raw: str) -> bool:
    v = raw.strip()
    if v == "1":
        return True
    if v == "0":
        return False
    raise ConfigError(f"{var}={raw!r} must be 1 (on) or 0 (off)")


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


# variable -> (section, field, parser, help)
ENV_VARS: dict[str, tuple[str, str, Callable, str]] = {
    "ATOM_STATE_CHECKPOINT_INTERVAL_TOKENS": (
        "placement", "interval_tokens", _parse_int,
        ">0 a ladder rung every N tokens (snapped down to the block size); 0 no state "
        "checkpoints at all; -1 no ladder, anchor and demand rungs only"),
    "ATOM_STATE_CHECKPOINT_DEMAND": (
        "placement", "demand", _parse_switch,
        "1/0: place a checkpoint where a request wanted to resume but found none"),
    "ATOM_STATE_CHECKPOINT_SLOTS": (
        "cache", "state_checkpoint_slots", _parse_int,
        "checkpoint-only state slots on top of max_num_seqs*(1+num_spec), paid from the KV budget"),
    "ATOM_STATE_CHECKPOINT_EVICTION": (
        "placement", "eviction", _parse_choice(EVICTION_POLICIES),
        "reuse-aware (guesses at the LRU head, anchors at the tail, protected anchors) or lru"),
    "ATOM_STATE_CHECKPOINT_ANCHOR_MARGIN": (
        "placement", "anchor_margin_tokens", _parse_int,
        "tokens at a prompt's end assumed to change when the client appends"),
    "ATOM_STATE_CHECKPOINT_CUT_BACKOFF": (
        "placement", "cut_backoffs", _parse_fractions,
        "comma list: after a KV tail cut, keep checkpoints these fractions below the surviving prefix"),
    "ATOM_STATE_CHECKPOINT_FALLBACK": (
        "placement", "fallback_fractions", _parse_fractions,
        "comma list of fractions of the pool share for fallback rungs in prompts longer than that share"),
    "ATOM_STATE_CHECKPOINT_RETAIN": (
        "placement", "retain_fractions", _parse_fractions,
        "comma list: on release, the highest state at or below each fraction of the prefix is kept with its KV"),
    "ATOM_STATE_CHECKPOINT_COLD": (
        "placement", "cold_fractions", _parse_fractions,
        "comma list: a prompt resumed below half its length also keeps a checkpoint at each "
        "fraction of its length (unset: 0.5,0.875 in a vLLM server, none in the replay "
        "planner; empty: none)"),
    "ATOM_STATE_CHECKPOINT_SPAN": (
        "placement", "span_fractions", _parse_fractions,
        "comma list: any prompt also keeps a checkpoint at each fraction of its length that its "
        "prefill computes (above its hit; unset: none)"),
    "ATOM_STATE_CHECKPOINT_FLOOR": (
        "placement", "floor_fractions", _parse_fractions,
        "comma list: a request waiting for admission or running holds the highest state at or "
        "below each fraction of its prompt until its release (unset: 0.25,0.5 in a vLLM "
        "server, none in the replay planner; empty: none)"),
    "ATOM_STATE_CHECKPOINT_INSURE_TOKENS": (
        "placement", "insure_recompute_tokens", _parse_int,
        "a prefill recomputing at least N tokens also keeps a checkpoint one block below its anchor (0: never)"),
    "ATOM_STATE_CHECKPOINT_INSURE_DISTANCE": (
        "placement", "insure_distance_tokens", _parse_int,
        "how many tokens below the anchor that insurance checkpoint sits (rounded up to a block)"),
    "ATOM_INTERIOR_CHECKPOINTS": (
        "cache", "interior_checkpoints", _parse_choice(INTERIOR_CHECKPOINT_MODES),
        "on: write checkpoints from inside a prefill forward where the platform has the "
        "extraction path (vLLM's CPU GDN path; elsewhere chunks are still cut); "
        "off: cut prefill chunks onto them"),
    "ATOM_ADMISSION_ORDER": (
        "cache", "admission_order", _parse_choice(ADMISSION_ORDERS),
        "hits-first: among the first max_num_seqs waiting requests, admit those that resume on a "
        "cached prefix first, largest hit first; arrival: vLLM's order"),
    "ATOM_ADMISSION_GATE": (
        "cache", "admission_gate", _parse_choice(ADMISSION_GATE_MODES),
        "on: a waiting request whose prefill would evict the cached prefixes of the requests "
        f"waiting with it waits for the running ones to finish ({ADMISSION_GATE_MAX_HOLD_STEPS} "
        "steps at most), and those prefixes cannot be evicted while a step is scheduled; off: "
        "vLLM's admission; auto (a vLLM server's default): on for a hybrid model whose KV pool "
        "holds at least 100 checkpoints' worth, off otherwise"),
    "ATOM_STATS_LOG_INTERVAL": (
        "cache", "stats_log_interval", _parse_int,
        "print the cache log lines every N admissions (0: never)"),
}


# vLLM's channel for options of what it loads (its own GDN layers read
# theirs there too): `--additional-config '{"atom_hybrid_cache": {...}}'`.
ADDITIONAL_CONFIG_KEY = "atom_hybrid_cache"


def engine_settings(environ: Optional[Mapping[str, str]] = None,
                    additional_config: object = None) -> dict:
    """The ATOM_* settings of one vLLM engine, as `apply_env` takes them:
    the exported variables, then the entries of vLLM's
    `--additional-config '{"atom_hybrid_cache": {"ATOM_...": value}}'`,
    which win (one engine's settings over the process's). A value may be a
    string, a number, a boolean (1/0) or a list (comma-joined). Every entry
    is parsed here, so an error names where it came from."""
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


def server_config() -> CacheConfig:
    """The defaults of a vLLM server with the plugin, before its ATOM_*
    settings: the core's, with stats reported every
    SERVER_STATS_LOG_INTERVAL admissions, the cold ladder
    SERVER_COLD_FRACTIONS, the floor states SERVER_FLOOR_FRACTIONS and the
    admission gate SERVER_ADMISSION_GATE."""
    return CacheConfig(stats_log_interval=SERVER_STATS_LOG_INTERVAL,
                       admission_gate=SERVER_ADMISSION_GATE,
                       placement=PlacementConfig(cold_fractions=SERVER_COLD_FRACTIONS,
                                                 floor_fractions=SERVER_FLOOR_FRACTIONS))


def engine_config(additional_config: object = None, base: Optional[CacheConfig] = None,
                  environ: Optional[Mapping[str, str]] = None) -> CacheConfig:
    """`base` (the defaults when None) with one vLLM engine's settings
    applied: the exported ATOM_* variables and its --additional-config
    (`engine_settings`)."""
    return apply_env(base or CacheConfig(), engine_settings(environ, additional_config))


def apply_env(cfg: CacheConfig, environ: Optional[Mapping[str, str]] = None) -> CacheConfig:
    """`cfg` with every exported ATOM_* variable applied; unknown ATOM_*
    variables are an error (a typo would otherwise be silently ignored)."""
    env = os.environ if environ is None else environ
    cache_kw: dict = {}
    placement_kw: dict = {}
    for var, raw in env.items():
        if not var.startswith("ATOM_"):
            continue
        if var not in ENV_VARS:
            raise ConfigError(f"unknown setting {var}; known: {', '.join(sorted(ENV_VARS))}")
        section, name, parse, _ = ENV_VARS[var]
        value = parse(var, raw)
        (placement_kw if section == "placement" else cache_kw)[name] = value
    placement = dataclasses.replace(cfg.placement, **placement_kw)
    try:
        return dataclasses.replace(cfg, placement=placement, **cache_kw)
    except ConfigError as e:
        names = ", ".join(v for v in ENV_VARS if v in env)
        raise ConfigError(f"{e} (from {names})") from None
