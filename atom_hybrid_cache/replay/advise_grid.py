"""The settings `atom-hybrid-cache advise` sweeps (`advise.py` runs them):
the candidates, each the ATOM_* variables that differ from the server's
defaults, and the help text that names them.

The grid: the prefix-hash unit (the plugin's 64 tokens or vLLM's page), a
state ladder, the cold checkpoints and the states a release retains (each
setting the shared-pool model runs); then, around the best of those, the
admission gate, the floor states, priced eviction and the fallback rungs;
last, on the best of all, the admission order. Each candidate's variables
are parsed back through `config.load_settings` over the server's defaults,
so what is printed is what a server would read.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from ..config import (ENV_VARS, MAX_HASH_UNIT_TOKENS, SERVER_ADMISSION_GATE,
                      SERVER_COLD_FRACTIONS, SERVER_FLOOR_FRACTIONS, Settings, load_settings,
                      server_defaults)
from ..core.priced_eviction import AUTO_PRICE_WEIGHT

# The hash unit the plugin picks where `--prefix-match-unit` is unset
# (vllm/registration.py plugin_hash_unit: the largest unit up to 64 that
# divides the page, and the planner's pages are multiples of 64).
PLUGIN_HASH_UNIT = MAX_HASH_UNIT_TOKENS
PAGE_UNIT = "page"

# A rung every this many tokens: the ladder the replay's `ladder-8192` runs.
LADDER_TOKENS = 8192



def env_var(section: str, name: str) -> str:
    """The ATOM_* variable of one settings field (config.ENV_VARS is the
    one place that names them)."""
    for var, (sec, field_name, _, _) in ENV_VARS.items():
        if (sec, field_name) == (section, name):
            return var
    raise KeyError(f"no variable for {section}.{name}")


# One axis: (label, section, field, values); the first value is the
# server's default, which a candidate leaves unset.
PLACEMENT_AXES = (
    ("interval", "placement", "interval_tokens", (-1, LADDER_TOKENS)),
    ("cold", "placement", "cold_fractions", (SERVER_COLD_FRACTIONS, ())),
    ("retain", "placement", "retain_fractions", ((0.5, 0.75, 0.875, 0.94), ())),
)
HASH_UNITS = (PLUGIN_HASH_UNIT, PAGE_UNIT)
# The second stage, around the first stage's choice, where the planner runs
# them (each doubles the grid, and where a slot's share is under 32
# checkpoints' worth the floors are off, so part of it would repeat).
SERVER_AXES = (
    ("gate", "server", "admission_gate", (SERVER_ADMISSION_GATE, "on", "off")),
    ("floor", "server", "floor_fractions", (SERVER_FLOOR_FRACTIONS, ())),
    # priced eviction: auto (priced in small pools), off, on at any size
    # (a candidate equal to auto in its pool runs once)
    ("price", "placement", "eviction_price_weight", (None, 0.0, AUTO_PRICE_WEIGHT)),
    # fallback rungs in prompts longer than a slot's share: on, off (they
    # cost paced traffic that thrashes and gain saturated traffic cut at
    # the share: BENCHMARKS.md, "The request slot's share under a paced
    # client")
    ("fallback", "placement", "fallback_fractions", ((0.5, 0.85), ())),
)

# The third stage, on the second's choice: hits first reorders the window
# the gate then judges, so it is tried on the gate that won (one candidate).
ORDER_AXES = (("order", "server", "admission_order", ("arrival", "hits-first")),)


GRID_HELP = (
    f"(1) hash unit {{{PLUGIN_HASH_UNIT} (the plugin's), the page (--prefix-match-unit PAGE)}} x "
    f"{env_var('placement', 'interval_tokens')} {{-1 (no ladder), {LADDER_TOKENS}}} x "
    f"{env_var('placement', 'cold_fractions')} {{0.5,0.875, none}} x "
    f"{env_var('placement', 'retain_fractions')} {{0.5,0.75,0.875,0.94, none}}: 16 candidates; "
    f"(2) on the best of (1): {env_var('server', 'admission_gate')} {{auto, on, off}} x "
    f"{env_var('server', 'floor_fractions')} {{0.25,0.5, none}} x "
    f"{env_var('placement', 'eviction_price_weight')} {{auto, 0, {AUTO_PRICE_WEIGHT:g}}} x "
    f"{env_var('placement', 'fallback_fractions')} {{0.5,0.85, none}}; "
    "(3) on the best of all: "
    f"{env_var('server', 'admission_order')} {{arrival, hits-first}}. The first value of each "
    "is the default.")


def format_value(value) -> str:
    """A setting's value as its variable takes it (None: `auto`)."""
    if value is None:
        return "auto"
    if isinstance(value, tuple):
        return ",".join(f"{x:g}" for x in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# The admission gate, the floor states and priced eviction off: the second
# stage runs them together around any choice; `advise` names them where they
# buy nothing (`advise.lighter_of`)
LIGHTER_ENV = tuple((env_var(section, name), format_value(value)) for section, name, value in (
    ("server", "admission_gate", "off"), ("server", "floor_fractions", ()),
    ("placement", "eviction_price_weight", 0.0)))


@dataclass(frozen=True)
class Candidate:
    """One point of the grid: a hash unit and the ATOM_* variables that
    differ from the server's defaults."""

    hash_unit: object                 # PLUGIN_HASH_UNIT or PAGE_UNIT
    env: tuple = ()                   # ((variable, value), ...)

    @property
    def is_default(self) -> bool:
        return self.hash_unit == PLUGIN_HASH_UNIT and not self.env

    def settings(self) -> Settings:
        """The server's settings with this candidate's variables, parsed
        and validated as a server parses them."""
        return load_settings(None, server_defaults(), environ=dict(self.env))

    def label(self) -> str:
        return "defaults" if self.is_default else " ".join(
            ([f"unit={self.hash_unit}"] if self.hash_unit != PLUGIN_HASH_UNIT else [])
            + [f"{v}={shlex.quote(val)}" for v, val in self.env])


def combinations(axes) -> list:
    """Every combination of the axes' values as ((variable, value), ...),
    a default value left unset; all defaults first."""
    combos = [()]
    for _, section, name, values in axes:
        var = env_var(section, name)
        combos = [c + (() if i == 0 else ((var, format_value(v)),))
                  for c in combos for i, v in enumerate(values)]
    return combos


def grid() -> list[Candidate]:
    """The first stage: every hash unit and placement combination, the
    defaults first."""
    return [Candidate(unit, env) for unit in HASH_UNITS
            for env in combinations(PLACEMENT_AXES)]


def around(base: Candidate, axes: tuple = SERVER_AXES) -> list[Candidate]:
    """`base` with each combination of `axes` (default: the second
    stage's; `base` itself left out)."""
    return [Candidate(base.hash_unit, base.env + extra)
            for extra in combinations(axes)[1:]]
