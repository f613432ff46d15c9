"""Counters the manager keeps and the log lines it prints.

Per admission four prefix lengths (tokens) are nested:
  cached <= wanted <= compressed <= reusable
- reusable: what an unbounded cache would reuse (the never-reusable last
  block excluded);
- compressed: what the paged KV pool still holds of it;
- wanted: the part of that a state class could resume from at its own
  granularity (== compressed when every block boundary may hold a state);
- cached: what the request actually reuses (KV and a state checkpoint at the
  same boundary).
A violation means an accounting bug: tests raise, a live server warns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

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
    compressed: int = 0
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
    # vLLM's admission gate (vllm/admission_gate.py): the steps in which it
    # held a waiting request back, the requests held summed over those
    # steps, and the most steps one request was held
    gate_held_steps: int = 0
    gate_holds: int = 0
    gate_longest_hold: int = 0

    def record_admission(self, prompt_len: int, reusable: int, compressed: int,
                         wanted: int, cached: int) -> None:
        if not (0 <= cached <= wanted <= compressed <= reusable):
            msg = (f"cache stats nesting violated: cached={cached} wanted={wanted} "
                   f"compressed={compressed} reusable={reusable}")
            if self.strict:
                raise NestingError(msg)
            logger.warning(msg)
        self.admissions += 1
        self.prompt_tokens += prompt_len
        self.reusable += reusable
        self.compressed += compressed
        self.wanted += wanted
        self.cached += cached
        if cached == reusable:
            if reusable > 0:
                self.full_reuse += 1
        elif compressed == reusable:
            self.paged_match_state_miss += 1
            if wanted > cached:
                self.checkpoint_would_fix += 1
        else:
            self.paged_miss += 1
        if cached > 0:
            self.resumed += 1

    def record_resume_kind(self, kind: str) -> None:
        self.resumed_by_kind[kind] = self.resumed_by_kind.get(kind, 0) + 1

    def record_cut(self, kind: str) -> None:
        self.cuts_by_kind[kind] = self.cuts_by_kind.get(kind, 0) + 1

    def record_write(self, kind: str) -> None:
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
        return _ratio(self.compressed, self.reusable)

    @property
    def state_hit(self) -> float:
        return _ratio(self.cached, self.compressed)

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
            reusable=self.reusable, compressed=self.compressed, wanted=self.wanted,
            cached=self.cached, hit_over_reusable=_ratio(self.cached, self.reusable),
            lost_to_checkpoint=self.compressed - self.cached,
            lost_unrecoverable=self.reusable - self.compressed,
            paged_hit=self.paged_hit, state_hit=self.state_hit,
            combined=self.paged_hit * self.state_hit, binds=self.binding_pool(),
            full_reuse=self.full_reuse, paged_match_state_miss=self.paged_match_state_miss,
            checkpoint_would_fix=self.checkpoint_would_fix, paged_miss=self.paged_miss,
            resumed=self.resumed, resumed_by_kind=dict(self.resumed_by_kind),
            cuts_by_kind=dict(self.cuts_by_kind), written_by_kind=dict(self.written_by_kind),
            computed_prefill_tokens=self.computed_prefill_tokens,
        )


def format_stats_lines(stats: CacheStats, fates: dict, num_slots: int,
                       kv: dict, state: dict) -> list[str]:
    """The five log lines; `diagnose` parses exactly this format."""
    s = stats
    written = stats.checkpoint_writes
    return [
        f"[Cache Stats] admissions={s.admissions} reusable={s.reusable} cached={s.cached} "
        f"hit={_ratio(s.cached, s.reusable):.4f} lost_to_checkpoint={s.compressed - s.cached} "
        f"lost_unrecoverable={s.reusable - s.compressed}",
        f"[Cache Pools] paged_hit={s.paged_hit:.4f} state_hit={s.state_hit:.4f} "
        f"combined={s.paged_hit * s.state_hit:.4f} binds={s.binding_pool()}",
        f"[Cache Freq] requests={s.admissions} full_reuse={s.full_reuse} "
        f"paged_match_state_miss={s.paged_match_state_miss} "
        f"checkpoint_would_fix={s.checkpoint_would_fix} paged_miss={s.paged_miss}",
        f"[Checkpoint Fates] written={written} kept={fates['kept']} dropped={fates['dropped']} "
        f"evicted={fates['evicted']} orphaned={fates['orphaned']} read={fates['read']} "
        f"num_slots={num_slots}",
        "[Pool Pressure] " + " ".join(
            [f"kv_{k}={v}" for k, v in kv.items()] + [f"state_{k}={v}" for k, v in state.items()]),
    ]


def format_gate_line(stats: CacheStats) -> str:
    """The admission gate's log line (a vLLM server with the gate on)."""
    return (f"[Admission Gate] held_steps={stats.gate_held_steps} holds={stats.gate_holds} "
            f"longest_hold={stats.gate_longest_hold}")
