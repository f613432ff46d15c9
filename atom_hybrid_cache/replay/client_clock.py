"""The client's clock in a replay: when a conversation sends its next turn,
and how long a scheduler step takes.

Why: with every turn ready the moment its predecessor completes (the
saturated mode), every conversation in flight competes for the pool at
once, and a small pool thrashes at a cliff a real client never reaches: an
agent waits on its tools and a person reads, and meanwhile the others'
turns run. So a paced client sends turn i at the completion of turn i - 1
plus the trace's think time before turn i, capped at `max_think_s` (the
trace tool's own default, 600 s) and scaled by `time_scale`; the server's
step costs `prefill_s_per_token` per prefill token computed plus
`decode_s_per_step` when it decodes. `time_scale` 0 is the saturated mode:
no client time passes, the pool's worst case, reported as a bound.
"""

from __future__ import annotations

from dataclasses import dataclass

# The trace tool's cap on one think time.
MAX_THINK_S = 600.0
# A step's cost, roughly a 27B-class model on one H100-class GPU: 10k
# prefill tokens a second, a 30 ms decode step.
PREFILL_S_PER_TOKEN = 1e-4
DECODE_S_PER_STEP = 0.03


@dataclass(frozen=True)
class ClientClock:
    time_scale: float = 0.0
    max_think_s: float = MAX_THINK_S
    prefill_s_per_token: float = PREFILL_S_PER_TOKEN
    decode_s_per_step: float = DECODE_S_PER_STEP

    def __post_init__(self) -> None:
        for name in ("time_scale", "max_think_s", "prefill_s_per_token", "decode_s_per_step"):
            if getattr(self, name) < 0:
                raise ValueError(f"client clock: {name} must be >= 0, got {getattr(self, name)}")

    @property
    def saturated(self) -> bool:
        """No client time: every turn ready at its predecessor's completion."""
        return self.time_scale == 0

    def delay_s(self, think_s: float) -> float:
        """How long after its predecessor's completion a turn is sent."""
        return min(think_s, self.max_think_s) * self.time_scale

    def step_s(self, prefill_tokens: int, decodes: bool) -> float:
        """One scheduler step that computes `prefill_tokens` and, if
        `decodes`, a decode token for each decoding request."""
        return prefill_tokens * self.prefill_s_per_token + (self.decode_s_per_step if decodes
                                                            else 0.0)

    def describe(self) -> str:
        """The basis line's words for this clock."""
        if self.saturated:
            return ("saturated client (--time-scale 0: every turn sent at its predecessor's "
                    "completion, no think time): a bound on the pool's pressure")
        return (f"paced client: next turn at completion + min(think time, "
                f"{self.max_think_s:g} s) x {self.time_scale:g}; a step costs "
                f"{self.prefill_s_per_token * 1e6:g} us per prefill token + "
                f"{self.decode_s_per_step * 1e3:g} ms with decodes; sub-agents run as extra "
                f"lanes while their parent waits")
