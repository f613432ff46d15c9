"""Counters the manager keeps and the log lines it prints.

Per admission four prefix lengths (tokens) are nested:
  cached <= wanted <= kv_reach <= reusable
- reusable: what an unbounded cache would reuse (the never-reusable last
  block excluded);
- kv_reach: what the paged KV pool still holds of it;
- wanted: the part of that a state class could resume from at its own
  granularity (== kv_reach when every block boundary may hold a state);
- cached: what the request actually reuses (KV and a state checkpoint at the
  same boundary).
A violation means an accounting bug: tests raise, a live server warns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .kinds import WRITTEN_KINDS

logger = logging.getLogger("atom_hybrid_cache")


class NestingError(AssertionError):
    pass


def _ratio(num: int, den: int) -> float:
    return num / den if den else 0.0


@dataclass
class CacheStats:
    strict: bool = False  # raise on a nesting violation instead of warning
    admissions: int = 0
    prompt_tokens: int = 0
    reusable: int = 0
    kv_reach: int = 0
    wanted: int = 0
    cached: int = 0
    computed_prefill_tokens: int = 0
    # per-request buckets
    full_reuse: int = 0
    paged_match_state_miss: int = 0
    checkpoint_would_fix: int = 0
    paged_miss: int = 0
    resumed: int = 0
    resumed_by_kind: dict = field(default_factory=dict)
    cuts_by_kind: dict = field(default_factory=dict)
    written_by_kind: dict = field(default_factory=dict)
    # planned checkpoints written from inside a prefill forward (besides
    # their kind in written_by_kind), and requests that held floor states
    interior_writes: int = 0
    floor_holds: int = 0
    # prompt-end states inside a page given back uncached at their
    # request's release: not worth their pages at the KV cut rate then
    # (core/tail_price.py)
    partial_tails_dropped: int = 0
    # vLLM's admission gate (vllm/admission_gate.py): the steps in which it
    # held a waiting request back, the requests held summed over those
    # steps, and the most steps one request was held
    gate_held_steps: int = 0
    gate_holds: int = 0
    gate_longest_hold: int = 0

    def record_admission(self, prompt_len: int, reusable: int, kv_reach: int,
                         wanted: int, cached: int) -> None:
        if not (0 <= cached <= wanted <= kv_reach <= reusable):
            msg = (f"cache stats nesting violated: cached={cached} wanted={wanted} "
                   f"kv_reach={kv_reach} reusable={reusable}")
            if self.strict:
                raise NestingError(msg)
            logger.warning(msg)
        self.admissions += 1
        self.prompt_tokens += prompt_len
        self.reusable += reusable
        self.kv_reach += kv_reach
        self.wanted += wanted
        self.cached += cached
        if cached == reusable:
            if reusable > 0:
                self.full_reuse += 1
        elif kv_reach == reusable:
            self.paged_match_state_miss += 1
            if wanted > cached:
                self.checkpoint_would_fix += 1
        else:
            self.paged_miss += 1
        if cached > 0:
            self.resumed += 1

    # counters by kind are keyed by the kind's plain name (JSON, metrics)
    def record_resume_kind(self, kind: str) -> None:
        kind = str(kind)
        self.resumed_by_kind[kind] = self.resumed_by_kind.get(kind, 0) + 1

    def record_cut(self, kind: str) -> None:
        kind = str(kind)
        self.cuts_by_kind[kind] = self.cuts_by_kind.get(kind, 0) + 1

    def record_write(self, kind: str) -> None:
        kind = str(kind)
        self.written_by_kind[kind] = self.written_by_kind.get(kind, 0) + 1

    def record_gate_step(self, steps_held: list) -> None:
        """One step in which the admission gate held requests back;
        `steps_held`: for each, the steps it has been held so far."""
        self.gate_held_steps += 1
        self.gate_holds += len(steps_held)
        self.gate_longest_hold = max(self.gate_longest_hold, *steps_held)

    # -- derived -------------------------------------------------------
    @property
    def hit_rate(self) -> float:
        """cached / prompt tokens, the figure a user sees as prompt cache hits."""
        return _ratio(self.cached, self.prompt_tokens)

    @property
    def paged_hit(self) -> float:
        return _ratio(self.kv_reach, self.reusable)

    @property
    def state_hit(self) -> float:
        return _ratio(self.cached, self.kv_reach)

    @property
    def checkpoint_writes(self) -> int:
        return sum(self.written_by_kind.values())

    def binding_pool(self) -> str:
        """The pool whose factor is lower: the one more memory should go to."""
        if self.reusable == 0:
            return "neither"
        if self.paged_hit >= 0.999 and self.state_hit >= 0.999:
            return "neither"
        return "state" if self.state_hit < self.paged_hit else "kv"

    def as_dict(self) -> dict:
        return dict(
            admissions=self.admissions, prompt_tokens=self.prompt_tokens,
            reusable=self.reusable, kv_reach=self.kv_reach, wanted=self.wanted,
            cached=self.cached, hit_over_reusable=_ratio(self.cached, self.reusable),
            lost_to_checkpoint=self.kv_reach - self.cached,
            lost_unrecoverable=self.reusable - self.kv_reach,
            paged_hit=self.paged_hit, state_hit=self.state_hit,
            combined=self.paged_hit * self.state_hit, binds=self.binding_pool(),
            full_reuse=self.full_reuse, paged_match_state_miss=self.paged_match_state_miss,
            checkpoint_would_fix=self.checkpoint_would_fix, paged_miss=self.paged_miss,
            resumed=self.resumed, resumed_by_kind=dict(self.resumed_by_kind),
            cuts_by_kind=dict(self.cuts_by_kind), written_by_kind=dict(self.written_by_kind),
            interior_writes=self.interior_writes, floor_holds=self.floor_holds,
            partial_tails_dropped=self.partial_tails_dropped,
            computed_prefill_tokens=self.computed_prefill_tokens,
        )


def _head_lines(s: CacheStats) -> list[str]:
    """The three lines both the replay and the plugin print first."""
    return [
        f"[Cache Stats] admissions={s.admissions} reusable={s.reusable} cached={s.cached} "
        f"hit={_ratio(s.cached, s.reusable):.4f} lost_to_checkpoint={s.kv_reach - s.cached} "
        f"lost_unrecoverable={s.reusable - s.kv_reach}",
        f"[Cache Pools] paged_hit={s.paged_hit:.4f} state_hit={s.state_hit:.4f} "
        f"combined={s.paged_hit * s.state_hit:.4f} binds={s.binding_pool()}",
        f"[Cache Freq] requests={s.admissions} full_reuse={s.full_reuse} "
        f"paged_match_state_miss={s.paged_match_state_miss} "
        f"checkpoint_would_fix={s.checkpoint_would_fix} paged_miss={s.paged_miss}",
    ]


def format_kinds_line(s: CacheStats) -> str:
    """Checkpoints written by kind, every kind named (0 where none)."""
    written = " ".join(f"{k}={s.written_by_kind.get(k.value, 0)}" for k in WRITTEN_KINDS)
    return (f"[Checkpoint Kinds] {written} interior={s.interior_writes} "
            f"floor_holds={s.floor_holds} partial_tails_dropped={s.partial_tails_dropped}")


def format_stats_lines(stats: CacheStats, fates: dict, num_slots: int,
                       kv: dict, state: dict) -> list[str]:
    """The replay manager's lines (its KV blocks and state slots apart);
    `diagnose` parses exactly this format."""
    return _head_lines(stats) + [
        f"[Checkpoint Fates] written={stats.checkpoint_writes} kept={fates['kept']} "
        f"dropped={fates['dropped']} evicted={fates['evicted']} orphaned={fates['orphaned']} "
        f"read={fates['read']} num_slots={num_slots}",
        "[Pool Pressure] " + " ".join(
            [f"kv_{k}={v}" for k, v in kv.items()] + [f"state_{k}={v}" for k, v in state.items()]),
        format_kinds_line(stats),
    ]


def format_shared_pool_lines(stats: CacheStats, pool: dict, gate_on: bool) -> list[str]:
    """The vLLM plugin's lines: states are pages of vLLM's one shared pool,
    which evicts silently, so the pool's state is given instead of slot
    fates (`pool`: pages, free, used); `diagnose` parses this format too."""
    lines = _head_lines(stats) + [
        "[Shared Pool] " + " ".join(f"{k}={v}" for k, v in pool.items())
        + f" states_written={stats.checkpoint_writes} states_read={stats.resumed}",
        format_kinds_line(stats),
    ]
    if gate_on:
        lines.append(format_gate_line(stats))
    return lines


def format_gate_line(stats: CacheStats) -> str:
    """The admission gate's log line (a vLLM server with the gate on)."""
    return (f"[Admission Gate] held_steps={stats.gate_held_steps} holds={stats.gate_holds} "
            f"longest_hold={stats.gate_longest_hold}")


# -- counters as deltas (what the vLLM adapter sends to /metrics) ---------

def counter_snapshot(stats: CacheStats, names, kind_names) -> dict:
    """The counters `names` (ints) and `kind_names` (dicts by kind) now."""
    snap = {name: getattr(stats, name) for name in names}
    snap.update({name: dict(getattr(stats, name)) for name in kind_names})
    return snap


def counter_delta(now: dict, before: dict) -> dict:
    """How far each counter of a snapshot moved; only the ones that did."""
    out: dict = {}
    for name, value in now.items():
        if isinstance(value, dict):
            old = before.get(name, {})
            moved = {k: v - old.get(k, 0) for k, v in value.items() if v != old.get(k, 0)}
        else:
            moved = value - before.get(name, 0)
        if moved:
            out[name] = moved
    return out


def add_counter_delta(into: dict, delta: dict) -> dict:
    """`into` plus `delta` (both as `counter_delta` gives them)."""
    for name, value in delta.items():
        if isinstance(value, dict):
            mine = into.setdefault(name, {})
            for k, v in value.items():
                mine[k] = mine.get(k, 0) + v
        else:
            into[name] = into.get(name, 0) + value
    return into


def flat_counters(delta: dict) -> dict:
    """One level, by-kind counters as `name[kind]`, in name order."""
    out: dict = {}
    for name, value in sorted(delta.items()):
        if isinstance(value, dict):
            out.update({f"{name}[{k}]": v for k, v in sorted(value.items())})
        else:
            out[name] = value
    return out
